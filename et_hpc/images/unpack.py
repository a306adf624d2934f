"""Unpacking a SIF's root filesystem (``unsquashfs``) and removing such trees: what node-local
trees (``et_hpc.images.local_copy``) and the CAS layout (``et_hpc.images.cas``) share."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from et_hpc.errors import InfraError
from et_hpc.host import apptainer


def rmtree(path: Path) -> None:
    """Remove a tree even where the image made directories unwritable (modes as unpacked)."""
    os.chmod(path, 0o700)
    for top, dirs, _ in os.walk(path):
        for name in dirs:
            p = os.path.join(top, name)
            if not os.path.islink(p):
                os.chmod(p, 0o700)
    shutil.rmtree(path)


def unpack_sif(sif: Path, dest: Path, *, timeout_s: float = 1800.0) -> None:
    """Unpack ``sif``'s root filesystem partition to the new directory ``dest`` (``unsquashfs``)."""
    exe = shutil.which("unsquashfs")
    if exe is None:
        raise InfraError("unsquashfs is not on PATH (squashfs-tools): cannot unpack images (sandbox.local_copy: unpack)")
    part = apptainer.sif_rootfs(sif)
    if part is None or part[1] < 0:
        raise InfraError(f"{sif}: no root filesystem partition found in the SIF")
    try:
        cp = subprocess.run(
            [exe, "-n", "-no-xattrs", "-o", str(part[1]), "-d", str(dest), str(sif)], capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        raise InfraError(f"unsquashfs of {sif} took more than {timeout_s:.0f}s") from None
    if cp.returncode != 0:
        raise InfraError(f"unsquashfs of {sif} failed ({cp.returncode}): {(cp.stderr or cp.stdout).strip()[-300:]}")
