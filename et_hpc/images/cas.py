"""The file-level content-addressed image store (``images.layout: cas``) and the tree digest.

A root filesystem is stored as objects (one per distinct file content, ``cas/objects/<h[:2]>/<h>``,
named by sha256, written once by atomic rename, read-only) and a manifest (``cas/manifests/``,
named by the sha256 of its canonical JSON) listing every entry: path, type, mode, owner, group,
symlink target, device numbers, object. ``tree_digest`` digests a root from any of its sources (a
manifest, a SIF's ``unsquashfs -lln`` listing plus its unpacked contents, a directory) over the
same fields, so the three compare. Node-local trees: ``et_hpc.images.cas_node``. Layout and
guarantees: docs/images.md ("The layered store").
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import json
import os
import re
import secrets
import stat
import subprocess
import tempfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from et_hpc.errors import InfraError
from et_hpc.host import apptainer
from et_hpc.images.unpack import rmtree, unpack_sif
from et_hpc.util import atomic_write_bytes, fsync_dir

CHUNK = 1 << 20
ZLEVEL = 1  # objects are zlib streams; level 1: about as small as squashfs's gzip for these files, and fast
FIELDS = ("p", "t", "m", "u", "g", "l", "r", "h")  # path, type, mode, uid, gid, link target, rdev, object
TYPES = {"-": "f", "d": "d", "l": "l", "c": "c", "b": "b", "p": "p", "s": "s"}
Entry = dict[str, Any]


def cas_dir(cache_dir: Path) -> Path:
    return Path(cache_dir) / "cas"


def object_path(cache_dir: Path, h: str) -> Path:
    return cas_dir(cache_dir) / "objects" / h[:2] / h


def manifest_path(cache_dir: Path, h: str) -> Path:
    return cas_dir(cache_dir) / "manifests" / h[:2] / f"{h}.json.gz"


@contextmanager
def gc_guard(cache_dir: Path, *, exclusive: bool = False) -> Iterator[bool]:
    """Ingests hold this shared, the object sweep exclusively (without waiting: yields False when
    an ingest runs), so no object an ingest is about to reference is swept under it."""
    p = cas_dir(cache_dir) / ".gc.lock"
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB if exclusive else fcntl.LOCK_SH)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


# -- the digest ------------------------------------------------------------------------------
def _line(e: Entry, owners: bool) -> bytes:
    vals = [e.get(k) for k in FIELDS if owners or k not in ("u", "g")]
    return json.dumps(vals, separators=(",", ":")).encode() + b"\n"


def tree_digest(entries: Iterable[Entry], *, owners: bool = True) -> str:
    """sha256 over the entries sorted by path: type, mode (incl. set-id and sticky bits), owner and
    group (unless ``owners`` is False), link target, device numbers, content sha256. The root
    directory itself is included as path ``.``; times are not (``mtimes`` compares those)."""
    h = hashlib.sha256()
    for e in sorted(entries, key=lambda e: e["p"]):
        h.update(_line(e, owners))
    return h.hexdigest()


def mtimes(entries: Iterable[Entry]) -> dict[str, int | None]:
    """Path -> mtime (whole seconds, as squashfs keeps them) of files, directories and links."""
    return {e["p"]: e.get("mt") for e in entries if e["t"] in ("f", "d", "l")}


PROVENANCE = (".singularity.d/labels.json", ".singularity.d/Singularity")


def build_view(entries: Iterable[Entry], read: Callable[[Entry], str]) -> dict[str, tuple]:
    """Path -> the fields ``tree_digest`` covers, to compare two builds of one recipe entry by
    entry: the build's provenance files by their text (``read``) with what no two builds share
    named alike (labels.json's build date, the staged files' temporary directory in the def)."""
    out = {}
    for e in entries:
        fields = tuple(e.get(k) for k in FIELDS[1:])
        if e["p"] == PROVENANCE[0]:
            fields = (*fields[:-1], re.sub(r'"org\.label-schema\.build-date": "[^"]*",?', "", read(e)))
        elif e["p"] == PROVENANCE[1]:
            fields = (*fields[:-1], re.sub(r"\S*/build-[0-9a-f]{12}-[^/]+/files/", "SCRATCH/build-*/files/", read(e)))
        out[e["p"]] = fields
    return out


def manifest_view(cache_dir: Path, h: str) -> dict[str, tuple]:
    """``build_view`` of a stored manifest."""
    return build_view(read_manifest(cache_dir, h), lambda e: b"".join(read_object(cache_dir, e["h"])).decode())


def sif_view(sif: Path, *, scratch: Path | None = None) -> dict[str, tuple]:
    """``build_view`` of a SIF's root (unpacked to a temp dir under ``scratch``)."""
    with _unpacked(sif, scratch) as (entries, root):
        return build_view(entries, lambda e: (root / e["p"]).read_text())


def differing(a: dict[str, tuple], b: dict[str, tuple]) -> list[str]:
    """The paths where two ``build_view``s differ (or only one has), sorted."""
    return sorted(p for p in a.keys() | b.keys() if a.get(p) != b.get(p))


def hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(CHUNK):
            h.update(b)
    return h.hexdigest()


def entries_from_tree(root: Path) -> list[Entry]:
    """The entries of a directory as it is on disk (lstat: its owners are the disk's)."""
    root = Path(root)
    out = []
    for top, dirs, files in os.walk(root):
        dirs.sort()
        for name in ["", *dirs, *files] if top == str(root) else [*dirs, *files]:
            p = os.path.join(top, name) if name else top
            out.append(_entry(root, Path(p)))
        for d in list(dirs):
            if os.path.islink(os.path.join(top, d)):
                dirs.remove(d)
    return out


def _entry(root: Path, p: Path) -> Entry:
    st = os.lstat(p)
    rel = os.path.relpath(p, root)
    t = _type(st.st_mode)
    e: Entry = {"p": rel, "t": t, "m": stat.S_IMODE(st.st_mode), "u": st.st_uid, "g": st.st_gid, "l": None, "r": None, "h": None}
    e["mt"] = int(st.st_mtime)  # kept (Python checks its .pyc files by the source's mtime), not digested
    if t == "f":
        e["s"] = st.st_size
    if t == "l":
        e["l"] = os.readlink(p)
    elif t == "f":
        e["h"] = hash_file(p)
    elif t in ("c", "b"):
        e["r"] = [os.major(st.st_rdev), os.minor(st.st_rdev)]
    return e


def _type(mode: int) -> str:
    for t, test in (("f", stat.S_ISREG), ("d", stat.S_ISDIR), ("l", stat.S_ISLNK), ("c", stat.S_ISCHR), ("b", stat.S_ISBLK)):
        if test(mode):
            return t
    return "p" if stat.S_ISFIFO(mode) else "s"


_LISTING = re.compile(r"^(\S{10}) (\d+)/(\d+) +(?:(\d+),\s*(\d+)|\d+) \S+ \S+ squashfs-root(/.*)?$")


def _mode(s: str) -> int:
    """The permission bits of an ``ls``-style mode string such as ``-rwsr-xr-x``."""
    m = 0
    for i, c in enumerate(s[1:10]):
        if c in "rwxst":
            m |= 1 << (8 - i)
    for i, special in ((3, stat.S_ISUID), (6, stat.S_ISGID), (9, stat.S_ISVTX)):
        if s[i] in "sStT":
            m |= special
    return m


def sif_listing(sif: Path) -> list[Entry]:
    """The entries of a SIF's root filesystem from ``unsquashfs -lln`` (owners as stored in the
    image); symlink targets and contents are filled in from an unpack (``entries_from_sif``)."""
    part = apptainer.sif_rootfs(Path(sif))
    if part is None or part[1] < 0:
        raise InfraError(f"{sif}: no root filesystem partition found in the SIF")
    cp = subprocess.run(["unsquashfs", "-lln", "-o", str(part[1]), str(sif)], capture_output=True, text=True, errors="surrogateescape")
    if cp.returncode != 0:
        raise InfraError(f"unsquashfs -lln {sif} failed ({cp.returncode}): {cp.stderr.strip()[-300:]}")
    out = []
    for line in cp.stdout.splitlines():
        m = _LISTING.match(line)
        if not m:
            continue
        perm, uid, gid, major, minor, path = m.groups()
        t = TYPES[perm[0]]
        rel = (path or "/")[1:] or "."
        if t == "l":
            rel = rel.split(" -> ", 1)[0]  # the target is read from the unpack (names may hold " -> ")
        r = [int(major), int(minor)] if major is not None else None
        out.append({"p": rel, "t": t, "m": _mode(perm), "u": int(uid), "g": int(gid), "l": None, "r": r, "h": None})
    return out


def entries_from_sif(sif: Path, unpacked: Path) -> list[Entry]:
    """A SIF's entries: types, modes and owners from its listing, link targets and contents from
    ``unpacked`` (the SIF unpacked with ``unpack_sif``)."""
    out = sif_listing(sif)
    for e in out:
        p = Path(unpacked) / e["p"]
        if e["t"] in ("f", "d", "l"):
            st = os.lstat(p)
            e["mt"] = int(st.st_mtime)
            if e["t"] == "f":
                e["s"] = st.st_size
        if e["t"] == "l":
            e["l"] = os.readlink(p)
        elif e["t"] == "f":
            e["h"] = _hash_readable(p)
    return out


def _hash_readable(p: Path) -> str:
    try:
        return hash_file(p)
    except PermissionError:  # a file unpacked without read permission for its owner (mode 0o000)
        mode = os.lstat(p).st_mode
        os.chmod(p, mode | stat.S_IRUSR)
        try:
            return hash_file(p)
        finally:
            os.chmod(p, mode)


@contextmanager
def _unpacked(sif: Path, scratch: Path | None) -> Iterator[tuple[list[Entry], Path]]:
    """A SIF's entries and its root, unpacked to a temp dir under ``scratch`` while in use."""
    with tempfile.TemporaryDirectory(dir=scratch, prefix="sif-root-") as tmp:
        root = Path(tmp) / "root"
        unpack_sif(Path(sif), root)
        try:
            yield entries_from_sif(sif, root), root
        finally:
            rmtree(root)  # before the temp dir goes: the image's modes may forbid removing it


# -- storing -----------------------------------------------------------------------------------
def put_object(cache_dir: Path, src: Path, h: str) -> int:
    """Store ``src`` (whose sha256 is ``h``) as an object, zlib-compressed, unless it is there; bytes written.
    An object already there has its mtime refreshed (an ingest's use, for gc's age guard)."""
    dst = object_path(cache_dir, h)
    if dst.exists():
        try:
            os.utime(dst)
        except OSError:
            pass
        return 0
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{h}.{secrets.token_hex(4)}.tmp"
    try:
        g = hashlib.sha256()
        z = zlib.compressobj(ZLEVEL)
        with open(src, "rb") as fi, open(tmp, "xb") as fo:
            while b := fi.read(CHUNK):
                g.update(b)
                fo.write(z.compress(b))
            fo.write(z.flush())
            fo.flush()
            os.fsync(fo.fileno())
        if g.hexdigest() != h:
            raise InfraError(f"{src} changed while it was stored (sha256 {g.hexdigest()[:12]}, hashed as {h[:12]})")
        os.chmod(tmp, 0o444)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    return dst.stat().st_size


def read_object(cache_dir: Path, h: str) -> Iterator[bytes]:
    """An object's content in chunks, checked against its name at the end (``InfraError`` if not)."""
    g = hashlib.sha256()
    z = zlib.decompressobj()
    try:
        with open(object_path(cache_dir, h), "rb") as f:
            while b := f.read(CHUNK):
                out = z.decompress(b)
                g.update(out)
                yield out
        out = z.flush()
    except zlib.error as e:
        raise InfraError(f"object {h[:12]} of the image store is damaged: {e}") from None
    g.update(out)
    yield out
    if g.hexdigest() != h or not z.eof:
        raise InfraError(f"object {h[:12]} of the image store does not match its name (sha256 {g.hexdigest()[:12]})")


def put_manifest(cache_dir: Path, entries: list[Entry]) -> str:
    """Store a manifest (canonical JSON, sorted by path) by its sha256; returns the sha256."""
    data = json.dumps(sorted(entries, key=lambda e: e["p"]), separators=(",", ":"), sort_keys=True).encode()
    h = hashlib.sha256(data).hexdigest()
    p = manifest_path(cache_dir, h)
    if not p.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(p, gzip.compress(data, mtime=0))
        fsync_dir(p.parent)
    else:
        os.utime(p)
    return h


def read_manifest(cache_dir: Path, h: str) -> list[Entry]:
    """A stored manifest, checked against its name."""
    p = manifest_path(cache_dir, h)
    try:
        data = gzip.decompress(p.read_bytes())
    except (OSError, EOFError) as e:
        raise InfraError(f"manifest {h[:12]} of the image store cannot be read: {e}") from None
    if hashlib.sha256(data).hexdigest() != h:
        raise InfraError(f"manifest {p} does not match its name: the store was changed")
    out: list[Entry] = json.loads(data)
    return out


def ingest_entries(cache_dir: Path, entries: list[Entry], root: Path) -> tuple[str, int]:
    """Store the contents of ``entries`` (read from ``root``) and their manifest: (manifest, new bytes)."""
    new = 0
    with gc_guard(cache_dir):
        for e in entries:
            if e["t"] == "f":
                new += put_object(cache_dir, Path(root) / e["p"], e["h"])
        return put_manifest(cache_dir, entries), new


def ingest_sif(cache_dir: Path, sif: Path, *, scratch: Path | None = None) -> tuple[str, int]:
    """Store a SIF's root filesystem: (its manifest's sha256, bytes of new objects)."""
    with _unpacked(sif, scratch) as (entries, root):
        return ingest_entries(cache_dir, entries, root)


def tree_bytes(cache_dir: Path, h: str) -> int:
    """The bytes of a manifest's distinct file contents (what its tree needs on a node with an empty pool)."""
    return sum({e["h"]: e.get("s") or 0 for e in read_manifest(cache_dir, h) if e["t"] == "f"}.values())


def referenced(cache_dir: Path, manifests: Iterable[str]) -> set[str]:
    """The objects the given manifests name."""
    out: set[str] = set()
    for m in manifests:
        out.update(e["h"] for e in read_manifest(cache_dir, m) if e.get("h"))
    return out


def sweep(cache_dir: Path, keep_manifests: set[str], *, min_age_s: float, now: float, dry_run: bool = False) -> tuple[int, int]:
    """Remove manifests not in ``keep_manifests`` and objects none of those name, except what was
    written or used within ``min_age_s``; skipped while an ingest runs. (files removed, bytes)."""
    with gc_guard(cache_dir, exclusive=True) as free:
        if not free:
            return 0, 0
        live = referenced(cache_dir, keep_manifests)
        files = nbytes = 0
        cas = cas_dir(cache_dir)
        for p in [*cas.glob("manifests/??/*.json.gz"), *cas.glob("objects/??/*")]:
            name = p.name.split(".")[0]
            if name in keep_manifests or name in live or p.name.startswith("."):
                continue
            try:
                st = p.stat()
            except OSError:
                continue
            if now - st.st_mtime < min_age_s:
                continue
            files += 1
            nbytes += st.st_size
            if not dry_run:
                p.unlink(missing_ok=True)
        return files, nbytes


def copy_tree_bytes(cache_dir: Path) -> int:
    """Bytes the CAS holds (objects and manifests)."""
    total = 0
    for top, _, files in os.walk(cas_dir(cache_dir)):
        for f in files:
            try:
                total += os.lstat(os.path.join(top, f)).st_size
            except OSError:
                pass
    return total
