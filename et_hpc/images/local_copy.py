"""Node-local copies of cached SIF images, made once per node, checked, and evicted LRU.

``local_image(sif, digest, scratch=..., budget_gb=...)`` returns a ``LocalImage`` (an
``os.PathLike``) naming a copy under ``<scratch>/images/``, sha256-checked against ``digest``;
``local_tree`` unpacks the SIF's root filesystem there instead. Any number of processes asking at
once make one copy. The caller holds a lease until ``release()`` (or ``with`` exit), and a copy in
use is never evicted; eviction keeps the copies within ``budget_gb`` or raises ``NoRoom``.
``episode_image(image, options)`` is what an episode calls: it applies ``local_copy``
(auto|always|never|unpack) and never raises (on any trouble: a warning and the shared path).
Specification (layout, checks, eviction): docs/images.md ("Node-local copies").
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
from typing import Any, Literal, Protocol

from filelock import FileLock, Timeout

from et_hpc.errors import InfraError
from et_hpc.images.store_gc import hold_unused, shared_lease
from et_hpc.images.unpack import rmtree, unpack_sif  # noqa: F401  (unpack_sif: re-exported)
from et_hpc.paths import scratch_dir
from et_hpc.util import atomic_write_text, fsync_dir, sha256_file

log = logging.getLogger(__name__)

Mode = Literal["auto", "always", "never", "unpack"]


class ImageLike(Protocol):
    """What ``episode_image`` reads of an image (an ``ImageResult`` that was found, or a spec's)."""

    @property
    def path(self) -> Path | str: ...

    @property
    def digest(self) -> str | None: ...


class CopyOptions(Protocol):
    """What ``episode_image`` reads of the run's sandbox options (``SandboxConfig``, ``SandboxSpec``)."""

    @property
    def local_copy(self) -> Mode: ...

    @property
    def local_copy_budget_gb(self) -> float: ...


TREE = ".root"  # suffix of unpacked trees and their files
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


def norm_digest(digest: str) -> str:
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
    kind: str = ".sif"  # or TREE


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


def copy_paths(d: Path, digest: str, kind: str = ".sif") -> tuple[Path, Path, Path]:
    """(the copy, its record, its lease) for a SIF copy (``.sif``) or an unpacked tree (``TREE``)."""
    if kind == TREE:
        return d / f"{digest}{TREE}", d / f"{digest}{TREE}.json", d / f"{digest}{TREE}.lease"
    return d / f"{digest}.sif", d / f"{digest}.json", d / f"{digest}.lease"


def read_meta(meta: Path) -> dict[str, Any] | None:
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


def take_lease(lease: Path) -> int | None:
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


def remove_copy(d: Path, digest: str, kind: str = ".sif") -> bool:
    """Delete one copy if nobody holds its lease (caller holds the node lock). True if removed."""
    copy, meta, lease = copy_paths(d, digest, kind)
    fd = hold_unused(lease)
    if fd is None:
        return False
    try:
        files: tuple[Path, ...] = (copy, meta, lease)
        if kind == TREE:
            meta.unlink(missing_ok=True)  # first: a half-removed tree is never taken for whole
            if copy.exists():
                gone = d / f".{digest}.{secrets.token_hex(4)}.tmp"
                copy.rename(gone)
                rmtree(gone)
            files = (lease,)
        for p in files:
            p.unlink(missing_ok=True)
        return True
    finally:
        os.close(fd)


def list_copies(scratch: Path | None = None) -> list[CopyInfo]:
    """The copies and trees on this node, least recently used first."""
    d = images_dir(scratch)
    out = []
    for copy in [*d.glob("*.sif"), *d.glob(f"*{TREE}")]:
        kind = TREE if copy.name.endswith(TREE) else ".sif"
        digest = copy.name[: -len(kind)]
        _, meta, lease = copy_paths(d, digest, kind)
        try:
            size = copy.stat().st_size if kind == ".sif" else int((read_meta(meta) or {}).get("size", 0))
        except (OSError, ValueError):
            continue
        try:
            used = lease.stat().st_mtime
        except OSError:
            used = 0.0
        out.append(CopyInfo(digest=digest, path=copy, size=size, last_used=used, kind=kind))
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
        if remove_copy(d, c.digest, c.kind):
            log.info("evicted node-local image %s (%.1f MB)", c.path, c.size / 1e6)
            total -= c.size
    return total


def _in_use(d: Path, c: CopyInfo) -> bool:
    """Whether a sandbox holds ``c``'s lease (what ``remove_copy`` would find), creating nothing."""
    lease = copy_paths(d, c.digest, c.kind)[2]
    if not lease.exists():
        return False
    fd = hold_unused(lease)
    if fd is None:
        return True
    os.close(fd)
    return False


def pool_dir(scratch: Path | None = None) -> Path:
    """The node's pool of CAS objects that CAS trees link to (et_hpc.images.cas_node)."""
    return images_dir(scratch) / "cas-pool"


def prune_pool(scratch: Path | None = None) -> int:
    """Remove the CAS pool's files no tree links (link count 1) and leftover temps (et_hpc.images.cas_node);
    bytes freed. Caller holds the node lock."""
    freed = 0
    for p in pool_dir(scratch).glob("??/*"):
        try:
            st = p.lstat()
            if st.st_nlink == 1 or p.name.endswith(".tmp"):
                p.unlink()
                freed += st.st_size
        except OSError:
            continue
    return freed


def clear_unused(
    scratch: Path | None = None, *, dry_run: bool = False, lock_timeout_s: float = 60.0
) -> tuple[list[CopyInfo], list[CopyInfo]]:
    """Remove every node-local copy and tree no sandbox holds. Returns (removed, kept in use);
    ``dry_run``: what would be removed, nothing removed."""
    d = images_dir(scratch)
    lock = node_lock(d, lock_timeout_s)
    try:
        if not dry_run:
            clean_temps(d)
        removed: list[CopyInfo] = []
        kept: list[CopyInfo] = []
        for c in list_copies(scratch):
            gone = not _in_use(d, c) if dry_run else remove_copy(d, c.digest, c.kind)
            (removed if gone else kept).append(c)
        if not dry_run:
            prune_pool(scratch)
        return removed, kept
    finally:
        lock.release()


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


def clean_temps(d: Path) -> None:
    # only the node-lock holder copies, so any temp seen while holding it was left by a dead copier
    for t in d.glob(".*.tmp"):
        if t.is_dir() and not t.is_symlink():
            rmtree(t)
        else:
            t.unlink(missing_ok=True)


def node_lock(d: Path, timeout_s: float) -> FileLock:
    """The per-node lock, acquired (the caller releases it)."""
    lock = FileLock(str(d / ".node.lock"), timeout=timeout_s)
    try:
        lock.acquire()
    except Timeout as e:
        raise InfraError(f"timed out after {timeout_s:.0f}s waiting for the node image lock {d}/.node.lock") from e
    return lock


def make_room(d: Path, scratch: Path | None, budget_gb: float, size: int, digest: str, name: str) -> None:
    """Evict (LRU) until ``size`` more bytes fit the budget and the disk; else ``NoRoom``. Under the node lock."""
    budget = int(budget_gb * (1 << 30))
    total = evict(scratch, budget, incoming=size, keep=digest)
    if total > budget:
        raise NoRoom(
            f"image {name} ({size / 1e9:.2f} GB) does not fit in the node-local copy budget "
            f"of {budget_gb} GB (copies in use hold the rest; raise sandbox.local_copy_budget_gb)"
        )
    if shutil.disk_usage(d).free < size + FREE_MARGIN:
        raise NoRoom(f"scratch {d} has less than {(size + FREE_MARGIN) / 1e9:.2f} GB free for image {name}")


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
    digest = norm_digest(digest) if digest else sha256_file(src)
    d = images_dir(scratch)
    sif, meta_p, lease = copy_paths(d, digest)

    # fast path: a verified copy is there; lease it without the node lock
    meta = read_meta(meta_p)
    if verify == "stat" and _stat_matches(sif, meta):
        fd = take_lease(lease)
        if fd is not None:
            if _stat_matches(sif, read_meta(meta_p)):
                return LocalImage(sif, digest, fd, copied=False, copy_s=(meta or {}).get("copy_s"))
            os.close(fd)

    nlock = node_lock(d, lock_timeout_s)
    try:
        clean_temps(d)
        meta = read_meta(meta_p)
        if sif.exists():
            ok = _stat_matches(sif, meta) and verify == "stat"
            if not ok:
                ok = sha256_file(sif) == digest
                if ok:  # content right, stat changed (e.g. touched): re-record
                    st = sif.stat()
                    meta = dict(meta or {}, digest=digest, size=st.st_size, mtime_ns=st.st_mtime_ns, ino=st.st_ino)
                    atomic_write_text(meta_p, json.dumps(meta))
            if ok:
                fd = take_lease(lease)
                if fd is None:
                    raise InfraError(f"could not lease node-local image {sif}")
                return LocalImage(sif, digest, fd, copied=False, copy_s=(meta or {}).get("copy_s"))
            log.warning("node-local image copy %s does not match its digest: replacing it", sif)
            if not remove_copy(d, digest):
                # someone runs from it: move it aside (their open file stays valid) and copy anew
                sif.rename(d / f".{digest}.{secrets.token_hex(4)}.bad")
                meta_p.unlink(missing_ok=True)

        make_room(d, scratch, budget_gb, src.stat().st_size, digest, src.name)

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
        atomic_write_text(
            meta_p,
            json.dumps(
                {
                    "digest": digest,
                    "size": st.st_size,
                    "mtime_ns": st.st_mtime_ns,
                    "ino": st.st_ino,
                    "source": str(src),
                    "copied_at": time.time(),
                    "copy_s": round(copy_s, 3),
                    "pid": os.getpid(),
                }
            ),
        )
        fd = take_lease(lease)
        if fd is None:
            raise InfraError(f"could not lease node-local image {sif}")
        log.info("copied %s to node-local %s in %.2fs", src, sif, copy_s)
        return LocalImage(sif, digest, fd, copied=True, copy_s=copy_s)
    finally:
        nlock.release()
        for bad in d.glob(".*.bad"):  # set-aside corrupt copies, once nobody can be starting from them
            if time.time() - bad.stat().st_mtime > 24 * 3600:
                bad.unlink(missing_ok=True)


UNPACK_FACTOR = 4  # room asked for before unpacking: this many times the SIF (squashfs compresses ~3x)


def tree_ok(root: Path, meta: dict[str, Any] | None, digest: str) -> bool:
    if not meta or meta.get("digest") != digest:
        return False
    try:
        return root.is_dir() and meta.get("ino") == root.stat().st_ino
    except OSError:
        return False


def _tree_size(root: Path) -> int:
    total = 0
    for top, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            try:
                total += os.lstat(os.path.join(top, name)).st_blocks * 512
            except OSError:
                pass
    return total


def local_tree(
    sif_path: Path | str,
    digest: str | None,
    *,
    scratch: Path | None = None,
    budget_gb: float = 20.0,
    lock_timeout_s: float = 900.0,
) -> LocalImage:
    """The node-local unpacked root filesystem of ``sif_path`` (module docstring), made if missing.

    Its ``path`` is a directory that ``apptainer instance start`` takes as the image. Raises
    ``NoRoom``, ``DigestMismatch``, ``InfraError`` (no ``unsquashfs``, a failed unpack, node lock
    timeout) or ``OSError``.
    """
    src = Path(sif_path)
    digest = norm_digest(digest) if digest else sha256_file(src)
    d = images_dir(scratch)
    root, meta_p, lease = copy_paths(d, digest, TREE)

    def leased(meta: dict[str, Any] | None, *, copied: bool) -> LocalImage | None:
        fd = take_lease(lease)
        if fd is None:
            return None
        if not tree_ok(root, read_meta(meta_p), digest):
            os.close(fd)
            return None
        return LocalImage(root, digest, fd, copied=copied, copy_s=(meta or {}).get("copy_s"))

    meta = read_meta(meta_p)
    if tree_ok(root, meta, digest):  # fast path, without the node lock
        got = leased(meta, copied=False)
        if got is not None:
            return got
    nlock = node_lock(d, lock_timeout_s)
    try:
        clean_temps(d)
        meta = read_meta(meta_p)
        if tree_ok(root, meta, digest):
            got = leased(meta, copied=False)
            if got is None:
                raise InfraError(f"could not lease node-local image {root}")
            return got
        if (root.exists() or meta_p.exists()) and not remove_copy(d, digest, TREE):
            raise InfraError(f"node-local image {root} is incomplete and in use; not replaced")
        make_room(d, scratch, budget_gb, UNPACK_FACTOR * src.stat().st_size, digest, src.name)
        tag = f".{digest}.{os.getpid()}.{secrets.token_hex(4)}"
        tmp_sif, tmp_root = d / f"{tag}.sif.tmp", d / f"{tag}.tmp"
        t0 = time.monotonic()
        try:
            got_digest = _copy_hashed(src, tmp_sif)  # the checked bytes are the ones unpacked
            if got_digest != digest:
                raise DigestMismatch(f"shared image {src} has sha256 {got_digest[:12]}…, the cache recorded {digest[:12]}…")
            unpack_sif(tmp_sif, tmp_root)
            os.replace(tmp_root, root)
        except BaseException:
            if tmp_root.exists():
                rmtree(tmp_root)
            raise
        finally:
            tmp_sif.unlink(missing_ok=True)
        copy_s = time.monotonic() - t0
        fsync_dir(d)
        atomic_write_text(
            meta_p,
            json.dumps(
                {
                    "digest": digest,
                    "size": _tree_size(root),
                    "ino": root.stat().st_ino,
                    "source": str(src),
                    "copied_at": time.time(),
                    "copy_s": round(copy_s, 3),
                    "pid": os.getpid(),
                }
            ),
        )
        got = leased({"copy_s": copy_s}, copied=True)
        if got is None:
            raise InfraError(f"could not lease node-local image {root}")
        log.info("unpacked %s to node-local %s in %.2fs", src, root, copy_s)
        return got
    finally:
        nlock.release()


def wants_copy(sif_path: Path | str, mode: Mode, scratch: Path | None = None) -> bool:
    if mode == "never":
        return False
    if mode in ("always", "unpack"):
        return True
    try:
        return different_filesystem(Path(sif_path), scratch)
    except OSError:
        return False


def episode_image(image: ImageLike, options: CopyOptions, *, scratch: Path | None = None) -> Path | LocalImage:
    """The image an episode should start from: a leased node-local copy or unpacked tree, or ``image.path``.

    ``options`` is the run config's sandbox section (``local_copy``, ``local_copy_budget_gb``).
    Never raises; keep the returned object alive while the sandbox runs (it holds the lease; a store
    image used in place is leased too, et_hpc.images.store_gc).
    """
    path = Path(image.path)
    mode, budget_gb = options.local_copy, options.local_copy_budget_gb
    try:
        if mode == "unpack":
            return local_tree(path, image.digest, scratch=scratch, budget_gb=budget_gb)
        if not wants_copy(path, mode, scratch):  # the shared image, leased so 'images gc' keeps it
            fd = shared_lease(path)
            return path if fd is None else LocalImage(path, image.digest or "", fd, copied=False, copy_s=None)
        return local_image(path, image.digest, scratch=scratch, budget_gb=budget_gb)
    except Exception as e:  # noqa: BLE001 - the shared image still works; say why it is used
        log.warning("using the shared image %s, not a node-local copy: %s", path, e)
        return path
