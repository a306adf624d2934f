"""The rig's requirement check names a working directory the nodes cannot see (their /tmp is their
own), so a checkout under /tmp gets one line instead of jobs that fail at once on every node."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from helpers.rig import node_local_paths


def test_a_working_directory_under_tmp_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    d = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        monkeypatch.chdir(d)
        why = node_local_paths()
    finally:
        monkeypatch.undo()
        d.rmdir()
    assert why is not None and "working directory" in why and str(d.resolve()) in why


def test_a_working_directory_in_the_home_is_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(Path.home())
    why = node_local_paths()
    # the checkout and virtualenv may themselves be under /tmp outside CI; never the directory
    assert why is None or "working directory" not in why
