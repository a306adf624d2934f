"""What the Slurm tests look at on this node: the worker processes of running array tasks."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def array_workers(array_id: str | None = None) -> dict[str, int]:
    """Python worker pid of each array task of this user running here (of ``array_id`` only, when
    given), by ``<array>_<index>``."""
    out = subprocess.run(
        ["pgrep", "-u", str(os.getuid()), "-f", "submitit.core._submit"], capture_output=True, text=True, timeout=30
    ).stdout
    found = {}
    for pid in map(int, out.split()):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:  # already gone
            continue
        if b"python" not in Path(argv[0].decode()).name.encode():  # srun and the batch shell mention it too
            continue
        arr, idx = env.get(b"SLURM_ARRAY_JOB_ID"), env.get(b"SLURM_ARRAY_TASK_ID")
        if arr and idx and array_id in (None, arr.decode()):
            found[f"{arr.decode()}_{idx.decode()}"] = pid
    return found
