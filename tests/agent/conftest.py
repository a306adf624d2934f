"""Fixtures for the agent tests."""

from __future__ import annotations

import pytest

from et_hpc.sandbox.shell import Shell


@pytest.fixture
def shell(tmp_path):
    """A persistent Shell on a host bash (no profile, no rc files), its home under ``tmp_path``."""
    home = tmp_path / "home"
    home.mkdir()
    with Shell(["bash", "--noprofile", "--norc"], home=str(home)) as sh:
        yield sh
