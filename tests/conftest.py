"""Shared test fixtures, and the gate for tests that need a tool.

The suite mirrors the package: ``tests/<folder>/`` tests ``et_hpc/<folder>/`` (``tests/runs/`` the run
store and its readers), and ``tests/`` itself holds the whole-project tests. Helpers that tests import
by name live in ``tests/helpers/`` (``tests/`` is on pytest's ``pythonpath``; test modules are
imported with ``--import-mode=importlib``, so two folders may hold files of the same name).

Tests run as an unprivileged user (as on a cluster): apptainer refuses to work as root here.
A test that needs apptainer or Slurm says so with ``@pytest.mark.apptainer`` / ``@pytest.mark.slurm``
(or a module's ``pytestmark``); that is the one way a test names a tool. A test that uses the base
image (``base_sif``, directly or through another fixture) carries the ``apptainer`` marker by itself.
Fixtures cannot carry markers, so a fixture that needs a tool calls ``helpers.need`` itself
(``base_sif`` does), the same check the markers apply. Outside CI a missing tool skips; under
``CI=true`` it fails, because CI must have every tool.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import FIXTURES, TOOLS, build_user_sif, need

# tests/fixtures/ holds real tasks whose own test files are data for et-hpc, not tests of it
collect_ignore = ["fixtures"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that uses the base image (``base_sif``, directly or through another fixture) needs
    apptainer: it carries the ``apptainer`` marker without saying so (``-m "not apptainer"`` leaves it out)."""
    for item in items:
        if "base_sif" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.apptainer)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """The ``apptainer`` and ``slurm`` markers apply ``need()`` before any fixture is set up."""
    need(*(what for what in TOOLS if item.get_closest_marker(what) is not None))


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    need("fixtures")
    return FIXTURES


@pytest.fixture(scope="session")
def base_sif() -> Path:
    """The cached offline base image (built once per cache; a no-op when present)."""
    need("apptainer")
    from et_hpc.images.base import ensure_base

    return ensure_base(source=os.environ.get("ET_HPC_BASE_SOURCE", "debian")).path


@pytest.fixture(scope="session")
def demo_image(base_sif: Path):
    """The demo task's image in the default cache (built once, then a lookup)."""
    from et_hpc.images.store import ImageStore
    from et_hpc.tasks.loader import load_tasks
    from helpers.demo import DEMO, TASK

    task = next(t for t in load_tasks(str(DEMO)).tasks if t.id == TASK)
    img = ImageStore().ensure(task)
    assert img.path is not None and Path(img.path).exists(), img
    return img


@pytest.fixture(scope="session")
def task_sif(base_sif: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A task image for the red-team tests: /home/user/notes.txt holds 'keep me'."""
    return build_user_sif(base_sif, tmp_path_factory.mktemp("redteam-image"), r"printf 'keep me\n' > /home/user/notes.txt")


@pytest.fixture(scope="session")
def task_cas_tree(task_sif: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``task_sif`` stored in the CAS layout and made on this node by hard links (et_hpc.images.cas_node)."""
    import json

    from et_hpc.images import cas
    from et_hpc.images.cas_node import cas_tree

    d = tmp_path_factory.mktemp("redteam-cas")
    man, _ = cas.ingest_sif(d / "cache", task_sif, scratch=d)
    ref = d / "cache" / "images" / "ca" / ("ca" * 32 + ".cas")
    ref.parent.mkdir(parents=True)
    ref.write_text(json.dumps({"manifest": man}))
    tree = cas_tree(ref, man, scratch=d / "scratch")
    tree.release()  # nothing evicts it in the session
    return tree.path


@pytest.fixture(scope="session")
def task_tree(task_sif: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``task_sif`` unpacked as ``sandbox.local_copy: unpack`` does (a directory instances start from)."""
    from et_hpc.images.local_copy import local_tree

    tree = local_tree(task_sif, None, scratch=tmp_path_factory.mktemp("redteam-tree"))
    tree.release()  # nothing evicts it in the session
    return tree.path
