"""Node-local scratch for sandboxes: directories, instance names and sparse overlays.

``scratch_paths`` makes and returns (live registry dir, overlays dir, templates dir);
``new_instance_name`` is a unique apptainer instance name for a run prefix; ``overlay_template``
creates a sparse ext3 overlay of a size once per node (under a file lock) and ``copy_sparse``
copies it for one sandbox (``InfraError`` when the copy fails).
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
from pathlib import Path

from filelock import FileLock

from et_hpc.errors import InfraError
from et_hpc.host import apptainer
from et_hpc.paths import scratch_dir


def scratch_paths(scratch: Path | None = None) -> tuple[Path, Path, Path]:
    """(live registry dir, overlays dir, templates dir) under node-local scratch."""
    base = Path(scratch) if scratch else scratch_dir()
    dirs = (base / "live", base / "overlays", base / "overlay-templates")
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return dirs


def new_instance_name(run_prefix: str) -> str:
    """``<run_prefix>-<host>-<pid>-<rand>``, cut to apptainer's limits (prefix and host first)."""
    host = socket.gethostname().split(".")[0]
    tail = f"-{os.getpid()}-{secrets.token_hex(4)}"
    head = apptainer.safe_name(f"{run_prefix}-{host}")
    return head[: apptainer.NAME_MAX - len(tail)] + tail


def overlay_template(size_mb: int, templates: Path) -> Path:
    """A sparse ext3 overlay of ``size_mb`` MiB, created once per node (about 0.7 s) and copied after."""
    path = templates / f"ext3-{int(size_mb)}M.img"
    if path.exists():
        return path
    with FileLock(str(path) + ".lock", timeout=300):
        if not path.exists():
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.unlink(missing_ok=True)
            apptainer.overlay_create(tmp, size_mb, sparse=True)
            os.replace(tmp, path)
    return path


def copy_sparse(src: Path, dst: Path) -> None:
    cp = subprocess.run(["cp", "--sparse=always", str(src), str(dst)], capture_output=True, text=True)
    if cp.returncode != 0:
        raise InfraError(f"could not copy overlay {src} to {dst}: {cp.stderr.strip()[-300:]}")
