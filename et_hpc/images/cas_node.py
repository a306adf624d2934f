"""Node-local trees of CAS images: each object copied once per node, trees made by hard links.

``cas_tree(ref, digest, scratch=..., budget_gb=...)`` returns a leased ``LocalImage`` naming
``<scratch>/images/<manifest>.root/``, the image's root as its manifest lists it. Objects are
copied from the shared store into the node's pool ``<scratch>/images/cas-pool/<h[:2]>/<h>-<mode>-
<mtime>`` (sha256-checked while copied, given the entry's mode and mtime, renamed into place, never
written again) and linked into every tree that holds that content with that mode and mtime, so a
node pays for a shared file once. Trees share the
node lock, leases, LRU eviction and budget of ``et_hpc.images.local_copy``; pool files no tree
links any more are removed after an eviction. Specified in docs/images.md ("The layered store").
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any

from et_hpc.errors import InfraError
from et_hpc.images import cas
from et_hpc.images.local_copy import (
    TREE,
    DigestMismatch,
    LocalImage,
    clean_temps,
    copy_paths,
    images_dir,
    make_room,
    node_lock,
    pool_dir,
    prune_pool,
    read_meta,
    remove_copy,
    rmtree,
    take_lease,
    tree_ok,
)
from et_hpc.images.store_gc import shared_lease
from et_hpc.util import atomic_write_text, fsync_dir

log = logging.getLogger(__name__)

REF = ".cas"  # suffix of a store image in the CAS layout: images/<k2>/<key>.cas names its manifest


def read_ref(ref: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(Path(ref).read_text())
        return data
    except (OSError, ValueError) as e:
        raise InfraError(f"image {ref} cannot be read: {e}") from None


def pool_path(pool: Path, e: cas.Entry) -> Path:
    """A file's pool inode: by content, mode and mtime, which every hard link to it shares."""
    return pool / e["h"][:2] / f"{e['h']}-{e['m']:04o}-{e.get('mt') or 0}"


def _copy_object(cache_dir: Path, dst: Path, h: str, mode: int, mtime: int | None) -> int:
    """Copy one object into the pool, uncompressed and checked against its name; bytes written."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.{secrets.token_hex(4)}.tmp"
    try:
        n = 0
        try:
            with open(tmp, "xb") as fo:
                for b in cas.read_object(cache_dir, h):
                    fo.write(b)
                    n += len(b)
                fo.flush()
                os.fsync(fo.fileno())
        except InfraError as e:
            raise DigestMismatch(str(e)) from None
        os.chmod(tmp, mode)
        if mtime is not None:
            os.utime(tmp, (mtime, mtime))
        os.replace(tmp, dst)
        return n
    finally:
        tmp.unlink(missing_ok=True)


def _build_tree(entries: list[cas.Entry], pool: Path, dest: Path) -> list[str]:
    """Make ``dest`` as the manifest lists it; returns notes on entries a user cannot make (devices)."""
    notes: list[str] = []
    dirs: list[cas.Entry] = []
    os.mkdir(dest, 0o700)
    for e in sorted(entries, key=lambda e: e["p"]):
        p = dest / e["p"]
        t = e["t"]
        if t == "d":
            if e["p"] != ".":
                os.mkdir(p, 0o700)
            dirs.append(e)
        elif t == "f":
            os.link(pool_path(pool, e), p)
        elif t == "l":
            os.symlink(e["l"], p)
            if e.get("mt") is not None:
                os.utime(p, (e["mt"], e["mt"]), follow_symlinks=False)
        elif t == "p":
            os.mkfifo(p, e["m"])
            os.chmod(p, e["m"])
        else:
            notes.append(f"{e['p']}: a {t} device node is not made in a user's tree")
    for e in sorted(dirs, key=lambda e: e["p"].count("/") + (e["p"] != "."), reverse=True):
        if e.get("mt") is not None:
            os.utime(dest / e["p"], (e["mt"], e["mt"]))
        os.chmod(dest / e["p"], e["m"])
    return notes


def _fill_pool(cache_dir: Path, entries: list[cas.Entry], pool: Path) -> int:
    """Copy the objects the pool lacks (per content and mode); bytes copied."""
    n = 0
    seen: set[Path] = set()
    for e in entries:
        if e["t"] != "f" or (dst := pool_path(pool, e)) in seen:
            continue
        seen.add(dst)
        if not dst.exists():
            n += _copy_object(cache_dir, dst, e["h"], e["m"], e.get("mt"))
    return n


def _missing_bytes(cache_dir: Path, entries: list[cas.Entry], pool: Path) -> int:
    need: dict[Path, int] = {}
    for e in entries:
        if e["t"] == "f" and (dst := pool_path(pool, e)) not in need and not dst.exists():
            if not cas.object_path(cache_dir, e["h"]).is_file():
                raise InfraError(f"object {e['h'][:12]} ({e['p']}) is missing from the image store")
            need[dst] = int(e.get("s") or 0)
    return sum(need.values())


def cas_tree(
    ref: Path | str, digest: str | None = None, *, scratch: Path | None = None, budget_gb: float = 20.0, lock_timeout_s: float = 900.0
) -> LocalImage:
    """The node-local tree of the CAS image ``ref`` (module docstring), made if missing. Raises
    ``NoRoom``, ``DigestMismatch``, ``InfraError`` or ``OSError``."""
    ref = Path(ref)
    cache_dir = ref.parent.parent.parent
    h = read_ref(ref)["manifest"]
    if digest and digest != h:
        raise DigestMismatch(f"image {ref} names manifest {h[:12]}, the run expected {digest[:12]}")
    d = images_dir(scratch)
    root, meta_p, lease = copy_paths(d, h, TREE)

    def leased(copied: bool, copy_s: float | None) -> LocalImage | None:
        fd = take_lease(lease)
        if fd is not None and tree_ok(root, read_meta(meta_p), h):
            return LocalImage(root, h, fd, copied=copied, copy_s=copy_s)
        if fd is not None:
            os.close(fd)
        return None

    if tree_ok(root, read_meta(meta_p), h) and (got := leased(False, None)) is not None:
        return got
    store_fd = shared_lease(ref)  # 'images gc' leaves the image alone while it is materialised
    nlock = node_lock(d, lock_timeout_s)
    try:
        clean_temps(d)
        if tree_ok(root, read_meta(meta_p), h):
            if (got := leased(False, None)) is None:
                raise InfraError(f"could not lease node-local image {root}")
            return got
        if (root.exists() or meta_p.exists()) and not remove_copy(d, h, TREE):
            raise InfraError(f"node-local image {root} is incomplete and in use; not replaced")
        return _materialise(cache_dir, ref, h, scratch, budget_gb, leased)
    finally:
        nlock.release()
        if store_fd is not None:
            os.close(store_fd)


def _materialise(cache_dir: Path, ref: Path, h: str, scratch: Path | None, budget_gb: float, leased: Any) -> LocalImage:
    """Under the node lock: fill the pool, link the tree, record it, lease it."""
    d = images_dir(scratch)
    root, meta_p, _ = copy_paths(d, h, TREE)
    t0 = time.monotonic()
    entries = cas.read_manifest(cache_dir, h)
    pool = pool_dir(scratch)
    make_room(d, scratch, budget_gb, _missing_bytes(cache_dir, entries, pool), h, ref.name)
    prune_pool(scratch)  # what the eviction left unlinked
    copied = _fill_pool(cache_dir, entries, pool)
    tmp = d / f".{h}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        notes = _build_tree(entries, pool, tmp)
        os.replace(tmp, root)
    except BaseException:
        if tmp.exists():
            rmtree(tmp)
        raise
    fsync_dir(d)
    copy_s = time.monotonic() - t0
    meta = {"digest": h, "size": copied, "ino": root.stat().st_ino, "source": str(ref), "copied_at": time.time()}
    atomic_write_text(meta_p, json.dumps({**meta, "copy_s": round(copy_s, 3), "pid": os.getpid(), "notes": notes[:20]}))
    got: LocalImage | None = leased(True, copy_s)
    if got is None:
        raise InfraError(f"could not lease node-local image {root}")
    log.info("made node-local tree %s from %s in %.2fs (%d new bytes in the pool)", root, ref, copy_s, copied)
    return got
