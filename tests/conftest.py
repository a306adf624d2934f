"""Shared test fixtures.

Tests run as an unprivileged user (as on a cluster): apptainer refuses to work as root here.
A test that needs apptainer or Slurm calls ``need("apptainer")`` / ``need("slurm")``: outside CI
it skips when the tool is missing, under ``CI=true`` it fails, because CI must have every tool.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(os.environ.get("ET_HPC_FIXTURES", REPO.parent / "shared" / "fixtures" / "endless-terminals"))
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _missing(what: str) -> str | None:
    if what == "apptainer":
        if not shutil.which("apptainer"):
            return "apptainer is not on PATH (run scripts/provision-debian as root)"
        if os.geteuid() == 0:
            return "apptainer tests must run as an unprivileged user (root lacks CAP_SYS_RESOURCE here)"
        return None
    if what == "slurm":
        if not shutil.which("sbatch"):
            return "Slurm is not installed (run scripts/provision-debian as root)"
        r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
        if r.returncode != 0 or not r.stdout.strip():
            return f"Slurm is not answering (sinfo: {r.stderr.strip()[:200]})"
        return None
    if what == "fixtures":
        return None if FIXTURES.is_dir() else f"fixtures not found at {FIXTURES} (set ET_HPC_FIXTURES)"
    raise ValueError(what)


def need(*what: str) -> None:
    """Skip (or fail under CI) unless every named requirement is met."""
    for w in what:
        why = _missing(w)
        if why:
            if IN_CI:
                pytest.fail(f"required in CI: {why}")
            pytest.skip(why)


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
