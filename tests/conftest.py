"""Shared test fixtures.

Tests run as an unprivileged user (as on a cluster): apptainer refuses to work as root here.
A test that needs apptainer or Slurm is marked ``@pytest.mark.apptainer`` / ``@pytest.mark.slurm``
(or calls ``need("apptainer")`` / ``need("slurm")``, as fixtures do): outside CI it skips when the
tool is missing, under ``CI=true`` it fails, because CI must have every tool.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
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
    if what == "ruff":
        return None if _ruff() else "ruff is not installed (pip install -e '.[test]')"
    raise ValueError(what)


def _ruff() -> list[str] | None:
    """How to run ruff here: the ``ruff`` on PATH, or the module beside this Python."""
    if shutil.which("ruff"):
        return ["ruff"]
    r = subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True)
    return [sys.executable, "-m", "ruff"] if r.returncode == 0 else None


def pytest_runtest_setup(item: pytest.Item) -> None:
    """The ``apptainer`` and ``slurm`` markers apply ``need()`` before the test runs."""
    for what in ("apptainer", "slurm"):
        if item.get_closest_marker(what) is not None:
            need(what)


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


def build_user_sif(base_sif: Path, d: Path, post: str = "") -> Path:
    """Build ``d/task.sif`` on the base image: a ``user`` account owning ``/home/user``, plus ``post``."""
    need("apptainer")
    extra = textwrap.indent(textwrap.dedent(post).strip(), "    ") + "\n" if post.strip() else ""
    (d / "task.def").write_text(
        "Bootstrap: localimage\n"
        f"From: {base_sif}\n"
        "%post\n"
        "    useradd -m -s /bin/bash user 2>/dev/null || true\n"
        "    mkdir -p /home/user\n"
        f"{extra}"
        "    chown -R user:user /home/user\n"
    )
    sif = d / "task.sif"
    cp = subprocess.run(["apptainer", "-s", "build", "--fakeroot", str(sif), str(d / "task.def")],
                        capture_output=True, text=True, cwd=d)
    assert cp.returncode == 0, cp.stderr[-2000:]
    return sif


@pytest.fixture(scope="session")
def task_sif(base_sif: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A task image for the red-team tests: /home/user/notes.txt holds 'keep me'."""
    return build_user_sif(base_sif, tmp_path_factory.mktemp("redteam-image"), r"printf 'keep me\n' > /home/user/notes.txt")


def until(what: str, fn, timeout_s: float, every_s: float = 0.5):
    """Poll ``fn`` until it returns something truthy; fail naming ``what`` after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = fn()
        if got:
            return got
        time.sleep(every_s)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
