"""Where et-hpc keeps things by default, overridable by environment variables.

- image cache (shared filesystem): ``$ET_HPC_CACHE`` or ``$XDG_CACHE_HOME/et-hpc`` (``~/.cache/et-hpc``)
- node-local scratch (overlays, build temp): ``$ET_HPC_SCRATCH``, else ``$SLURM_TMPDIR``, ``$TMPDIR``, ``/tmp``;
  the directory used is ``<that>/et-hpc-$USER``, made 0700, and refused (``UserError``, exit 2) when
  it is a symlink, belongs to someone else or is writable by group or others: on a shared ``/tmp``
  another user could have made it first to read or swap our overlays
- run stores (shared filesystem): ``$ET_HPC_STORE`` or ``./et-hpc-runs``
"""

from __future__ import annotations

import getpass
import os
import stat
from pathlib import Path

from et_hpc.errors import UserError


def cache_dir() -> Path:
    env = os.environ.get("ET_HPC_CACHE")
    if env:
        return Path(env).expanduser().absolute()
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
    check_private_dir(d, "node-local scratch")
    return d


def check_private_dir(d: Path, what: str) -> None:
    """Raise ``UserError`` unless ``d`` is a real directory of ours that only we can write."""
    st = os.lstat(d)
    fix = "remove it (or ask an admin to) or set ET_HPC_SCRATCH to a directory of your own"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UserError(f"{what} {d} is not a plain directory (a symlink?): refusing to use it; {fix}")
    if st.st_uid != os.getuid():
        raise UserError(f"{what} {d} belongs to uid {st.st_uid}, not you: refusing to use it; {fix}")
    if st.st_mode & 0o022:
        raise UserError(f"{what} {d} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}): refusing to use it; run `chmod 700 {d}`")


def store_dir() -> Path:
    return Path(os.environ.get("ET_HPC_STORE", "et-hpc-runs")).expanduser()


def repo_root() -> Path:
    """The source checkout (for bundled defs/ and demo tasks)."""
    return Path(__file__).resolve().parent.parent


def find_run_dir(run: str, store: Path | None) -> Path:
    """A run directory from a path or a run name under ``store`` (default ``store_dir()``)."""
    p = Path(run).expanduser()
    if (p / "run.json").is_file():
        return p
    q = Path(store or store_dir()).expanduser() / run
    if (q / "run.json").is_file():
        return q
    raise UserError(f"no run found at {p} or {q}: give a run directory (it holds run.json) or a run name with --store")
