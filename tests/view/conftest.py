"""Session fixtures of the viewer tests: real runs (tests/view/runs.py), a headless browser."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import need


@pytest.fixture(scope="session")
def view_runs(demo_image, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``{"oracle": run dir, "hostile": run dir}``, made once."""
    from et_hpc.testing.scripted_server import ScriptedServer
    from view.runs import hostile_script, make_runs

    with ScriptedServer(hostile_script()) as srv:
        return make_runs(tmp_path_factory.mktemp("view-runs"), srv.base_url)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory):
    need("chromium")
    from view.browser import Browser

    b = Browser(tmp_path_factory.mktemp("chromium"))
    yield b
    b.close()
