"""The cluster tests run on the multi-node rig (scripts/rig, docs/rig.md): nodes rig1..rig3 in
partition ``multi``, each with its own hostname, address and node-local /tmp, sharing the home.
Every test here needs it: outside CI a missing rig skips, under ``CI=true`` it fails."""

from __future__ import annotations

import shutil

import pytest

from helpers import need
from helpers.rig import shared_dir


@pytest.fixture(autouse=True)
def _rig_up() -> None:
    need("slurm", "rig")


@pytest.fixture
def shared(request: pytest.FixtureRequest):
    """A folder every node sees (under the shared home; the nodes' /tmp is their own)."""
    d = shared_dir(request.node.name[:40].replace("[", "-").replace("]", ""))
    yield d
    shutil.rmtree(d, ignore_errors=True)
