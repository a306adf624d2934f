"""Where et-hpc keeps things by default, overridable by environment variables.

- image cache (shared filesystem): ``$ET_HPC_CACHE`` or ``$XDG_CACHE_HOME/et-hpc`` (``~/.cache/et-hpc``)
- node-local scratch (overlays, build temp): ``$ET_HPC_SCRATCH``, else ``$SLURM_TMPDIR``, ``$TMPDIR``, ``/tmp``
- run stores (shared filesystem): ``$ET_HPC_STORE`` or ``./et-hpc-runs``
"""

from __future__ import annotations

import getpass
import os
from pathlib import Path


def cache_dir() -> Path:
    env = os.environ.get("ET_HPC_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "et-hpc"


def scratch_dir() -> Path:
    """Node-local scratch for this user; created on demand."""
    for var in ("ET_HPC_SCRATCH", "SLURM_TMPDIR", "TMPDIR"):
        val = os.environ.get(var)
        if val:
            base = Path(val)
            break
    else:
        base = Path("/tmp")
    d = base / f"et-hpc-{getpass.getuser()}"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return d


def store_dir() -> Path:
    return Path(os.environ.get("ET_HPC_STORE", "et-hpc-runs")).expanduser()


def repo_root() -> Path:
    """The source checkout (for bundled defs/ and demo tasks)."""
    return Path(__file__).resolve().parent.parent
