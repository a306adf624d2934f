"""Node-local copies of cached SIF images, made once per node, checked, and evicted LRU.

When the image cache sits on a shared filesystem (NFS, Lustre, GPFS), every instance start reads
the SIF over the network. ``local_image(sif, digest, scratch=..., budget_gb=...)`` returns a
``LocalImage`` (an ``os.PathLike``) naming a copy under ``<scratch>/images/``::

    images/<digest>.sif     the copy (read-only; appears by atomic rename, never half)
    images/<digest>.json    what was verified: digest, size, mtime_ns, inode, source, copy seconds
    images/<digest>.lease   flocked shared by every user of the copy; its mtime is the last use (LRU)
    images/.node.lock       per-node lock held while copying or evicting

Contract:

- One copy per node: the copy is made under the per-node lock, to a temp name, sha256-checked
  against ``digest`` (the sha256 hex the image cache records for the SIF), fsynced, and renamed
  into place. Any number of processes asking at once make one copy; the rest wait and use it.
- A copy whose size, mtime or inode no longer match what was verified is re-hashed; a copy that no
  longer matches its digest is deleted and copied again. ``verify="full"`` re-hashes on every use.
- The returned ``LocalImage`` holds a shared flock on the copy's lease file until ``release()``
  (or ``with`` exit, or garbage collection, or the process's death). Eviction only removes copies
  whose lease it can lock exclusively, so a copy in use is never evicted.
- Eviction is least-recently-used (lease mtime) and keeps the copies' total size within
  ``budget_gb``; when in-use copies leave no room, or the image alone exceeds the budget,
  ``NoRoom`` is raised and nothing is copied.
- ``episode_image(image, options)`` is what an episode calls: it decides whether a copy is wanted
  (``local_copy: auto`` copies only when the cache and scratch are on different filesystems, i.e.
  ``st_dev`` differs; ``always`` forces a copy; ``never`` disables it) and never raises: on any
  trouble (no room, a source that does not match its recorded digest, an I/O error) it logs a
  warning and returns the shared path, which is what episodes used before copies existed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from filelock import FileLock, Timeout

from et_hpc.errors import InfraError
from et_hpc.paths import scratch_dir
from et_hpc.util import atomic_write_text, fsync_dir, sha256_file

log = logging.getLogger(__name__)

Mode = Literal["auto", "always", "never"]
CHUNK = 4 << 20
FREE_MARGIN = 256 << 20  # leave this much free on scratch after a copy


class NoRoom(InfraError):
    """The copy does not fit in the budget (or on the disk) without evicting copies in use."""


class DigestMismatch(InfraError):
    """The shared image's content does not match the digest the cache recorded for it."""


def images_dir(scratch: Path | None = None) -> Path:
    d = Path(scratch or scratch_dir()) / "images"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return d


def _norm_digest(digest: str) -> str:
    d = digest.strip().lower()
    if d.startswith("sha256:"):
        d = d[7:]
    if len(d) != 64 or any(c not in "0123456789abcdef" for c in d):
        raise ValueError(f"not a sha256 hex digest: {digest!r}")
    return d


def different_filesystem(sif_path: Path, scratch: Path | None = None) -> bool:
    """True when the SIF and node-local scratch are on different filesystems (``st_dev`` differs)."""
    return os.stat(sif_path).st_dev != os.stat(Path(scratch or scratch_dir())).st_dev


@dataclass
class CopyInfo:
    digest: str
    path: Path
    size: int
    last_used: float


class LocalImage(os.PathLike):
    """A node-local copy in use. ``path`` is the copy; the lease is held until ``release()``."""

    def __init__(self, path: Path, digest: str, fd: int, *, copied: bool, copy_s: float | None) -> None:
        self.path = path
        self.digest = digest
        self.copied = copied  # True when this call made the copy
        self.copy_s = copy_s  # seconds the copy took (this call's, or the recorded one)
        self._fd: int | None = fd

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"LocalImage({str(self.path)!r}, held={self._fd is not None})"

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)  # closing drops the flock
            except OSError:
                pass

    def __enter__(self) -> LocalImage:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


def _paths(d: Path, digest: str) -> tuple[Path, Path, Path]:
    return d / f"{digest}.sif", d / f"{digest}.json", d / f"{digest}.lease"


def _read_meta(meta: Path) -> dict[str, Any] | None:
    try:
        return json.loads(meta.read_text())
    except (OSError, ValueError):
        return None


def _stat_matches(sif: Path, meta: dict[str, Any] | None) -> bool:
    if not meta:
        return False
    try:
        st = sif.stat()
    except OSError:
        return False
    return (meta.get("size"), meta.get("mtime_ns"), meta.get("ino")) == (st.st_size, st.st_mtime_ns, st.st_ino)


def _take_lease(lease: Path) -> int | None:
    """A shared flock on the lease file; None when the file was replaced meanwhile (evicted)."""
    fd = os.open(lease, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        if os.fstat(fd).st_ino != os.stat(lease).st_ino:
            raise FileNotFoundError(lease)
        os.utime(fd)  # last use, for LRU
        return fd
    except OSError:
        os.close(fd)
        return None


def _remove_copy(d: Path, digest: str) -> bool:
    """Delete one copy if nobody holds its lease (caller holds the node lock). True if removed."""
    sif, meta, lease = _paths(d, digest)
    try:
        fd = os.open(lease, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # in use
        for p in (sif, meta, lease):
            p.unlink(missing_ok=True)
        return True
    finally:
        os.close(fd)


def list_copies(scratch: Path | None = None) -> list[CopyInfo]:
    """The copies on this node, least recently used first."""
    d = images_dir(scratch)
    out = []
    for sif in d.glob("*.sif"):
        digest = sif.stem
        try:
            size = sif.stat().st_size
        except OSError:
            continue
        try:
            used = (d / f"{digest}.lease").stat().st_mtime
        except OSError:
            used = 0.0
        out.append(CopyInfo(digest=digest, path=sif, size=size, last_used=used))
    out.sort(key=lambda c: c.last_used)
    return out


def evict(scratch: Path | None, budget_bytes: int, *, incoming: int = 0, keep: str | None = None) -> int:
    """Evict unused copies, least recently used first, until they plus ``incoming`` bytes fit in
    ``budget_bytes``. Caller holds the node lock. Returns the total size afterwards (with incoming)."""
    d = images_dir(scratch)
    copies = list_copies(scratch)
    total = incoming + sum(c.size for c in copies)
    for c in copies:
        if total <= budget_bytes:
            break
        if c.digest == keep:
            continue
        if _remove_copy(d, c.digest):
            log.info("evicted node-local image copy %s (%.1f MB)", c.path, c.size / 1e6)
            total -= c.size
    return total


def _copy_hashed(src: Path, dst: Path) -> str:
    h = hashlib.sha256()
    with open(src, "rb") as fi, open(dst, "xb") as fo:
        while True:
            b = fi.read(CHUNK)
            if not b:
                break
            h.update(b)
            fo.write(b)
        fo.flush()
        os.fsync(fo.fileno())
    return h.hexdigest()


def _clean_temps(d: Path) -> None:
    # only the node-lock holder copies, so any temp seen while holding it was left by a dead copier
    for t in d.glob(".*.tmp"):
        t.unlink(missing_ok=True)


def local_image(
    sif_path: Path | str,
    digest: str | None,
    *,
    scratch: Path | None = None,
    budget_gb: float = 20.0,
    verify: Literal["stat", "full"] = "stat",
    lock_timeout_s: float = 900.0,
) -> LocalImage:
    """The node-local copy of ``sif_path`` (see the module docstring), made if missing or bad.

    ``digest`` is the SIF's sha256 hex (``None``: hashed from the shared file first, a full read).
    Raises ``NoRoom``, ``DigestMismatch``, ``InfraError`` (node lock timeout) or ``OSError``.
    """
    src = Path(sif_path)
    digest = _norm_digest(digest) if digest else sha256_file(src)
    d = images_dir(scratch)
    sif, meta_p, lease = _paths(d, digest)

    # fast path: a verified copy is there; lease it without the node lock
    meta = _read_meta(meta_p)
    if verify == "stat" and _stat_matches(sif, meta):
        fd = _take_lease(lease)
        if fd is not None:
            if _stat_matches(sif, _read_meta(meta_p)):
                return LocalImage(sif, digest, fd, copied=False, copy_s=(meta or {}).get("copy_s"))
            os.close(fd)

    try:
        node_lock = FileLock(str(d / ".node.lock"), timeout=lock_timeout_s)
        node_lock.acquire()
    except Timeout as e:
        raise InfraError(f"timed out after {lock_timeout_s:.0f}s waiting for the node image lock {d}/.node.lock") from e
    try:
        _clean_temps(d)
        meta = _read_meta(meta_p)
        if sif.exists():
            ok = _stat_matches(sif, meta) and verify == "stat"
            if not ok:
                ok = sha256_file(sif) == digest
                if ok:  # content right, stat changed (e.g. touched): re-record
                    st = sif.stat()
                    meta = dict(meta or {}, digest=digest, size=st.st_size, mtime_ns=st.st_mtime_ns, ino=st.st_ino)
                    atomic_write_text(meta_p, json.dumps(meta))
            if ok:
                fd = _take_lease(lease)
                if fd is None:
                    raise InfraError(f"could not lease node-local image {sif}")
                return LocalImage(sif, digest, fd, copied=False, copy_s=(meta or {}).get("copy_s"))
            log.warning("node-local image copy %s does not match its digest: replacing it", sif)
            if not _remove_copy(d, digest):
                # someone runs from it: move it aside (their open file stays valid) and copy anew
                sif.rename(d / f".{digest}.{secrets.token_hex(4)}.bad")
                meta_p.unlink(missing_ok=True)

        size = src.stat().st_size
        budget = int(budget_gb * (1 << 30))
        total = evict(scratch, budget, incoming=size, keep=digest)
        if total > budget:
            raise NoRoom(f"image {src.name} ({size / 1e9:.2f} GB) does not fit in the node-local copy budget "
                         f"of {budget_gb} GB (copies in use hold the rest; raise sandbox.local_copy_budget_gb)")
        if shutil.disk_usage(d).free < size + FREE_MARGIN:
            raise NoRoom(f"scratch {d} has less than {(size + FREE_MARGIN) / 1e9:.2f} GB free for image {src.name}")

        tmp = d / f".{digest}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        t0 = time.monotonic()
        try:
            got = _copy_hashed(src, tmp)
            if got != digest:
                raise DigestMismatch(f"shared image {src} has sha256 {got[:12]}…, the cache recorded {digest[:12]}…")
            os.chmod(tmp, 0o444)
            os.replace(tmp, sif)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        copy_s = time.monotonic() - t0
        fsync_dir(d)
        st = sif.stat()
        atomic_write_text(meta_p, json.dumps({
            "digest": digest, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino,
            "source": str(src), "copied_at": time.time(), "copy_s": round(copy_s, 3), "pid": os.getpid(),
        }))
        fd = _take_lease(lease)
        if fd is None:
            raise InfraError(f"could not lease node-local image {sif}")
        log.info("copied %s to node-local %s in %.2fs", src, sif, copy_s)
        return LocalImage(sif, digest, fd, copied=True, copy_s=copy_s)
    finally:
        node_lock.release()
        for bad in d.glob(".*.bad"):  # set-aside corrupt copies, once nobody can be starting from them
            if time.time() - bad.stat().st_mtime > 24 * 3600:
                bad.unlink(missing_ok=True)


def wants_copy(sif_path: Path | str, mode: Mode, scratch: Path | None = None) -> bool:
    if mode == "never":
        return False
    if mode == "always":
        return True
    try:
        return different_filesystem(Path(sif_path), scratch)
    except OSError:
        return False


def episode_image(image: Any, options: Any, *, scratch: Path | None = None) -> Path | LocalImage:
    """The SIF an episode should start from: a leased node-local copy, or ``image.path``.

    ``options`` is the run config's sandbox section (``local_copy``, ``local_copy_budget_gb``).
    Never raises; keep the returned object alive while the sandbox runs (it holds the lease).
    """
    path = Path(image.path)
    mode = getattr(options, "local_copy", "auto")
    try:
        if not wants_copy(path, mode, scratch):
            return path
        return local_image(path, getattr(image, "digest", None), scratch=scratch,
                           budget_gb=getattr(options, "local_copy_budget_gb", 20.0))
    except Exception as e:  # noqa: BLE001 - the shared image still works; say why it is used
        log.warning("using the shared image %s, not a node-local copy: %s", path, e)
        return path
