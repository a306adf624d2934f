"""Space planned, not discovered: the bytes a build or run plan needs, checked before it starts.

``build_needs`` and ``run_needs`` estimate what a plan writes to the image cache and to node-local
scratch (the estimates are in docs/images.md, "Space planning"); ``check`` adds the needs up per
filesystem and compares them with what ``statvfs`` says is free and with what the user's quota
leaves (``lfs quota`` or ``quota -w`` where present); ``refusal`` is the one line a command
prints when a plan does not fit. ``ET_HPC_SPACE_CHECK=off`` skips the check.
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MB = 1024 * 1024
TASK_IMAGE_MB = 200  # what one task adds to its base image, packed (ET_HPC_TASK_IMAGE_MB)
UNPACK_FACTOR = 3.0  # an unpacked root takes about this many times its packed (squashfs) size


@dataclass
class Need:
    """``bytes`` to be written below ``path`` for ``what`` (one phrase)."""

    path: Path
    bytes: int
    what: str


@dataclass
class FsRoom:
    """One filesystem as a plan sees it: its mount, what the plan needs there and what is left."""

    mount: str
    device: str
    needed: int
    free: int
    quota_left: int | None = None
    quota_source: str | None = None
    whats: list[str] = field(default_factory=list)

    @property
    def room(self) -> int:
        return self.free if self.quota_left is None else min(self.free, self.quota_left)

    @property
    def fits(self) -> bool:
        return self.needed <= self.room


def enabled() -> bool:
    return os.environ.get("ET_HPC_SPACE_CHECK", "on").strip().lower() not in ("off", "0", "no", "false")


def task_image_bytes() -> int:
    try:
        return int(float(os.environ.get("ET_HPC_TASK_IMAGE_MB", TASK_IMAGE_MB)) * MB)
    except ValueError:
        return TASK_IMAGE_MB * MB


def human(n: int) -> str:
    for unit, scale in (("GB", 1024**3), ("MB", MB), ("KB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def existing(path: Path) -> Path:
    """``path`` or its nearest existing parent (a cache that is not made yet)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def mount_of(path: Path) -> tuple[str, str]:
    """(mount point, source device) of the filesystem holding ``path`` (/proc/self/mountinfo)."""
    p = str(existing(path).resolve())
    best = ("/", "")
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return best
    for ln in lines:
        left, _, right = ln.partition(" - ")
        f = left.split()
        if len(f) < 5:
            continue
        mnt = f[4].replace("\\040", " ")
        if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
            src = right.split()
            best = (mnt, src[1] if len(src) > 1 else "")
    return best


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged user may still write on the filesystem of ``path`` (statvfs f_bavail)."""
    st = os.statvfs(existing(path))
    return st.f_bavail * st.f_frsize


def _num_kib(tok: str) -> int | None:
    tok = tok.rstrip("*")
    return int(tok) * 1024 if tok.isdigit() else None


def _left(used: int | None, soft: int | None, hard: int | None) -> int | None:
    limits = [x for x in (soft, hard) if x]
    if used is None or not limits:
        return None  # no limit set (0) or nothing parsed
    return max(0, min(limits) - used)


def parse_lfs_quota(text: str) -> int | None:
    """Bytes left from ``lfs quota -q -u USER MOUNT`` (kbytes quota limit grace files ...), or None."""
    toks = text.split()
    nums = [i for i, t in enumerate(toks) if _num_kib(t) is not None]
    if len(nums) < 3:
        return None
    i = nums[0]
    return _left(_num_kib(toks[i]), _num_kib(toks[i + 1]), _num_kib(toks[i + 2]))


def parse_quota_w(text: str, device: str, mount: str) -> int | None:
    """Bytes left on ``device``/``mount`` from ``quota -w`` (blocks quota limit in KiB), or None."""
    for ln in text.splitlines():
        f = ln.split()
        if len(f) >= 4 and f[0] in (device, mount):
            return _left(_num_kib(f[1]), _num_kib(f[2]), _num_kib(f[3]))
    return None


def quota_left(path: Path) -> tuple[int | None, str | None]:
    """(bytes the user's quota leaves on the filesystem of ``path``, the tool that said so), if known."""
    mount, device = mount_of(path)
    user = getpass.getuser()
    tries: list[tuple[list[str], Any]] = []
    if shutil.which("lfs"):
        tries.append((["lfs", "quota", "-q", "-u", user, mount], parse_lfs_quota))
    if shutil.which("quota"):
        tries.append((["quota", "-w"], lambda t: parse_quota_w(t, device, mount)))
    for cmd, parse in tries:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        left = parse(out)
        if left is not None:
            return left, cmd[0]
    return None, None


def rooms(needs: Iterable[Need]) -> list[FsRoom]:
    """The needs added up per filesystem (by st_dev), with what each one has left."""
    by_dev: dict[int, FsRoom] = {}
    for n in needs:
        if n.bytes <= 0:
            continue
        p = existing(n.path)
        dev = os.stat(p).st_dev
        r = by_dev.get(dev)
        if r is None:
            mount, device = mount_of(p)
            q, src = quota_left(p)
            r = by_dev[dev] = FsRoom(mount=mount, device=device, needed=0, free=free_bytes(p), quota_left=q, quota_source=src)
        r.needed += n.bytes
        r.whats.append(f"{n.what} in {n.path}")
    return list(by_dev.values())


def refusal(r: FsRoom) -> str:
    """The one line that says a plan does not fit on ``r``."""
    limit = f"free {r.free} bytes ({human(r.free)})"
    if r.quota_left is not None and r.quota_left < r.free:
        limit = f"quota ({r.quota_source}) leaves {r.quota_left} bytes ({human(r.quota_left)})"
    return (
        f"not enough space on {r.mount} ({r.device or 'filesystem'}): the plan needs {r.needed} bytes "
        f"({human(r.needed)}) for {'; '.join(r.whats)}, {limit}"
    )


def summary(rs: Sequence[FsRoom]) -> str:
    return "; ".join(f"{r.mount}: needs {human(r.needed)} of {human(r.room)}" for r in rs) or "nothing to write"


def check(needs: Iterable[Need]) -> tuple[list[FsRoom], str | None]:
    """(the filesystems, the refusal line of the first that does not fit, or None)."""
    if not enabled():
        return [], None
    rs = rooms(needs)
    bad = [r for r in rs if not r.fits]
    return rs, (refusal(bad[0]) if bad else None)


def packed_size(paths: Iterable[Path | None]) -> int:
    """The largest of the given SIFs (0 when none exists)."""
    out = 0
    for p in paths:
        try:
            out = max(out, os.stat(p).st_size) if p else out
        except OSError:
            continue
    return out


def build_needs(cache_dir: Path, scratch: Path | None, bases: Iterable[Path], n_images: int, jobs: int) -> list[Need]:
    """A build of ``n_images`` images, ``jobs`` at once: each packed image (base + one task's
    estimate) in the cache; each running build's unpacked root on scratch (None: not this node's)."""
    if n_images <= 0:
        return []
    one = packed_size(bases) + task_image_bytes()
    needs = [Need(cache_dir, n_images * one, f"{n_images} image(s) of about {human(one)}")]
    if scratch is not None:
        at_once = max(1, min(jobs, n_images))
        needs.append(Need(scratch, int(at_once * one * UNPACK_FACTOR), f"{at_once} build root(s) unpacked at once"))
    return needs


def run_needs(scratch: Path, images: Iterable[tuple[Path, str | None]], sandbox: Any, concurrency: int) -> list[Need]:
    """A run on this node (``sandbox``: its SandboxConfig): ``concurrency`` full overlays, and the
    node-local copies or unpacked trees its images get that are not on the node yet (within the
    copy budget)."""
    from et_hpc.images.local_copy import images_dir, wants_copy

    overlay_mb = 0 if sandbox.writable_tmpfs else int(sandbox.overlay_mb)
    needs = [Need(scratch, concurrency * overlay_mb * MB, f"{concurrency} overlay(s) of {overlay_mb} MB")] if overlay_mb else []
    mode, here = sandbox.local_copy, images_dir(scratch)
    total, count = 0.0, 0
    for path, digest in dict.fromkeys(images):
        unpack = mode == "unpack" or str(path).endswith(".cas")
        if not Path(path).is_file() or not (unpack or wants_copy(path, mode, scratch)):
            continue
        d = (digest or "").removeprefix("sha256:")
        if d and ((here / f"{d}.sif").exists() or (here / f"{d}.root").exists()):
            continue  # already on this node
        if str(path).endswith(".cas"):  # a CAS image: its tree's bytes (an upper bound: the pool shares files)
            total += _cas_bytes(Path(path))
        else:
            total += os.stat(path).st_size * (UNPACK_FACTOR if unpack else 1.0)
        count += 1
    if count:
        total = min(total, sandbox.local_copy_budget_gb * 1024**3)
        needs.append(Need(scratch, int(total), f"{count} {'unpacked tree(s)' if mode == 'unpack' else 'node-local copies'}"))
    return needs


def _cas_bytes(ref: Path) -> int:
    """The tree bytes a CAS image records (0 when it records none)."""
    try:
        return int(json.loads(ref.read_text()).get("bytes") or 0)
    except (OSError, ValueError):
        return 0
