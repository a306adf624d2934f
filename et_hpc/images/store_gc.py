"""``et-hpc images gc``: remove the cache's task images that no kept task references.

What is kept: the image of every task of the sources given (their keys, as ``et-hpc build``
computes them), the base images (never touched), images built or used within ``min_age_s``, and
any image whose build lock or reader lease is held. The rest (``images/<k2>/<key>.sif`` with its
``.json`` and ``.lease``, ``logs/<key>.log``, ``failed/<key>.json``) is removed. Safe while runs
read the store: an episode that starts from the shared SIF holds a shared flock on its lease
(``shared_lease``); gc removes a key only while holding its build lock and an exclusive flock on
its lease, taken without waiting. Specified in docs/images.md ("Garbage collection").
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from et_hpc.images.lock import BuildLock, LockTimeout

if TYPE_CHECKING:
    from et_hpc.images.store import Buildable, ImageStore


@dataclass
class GcResult:
    removed: list[str] = field(default_factory=list)  # keys removed (or, dry run, that would be)
    freed_bytes: int = 0
    kept: int = 0  # images referenced by the kept tasks
    recent: list[str] = field(default_factory=list)  # unreferenced, but built or used within min_age_s
    in_use: list[str] = field(default_factory=list)  # unreferenced, but locked or leased now
    cas_files: int = 0  # CAS manifests and objects removed (layout cas)


def lease_path(sif: Path) -> Path:
    return Path(sif).with_suffix(".lease")


def shared_lease(sif: Path) -> int | None:
    """A shared flock on the lease of a store image (one with a ``.json`` record beside it), its
    mtime set to now (last use); None for other SIFs or when it cannot be taken (read-only cache)."""
    sif = Path(sif)
    if sif.suffix not in (".sif", ".cas") or not sif.with_suffix(".json").is_file():
        return None
    try:
        fd = os.open(lease_path(sif), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.utime(fd)
        return fd
    except OSError:
        os.close(fd)
        return None


def _stored(store: ImageStore) -> dict[str, Path]:
    d = store.cache_dir / "images"
    return {p.stem: p for p in [*d.glob("??/*.sif"), *d.glob("??/*.cas")]}  # a key has one of them


def _last_touch(store: ImageStore, key: str, sif: Path) -> float:
    times = []
    for p in (sif, store.meta_path(key), lease_path(sif)):
        try:
            times.append(p.stat().st_mtime)
        except OSError:
            continue
    return max(times, default=0.0)


def keep_keys(store: ImageStore, tasks: list[Buildable]) -> set[str]:
    """The keys of the kept tasks' images (a task that cannot be resolved keeps nothing)."""
    out = set()
    for t in tasks:
        r = store.lookup(t)
        if r.key:
            out.add(r.key)
    return out


def _remove(store: ImageStore, key: str, sif: Path) -> int:
    size = sif.stat().st_size
    gone = sif.with_name(f".gc-{key}-{uuid.uuid4().hex[:8]}.sif")
    os.replace(sif, gone)  # the image leaves its name at once; no lookup finds it half removed
    for p in (store.meta_path(key), store.log_path(key), store.failed_path(key), gone):
        p.unlink(missing_ok=True)
    return size


def hold_unused(lease: Path, mode: int = 0o600) -> int | None:
    """An fd holding ``lease`` exclusively (created with ``mode`` if missing): nobody uses what it
    guards while it is open. None while a reader holds the lease, or when it cannot be opened."""
    try:
        fd = os.open(lease, os.O_RDWR | os.O_CREAT, mode)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _remove_unleased(store: ImageStore, key: str, sif: Path, dry_run: bool) -> int | None:
    """Bytes freed by removing ``key`` (dry run: that would be), or None while a reader leases it."""
    fd = hold_unused(lease_path(sif), 0o644)
    if fd is None:
        return None
    try:
        if dry_run:
            return sif.stat().st_size
        freed = _remove(store, key, sif)
        lease_path(sif).unlink(missing_ok=True)
        return freed
    finally:
        os.close(fd)


def gc(store: ImageStore, keep: set[str], *, min_age_s: float = 86400.0, dry_run: bool = False) -> GcResult:
    """Remove the store's images whose key is not in ``keep`` (see the module doc)."""
    res = GcResult()
    now = time.time()
    for key, sif in sorted(_stored(store).items()):
        if key in keep:
            res.kept += 1
            continue
        if now - _last_touch(store, key, sif) < min_age_s:
            res.recent.append(key)
            continue
        lock = BuildLock(store.lock_path(key), stale_after=store.settings.stale_after_s, timeout=0.0)
        try:
            lock.acquire()
        except LockTimeout:
            res.in_use.append(key)
            continue
        try:
            freed = _remove_unleased(store, key, sif, dry_run)
        finally:
            lock.release()
        if freed is None:
            res.in_use.append(key)
        else:
            res.removed.append(key)
            res.freed_bytes += freed
    _sweep_cas(store, res, min_age_s, now, dry_run)
    return res


def _sweep_cas(store: ImageStore, res: GcResult, min_age_s: float, now: float, dry_run: bool) -> None:
    """The CAS layout: remove manifests no image or built step names and objects no kept manifest
    names (built steps are the step builds' cache: kept; remove ``<cache>/steps`` to drop them)."""
    from et_hpc.images import cas, steps

    if not cas.cas_dir(store.cache_dir).is_dir():
        return
    gone = set(res.removed) if dry_run else set()
    live = set()
    for key, p in _stored(store).items():
        if p.suffix == ".cas" and key not in gone:
            try:
                live.add(json.loads(p.read_text())["manifest"])
            except (OSError, ValueError, KeyError):
                return  # an image that cannot be read: its objects cannot be told apart, keep all
    live |= steps.step_manifests(store.cache_dir)
    files, nbytes = cas.sweep(store.cache_dir, live, min_age_s=min_age_s, now=now, dry_run=dry_run)
    res.cas_files += files
    res.freed_bytes += nbytes


def as_dict(res: GcResult) -> dict:
    return json.loads(json.dumps(res.__dict__))
