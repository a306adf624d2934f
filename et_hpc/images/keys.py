"""Image keys and the lookup index: what names an image, and how a fresh process finds it fast.

A key is the sha256 of (store format, the normalised def text, the digest of the base SIF, the
content of every copied-in file); ``recipe_key`` computes it. ``LookupIndex`` maps a recipe path to
its key while the recipe, its files, its base and the code listed in ``KEY_CODE`` are unchanged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from et_hpc.errors import UserError
from et_hpc.util import atomic_write_text, sha256_file

if TYPE_CHECKING:
    from et_hpc.tasks.model import NormalisedRecipe

log = logging.getLogger(__name__)

FORMAT = 1


def _stat_key(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_size, st.st_mtime_ns, st.st_ino)


class DigestCache:
    """sha256 of files and trees, memoised by (path, size, mtime, inode)."""

    def __init__(self) -> None:
        self._memo: dict[str, tuple[tuple[int, int, int], str]] = {}
        self._lock = threading.Lock()

    def file(self, path: Path) -> str:
        st = os.stat(path)
        k = str(path)
        sk = _stat_key(st)
        with self._lock:
            hit = self._memo.get(k)
        if hit and hit[0] == sk:
            return hit[1]
        digest = sha256_file(path)
        with self._lock:
            self._memo[k] = (sk, digest)
        return digest

    def entry(self, path: Path) -> str:
        """Digest of a file or a directory tree (names, contents, executable bits, symlinks)."""
        path = Path(path)
        if path.is_symlink():
            return "link:" + os.readlink(path)
        if path.is_dir():
            h = hashlib.sha256()
            for root, dirs, files in os.walk(path):
                dirs.sort()
                for name in sorted(files + [d for d in dirs if os.path.islink(os.path.join(root, d))]):
                    p = Path(root, name)
                    h.update(f"{p.relative_to(path)}\0{self.entry(p)}\0{self._mode(p)}\n".encode())
                for d in dirs:
                    h.update(f"{Path(root, d).relative_to(path)}/\n".encode())
            return "tree:" + h.hexdigest()
        return self.file(path) + f":{self._mode(path)}"

    @staticmethod
    def _mode(p: Path) -> str:
        try:
            return "x" if os.lstat(p).st_mode & 0o111 else "-"
        except OSError:
            return "?"


def _stat_list(p: Path) -> list[int] | None:
    try:
        st = os.stat(p)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ino]


class LookupIndex:
    """Recipe path -> image key, valid while the recipe, its context dir, copied files and base are
    unchanged (size, mtime, inode) and the normalising code is the same. Lets a fresh process look up
    thousands of tasks without normalising and hashing; a miss just falls back to the full path."""

    RACY_S = 2.0  # files changed this recently may change again within the same mtime tick

    def __init__(self, path: Path, sig: str) -> None:
        self.path, self.sig = path, sig
        self._entries: dict[str, dict] | None = None
        self._dirty = False
        self._lock = threading.Lock()

    def _load(self) -> dict[str, dict]:
        if self._entries is None:
            try:
                data = json.loads(self.path.read_text())
                self._entries = data["entries"] if data.get("sig") == self.sig else {}
            except (OSError, ValueError, KeyError, TypeError):
                self._entries = {}
        return self._entries

    @staticmethod
    def _id(task: Any) -> str | None:
        r = getattr(task, "recipe", None)
        return f"{r.kind}:{r.path}:{r.context_dir}" if r is not None and hasattr(r, "path") else None

    def key(self, task: Any) -> str | None:
        tid = self._id(task)
        if tid is None:
            return None
        with self._lock:
            ent = self._load().get(tid)
        if not ent:
            return None
        for p, want in ent["stats"]:
            if _stat_list(Path(p)) != want:
                return None
        return ent["key"]

    def remember(self, task: Any, recipe: NormalisedRecipe, key: str) -> None:
        tid = self._id(task)
        if tid is None:
            return
        r = task.recipe
        paths = [Path(r.path), Path(r.context_dir)] + [Path(src) for src, _ in recipe.files]
        base = getattr(recipe, "base", None)
        if base:
            paths.append(Path(base))
        stats = []
        now = time.time_ns()
        for p in paths:
            st = _stat_list(p)
            if st is None or now - st[1] < self.RACY_S * 1e9 or (p.is_dir() and p not in paths[:2]):
                return  # missing, too fresh to trust, or a copied directory tree: always recompute
            stats.append([str(p), st])
        with self._lock:
            self._load()[tid] = {"key": key, "stats": stats}
            self._dirty = True

    def save(self) -> None:
        with self._lock:
            if not self._dirty or self._entries is None:
                return
            try:
                atomic_write_text(self.path, json.dumps({"sig": self.sig, "entries": self._entries}))
                self._dirty = False
            except OSError as e:
                log.debug("lookup index not saved: %s", e)


_CODE_SIG: str | None = None
# The modules whose code decides a recipe's key: parsing, normalising and resolving bases (under
# tasks/) and the modules of images/ that compute the key. A test checks this list against the
# modules that run while keys are computed.
KEY_CODE = (
    "tasks/recipe.py",
    "tasks/dockerfile.py",
    "tasks/base_names.py",
    "tasks/files.py",
    "tasks/model.py",
    "images/store.py",
    "images/keys.py",
)


def _code_signature() -> str:
    """Digest of the code that turns recipes into keys (a change invalidates the lookup index)."""
    global _CODE_SIG
    if _CODE_SIG is None:
        h = hashlib.sha256()
        pkg = Path(__file__).resolve().parent.parent
        for name in KEY_CODE:
            try:
                h.update((pkg / name).read_bytes())
            except OSError:
                h.update(name.encode())
        _CODE_SIG = h.hexdigest()
    return _CODE_SIG


def base_digest(base: Path, memo: dict[str, tuple[tuple[int, int, int], str]]) -> str:
    """sha256 of a base SIF: from ``memo``, its sidecar (.json with size/mtime), or computed once."""
    base = Path(base)
    try:
        st = os.stat(base)
    except FileNotFoundError:
        raise UserError(f"base image {base} not found: build it with 'et-hpc base build'") from None
    sk = _stat_key(st)
    hit = memo.get(str(base))
    if hit and hit[0] == sk:
        return hit[1]
    digest = None
    for side in (base.with_suffix(".json"), base.with_name(base.name + ".sha256.json")):
        try:
            meta = json.loads(side.read_text())
        except (OSError, ValueError):
            continue
        if meta.get("size") == st.st_size and meta.get("mtime_ns") == st.st_mtime_ns and meta.get("digest"):
            digest = meta["digest"]
            break
    if digest is None:
        digest = sha256_file(base)
        try:
            atomic_write_text(
                base.with_name(base.name + ".sha256.json"), json.dumps({"digest": digest, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
            )
        except OSError:
            pass  # read-only location: memory only
    memo[str(base)] = (sk, digest)
    return digest


def recipe_key(recipe: NormalisedRecipe, digest_of_base: Callable[[Path], str], digests: DigestCache) -> str:
    """The image key of a normalised recipe (see the module docstring)."""
    h = hashlib.sha256()
    h.update(f"et-hpc image store format {FORMAT}\n".encode())
    text = recipe.text.encode()
    h.update(f"def {len(text)}\n".encode() + text + b"\n")
    base = getattr(recipe, "base", None)
    h.update(f"base {digest_of_base(base) if base else '-'}\n".encode())
    hash_files(h, recipe.files, digests)
    return h.hexdigest()


def hash_files(h: Any, files: Iterable[tuple[Path, str]], digests: DigestCache) -> None:
    """Add the files a recipe (or one step of it) copies in to ``h``: each destination with its
    source's content digest, in destination order; a missing source is the user's to fix."""
    for dest, src in sorted((str(n), Path(s)) for s, n in files):
        if not src.exists() and not src.is_symlink():
            raise UserError(f"file {src} copied in by the recipe does not exist: restore it or fix the recipe")
        h.update(f"file {dest}\0{digests.entry(src)}\n".encode())
