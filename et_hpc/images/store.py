"""ImageStore: content-addressed task images, built rootless once into a shared cache.

The key of an image is the sha256 of (store format, the normalised def text, the digest of the
base SIF it starts from, the content of every file it copies in). Layout under the cache dir::

    images/<key[:2]>/<key>.sif    the image (appears by atomic rename, never half)
    images/<key[:2]>/<key>.json   metadata: task ids, built_at, host, seconds, digest, rewrites
    failed/<key>.json             a failed build: one-line reason and the log tail
    logs/<key>.log                the last build log (rewrites at the top)
    locks/<key>.lock              held while a build runs (see ``lock.py``)

Many processes on many nodes may ``ensure`` the same key at once: one builds, the others wait
for the lock and then find the image. ``lookup`` never builds and is cheap (per-file and base
digests are cached by path, size and mtime).

An image is checked against the sha256 recorded at build time before it is handed out: cheaply
(size, mtime and inode as recorded) and in full when those changed. One that no longer matches
(someone with write access to the cache swapped it) is refused as ``missing`` with a one-line
reason; ``et-hpc build`` rebuilds it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from et_hpc import paths
from et_hpc.errors import UserError
from et_hpc.host import slurm as watch
from et_hpc.host.apptainer import clean_env as apptainer_clean_env
from et_hpc.host.apptainer import exe as apptainer_exe
from et_hpc.images.lock import BuildLock, LockInfo, LockTimeout
from et_hpc.util import atomic_write_text, file_tail, fsync_dir, progress_bar, sha256_file

log = logging.getLogger(__name__)

FORMAT = 1
Status = Literal["built", "cached", "failed", "missing"]


HOST_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
BUILD_CA_PATH = "/tmp/.et-hpc-build-ca.crt"  # where the bundle is bound during %post
_CA_EXPORTS = (
    f"if [ -r {BUILD_CA_PATH} ]; then export PIP_CERT={BUILD_CA_PATH} SSL_CERT_FILE={BUILD_CA_PATH} "
    f"REQUESTS_CA_BUNDLE={BUILD_CA_PATH} CURL_CA_BUNDLE={BUILD_CA_PATH} GIT_SSL_CAINFO={BUILD_CA_PATH}; fi"
)


def with_build_ca(text: str) -> str:
    """Make the first line of ``%post`` point pip, curl, requests and git at the bound CA bundle."""
    lines = text.splitlines(keepends=True)
    for i, ln in enumerate(lines):
        if ln.lstrip().startswith("%post") and (ln.strip() == "%post" or ln.strip()[5:6].isspace()):
            lines.insert(i + 1, f"    {_CA_EXPORTS}\n")
            return "".join(lines)
    return text


class ImageStoreConfig(BaseModel):
    """What a user can tune about building (all in seconds)."""

    model_config = ConfigDict(extra="forbid")

    build_timeout_s: float = 1800.0  # one apptainer build
    stale_after_s: float = 60.0  # a lock without heartbeat for this long is taken over
    wait_timeout_s: float | None = None  # waiting for another builder; default build timeout + 2 * stale
    apptainer: str = Field(default_factory=apptainer_exe)  # $ET_HPC_APPTAINER or apptainer
    keep_failed_logs_lines: int = 40
    # CA bundle that %post's pip/curl/git trust during builds (sites whose TLS proxy re-signs traffic):
    # default the host's system bundle; "none" turns it off. It is bound read-only for the build only
    # and does not change the image key.
    ca_bundle: str | None = HOST_CA_BUNDLE

    @classmethod
    def from_env(cls, **overrides: Any) -> ImageStoreConfig:
        env = {
            "build_timeout_s": os.environ.get("ET_HPC_BUILD_TIMEOUT"),
            "stale_after_s": os.environ.get("ET_HPC_LOCK_STALE"),
        }
        vals: dict[str, Any] = {k: float(v) for k, v in env.items() if v}
        if os.environ.get("ET_HPC_BUILD_CA_BUNDLE"):
            vals["ca_bundle"] = os.environ["ET_HPC_BUILD_CA_BUNDLE"]
        vals.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**vals)

    def build_ca(self) -> Path | None:
        if not self.ca_bundle or self.ca_bundle == "none":
            return None
        p = Path(self.ca_bundle)
        return p if p.is_file() else None


StoreSettings = ImageStoreConfig  # the old name, which build chunks pickled by queued jobs name


class ImageResult(BaseModel):
    task_id: str
    key: str | None
    status: Status
    path: Path | None = None
    digest: str | None = None
    reason: str | None = None
    log_path: Path | None = None
    seconds: float = 0.0


def _stat_key(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_size, st.st_mtime_ns, st.st_ino)


class _DigestCache:
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

    def remember(self, task: Any, recipe: Any, key: str) -> None:
        tid = self._id(task)
        if tid is None:
            return
        r = task.recipe
        paths = [Path(r.path), Path(r.context_dir)] + [Path(src) for src, _ in recipe.files]
        if getattr(recipe, "base", None):
            paths.append(Path(recipe.base))
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
# tasks/) and this file.
_KEY_CODE = ("tasks/recipe.py", "tasks/dockerfile.py", "tasks/bases.py", "tasks/files.py", "tasks/model.py",
             "images/store.py")


def _code_signature() -> str:
    """Digest of the code that turns recipes into keys (a change invalidates the lookup index)."""
    global _CODE_SIG
    if _CODE_SIG is None:
        h = hashlib.sha256()
        pkg = Path(__file__).resolve().parent.parent
        for name in _KEY_CODE:
            try:
                h.update((pkg / name).read_bytes())
            except OSError:
                h.update(name.encode())
        _CODE_SIG = h.hexdigest()
    return _CODE_SIG


class ImageStore:
    """Build-once, content-addressed images for tasks.

    ``normalise(task, base_map=...)`` turns a task into a ``NormalisedRecipe`` (``text``,
    ``files`` as (source path, name in the build dir), ``base``, ``rewrites``); the default is
    ``et_hpc.tasks.recipe.normalise``.
    """

    def __init__(
        self,
        cache_dir: Path | None = None,
        *,
        base_map: dict[str, Path] | None = None,
        scratch: Path | None = None,
        settings: ImageStoreConfig | None = None,
        normalise: Callable[..., Any] | None = None,
        **overrides: Any,
    ) -> None:
        self.cache_dir = Path(cache_dir) if cache_dir else paths.cache_dir()
        self._base_map = base_map
        self._scratch = Path(scratch) if scratch else None
        self.settings = settings or ImageStoreConfig.from_env(**overrides)
        self._normalise = normalise
        self._digests = _DigestCache()
        self._base_digests: dict[str, tuple[tuple[int, int, int], str]] = {}
        self._index: LookupIndex | None = None

    @property
    def index(self) -> LookupIndex:
        if self._index is None:
            sig = hashlib.sha256(_code_signature().encode())
            for name, p in sorted(self.base_map.items()):
                sig.update(f"{name}={p}\n".encode())
            self._index = LookupIndex(self.cache_dir / "index" / f"lookups-{FORMAT}.json", sig.hexdigest())
        return self._index

    # -- paths -------------------------------------------------------------------------------
    @property
    def base_map(self) -> dict[str, Path]:
        if self._base_map is None:
            from et_hpc.images.base import default_base_map

            self._base_map = default_base_map(self.cache_dir)
        return self._base_map

    @property
    def scratch(self) -> Path:
        if self._scratch is None:
            self._scratch = paths.scratch_dir()
        self._scratch.mkdir(parents=True, exist_ok=True)
        return self._scratch

    def sif_path(self, key: str) -> Path:
        return self.cache_dir / "images" / key[:2] / f"{key}.sif"

    def meta_path(self, key: str) -> Path:
        return self.cache_dir / "images" / key[:2] / f"{key}.json"

    def failed_path(self, key: str) -> Path:
        return self.cache_dir / "failed" / f"{key}.json"

    def log_path(self, key: str) -> Path:
        return self.cache_dir / "logs" / f"{key}.log"

    def lock_path(self, key: str) -> Path:
        return self.cache_dir / "locks" / f"{key}.lock"

    # -- keys --------------------------------------------------------------------------------
    def normalised(self, task: Any) -> Any:
        fn = self._normalise
        if fn is None:
            from et_hpc.tasks.recipe import normalise as fn  # noqa: N813
        return fn(task, base_map=self.base_map)

    def base_digest(self, base: Path) -> str:
        """sha256 of a base SIF: from memory, its sidecar (.json with size/mtime), or computed once."""
        base = Path(base)
        try:
            st = os.stat(base)
        except FileNotFoundError:
            raise UserError(f"base image {base} not found: build it with 'et-hpc base build'") from None
        sk = _stat_key(st)
        hit = self._base_digests.get(str(base))
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
                atomic_write_text(base.with_name(base.name + ".sha256.json"), json.dumps(
                    {"digest": digest, "size": st.st_size, "mtime_ns": st.st_mtime_ns}))
            except OSError:
                pass  # read-only location: memory only
        self._base_digests[str(base)] = (sk, digest)
        return digest

    def key_for(self, recipe: Any) -> str:
        h = hashlib.sha256()
        h.update(f"et-hpc image store format {FORMAT}\n".encode())
        text = recipe.text.encode()
        h.update(f"def {len(text)}\n".encode() + text + b"\n")
        base = getattr(recipe, "base", None)
        h.update(f"base {self.base_digest(base) if base else '-'}\n".encode())
        for dest, src in sorted((str(n), Path(s)) for s, n in recipe.files):
            if not src.exists() and not src.is_symlink():
                raise UserError(f"file {src} copied in by the recipe does not exist: restore it or fix the recipe")
            h.update(f"file {dest}\0{self._digests.entry(src)}\n".encode())
        return h.hexdigest()

    def _prebuilt(self, task: Any, recipe: Any) -> ImageResult | None:
        if getattr(recipe, "kind", "def") != "sif":
            return None
        sif = Path(recipe.files[0][0])
        return ImageResult(task_id=_task_id(task), key=None, status="cached", path=sif)

    # -- lookups -----------------------------------------------------------------------------
    def _read_json(self, path: Path) -> dict | None:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def _from_store(self, task_id: str, key: str) -> ImageResult:
        sif = self.sif_path(key)
        if sif.exists():
            meta = self._read_json(self.meta_path(key)) or {}
            bad = self._changed_since_build(sif, meta)
            if bad:
                return ImageResult(task_id=task_id, key=key, status="missing", reason=bad, log_path=None)
            return ImageResult(task_id=task_id, key=key, status="cached", path=sif, digest=meta.get("digest"),
                               log_path=self.log_path(key))
        failed = self._read_json(self.failed_path(key))
        if failed is not None:
            return ImageResult(task_id=task_id, key=key, status="failed", reason=failed.get("reason"),
                               log_path=self.log_path(key))
        return ImageResult(task_id=task_id, key=key, status="missing", log_path=None)

    def _changed_since_build(self, sif: Path, meta: dict) -> str | None:
        """None when ``sif`` is the image that was built (cheap: size, mtime and inode as recorded;
        in full, sha256, when those changed), else the one-line reason it is refused."""
        want = meta.get("digest")
        if not want:
            return None  # an image from before digests were recorded: nothing to compare with
        try:
            st = os.stat(sif)
        except OSError:
            return None
        if [meta.get("size"), meta.get("mtime_ns"), meta.get("ino")] == [st.st_size, st.st_mtime_ns, st.st_ino]:
            return None
        got = self._digests.file(sif)  # memoised by path, size, mtime and inode
        if got != want:
            return (f"image {sif} does not match its recorded digest (sha256 {got[:12]}, built as {want[:12]}): "
                    f"it was changed after the build; remove it and rebuild with 'et-hpc build'")
        if meta.get("key"):  # verified in full: record the stat so the next lookup is cheap again
            try:
                atomic_write_text(self.meta_path(meta["key"]), json.dumps(
                    {**meta, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}, indent=1))
            except OSError:
                pass  # a read-only cache: verified again by the next process
        return None

    def _resolve(self, task: Any) -> tuple[str, Any, ImageResult | None]:
        """(key, normalised recipe, None) or ("", None, result) for prebuilt or unbuildable tasks."""
        tid = _task_id(task)
        try:
            recipe = self.normalised(task)
            pre = self._prebuilt(task, recipe)
            if pre is not None:
                return "", None, pre
            key = self.key_for(recipe)
        except UserError as e:
            return "", None, ImageResult(task_id=tid, key=None, status="failed", reason=str(e))
        self.index.remember(task, recipe, key)
        return key, recipe, None

    def lookup(self, task: Any) -> ImageResult:
        """Where the task's image is, without building: cached, failed (with reason) or missing."""
        key = self.index.key(task)
        if key is None:
            key, _, res = self._resolve(task)
            if res is not None:
                return res
        return self._from_store(_task_id(task), key)

    def lookup_many(self, tasks: Iterable[Any]) -> list[ImageResult]:
        """``lookup`` for many tasks; saves the lookup index so the next process is fast too."""
        out = [self.lookup(t) for t in tasks]
        self.index.save()
        return out

    # -- building ----------------------------------------------------------------------------
    def ensure(self, task: Any, *, retry_failed: bool = False, build: bool = True) -> ImageResult:
        """The task's image, building it if needed (exactly one builder per key at a time)."""
        t0 = time.monotonic()
        started = time.time()
        tid = _task_id(task)
        key = self.index.key(task)
        if key is not None:
            res = self._from_store(tid, key)
            if res.status == "cached" or not build or (res.status == "failed" and not retry_failed):
                res.seconds = time.monotonic() - t0
                return res
        key, recipe, res = self._resolve(task)
        if res is not None:
            return res
        res = self._from_store(tid, key)
        if res.status == "cached" or not build or (res.status == "failed" and not retry_failed):
            res.seconds = time.monotonic() - t0
            return res
        s = self.settings
        wait = s.wait_timeout_s if s.wait_timeout_s is not None else s.build_timeout_s + 2 * s.stale_after_s

        def note(info: LockInfo | None, waited: float) -> None:
            log.info("%s: waiting %.0f s for image %s being built by %s", tid, waited, key[:12],
                     info.describe() if info else "another process")

        lock = BuildLock(self.lock_path(key), stale_after=s.stale_after_s, timeout=wait, on_wait=note)
        try:
            lock.acquire()
        except LockTimeout as e:
            return ImageResult(task_id=tid, key=key, status="failed", reason=f"waited too long for the build: {e}",
                               seconds=time.monotonic() - t0)
        try:
            res = self._from_store(tid, key)
            if res.status == "cached":
                res.seconds = time.monotonic() - t0
                return res
            if res.status == "failed":
                rec = self._read_json(self.failed_path(key)) or {}
                # Failed while we waited (this round's answer), or failed before and no retry asked.
                if not retry_failed or float(rec.get("failed_at_epoch", 0)) >= started:
                    res.seconds = time.monotonic() - t0
                    return res
            res = self._build(tid, key, recipe, lock)
            res.seconds = time.monotonic() - t0
            return res
        finally:
            lock.release()

    def _clean_temps(self, key: str, before: float) -> None:
        d = self.sif_path(key).parent
        if not d.is_dir():
            return
        for p in d.glob(".tmp-*"):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            mine = p.name.startswith(f".tmp-{key}-")
            old = time.time() - st.st_mtime > 2 * self.settings.build_timeout_s + 3600
            if (mine and st.st_mtime <= before) or old:
                log.info("removing leftover %s", p)
                p.unlink(missing_ok=True)

    def _clean_scratch(self) -> None:
        """Remove build dirs left on this node by builds that were killed (older than any live build)."""
        limit = time.time() - self.settings.build_timeout_s - 600
        for d in self.scratch.glob("build-*"):
            try:
                if d.stat().st_mtime < limit:
                    log.info("removing leftover build dir %s", d)
                    _rmtree(d)
            except OSError:
                continue

    def _build(self, tid: str, key: str, recipe: Any, lock: BuildLock) -> ImageResult:
        s = self.settings
        sif = self.sif_path(key)
        sif.parent.mkdir(parents=True, exist_ok=True)
        self._clean_temps(key, before=lock.acquired_at or time.time())
        self._clean_scratch()
        logf = self.log_path(key)
        logf.parent.mkdir(parents=True, exist_ok=True)
        tmp_out = sif.parent / f".tmp-{key}-{uuid.uuid4().hex[:12]}.sif"
        host = socket.gethostname()
        t0 = time.monotonic()
        header = [f"# et-hpc build of {tid} key {key}", f"# host {host} pid {os.getpid()} at {_now()}"]
        header += [f"# rewrite: {r}" for r in (getattr(recipe, "rewrites", None) or [])]
        if self.settings.build_ca() is not None:
            header.append(f"# build only: {self.settings.build_ca()} bound at {BUILD_CA_PATH}; %post exports "
                          "PIP_CERT/SSL_CERT_FILE/REQUESTS_CA_BUNDLE/CURL_CA_BUNDLE/GIT_SSL_CAINFO to it "
                          "(ET_HPC_BUILD_CA_BUNDLE=none turns this off)")
        work = Path(tempfile.mkdtemp(prefix=f"build-{key[:12]}-", dir=self.scratch))
        rc: int | None = None
        reason: str | None = None
        try:
            with open(logf, "w") as lf:
                lf.write("\n".join(header) + "\n")
                lf.flush()
                try:
                    self._stage(recipe, work)
                except OSError as e:
                    reason = f"could not stage build files: {e}"
                if reason is None:
                    rc, reason = self._run_build(work, tmp_out, lf)
            if reason is None and rc == 0:
                _fsync_file(tmp_out)
                digest = sha256_file(tmp_out)
                os.replace(tmp_out, sif)
                fsync_dir(sif.parent)
                seconds = time.monotonic() - t0
                st = sif.stat()
                meta = {"key": key, "format": FORMAT, "task_ids": [tid], "built_at": _now(), "host": host,
                        "seconds": round(seconds, 2), "digest": digest, "size": st.st_size,
                        "mtime_ns": st.st_mtime_ns, "ino": st.st_ino,  # the cheap check at lookup
                        "rewrites": list(getattr(recipe, "rewrites", None) or []),
                        "base": str(getattr(recipe, "base", None) or "") or None}
                atomic_write_text(self.meta_path(key), json.dumps(meta, indent=1))
                self.failed_path(key).unlink(missing_ok=True)
                return ImageResult(task_id=tid, key=key, status="built", path=sif, digest=digest, log_path=logf)
            tail = file_tail(logf, s.keep_failed_logs_lines, raw=True)
            if reason is None and (interrupted(rc, tail) or watch.slurm_job_ending()):
                # Killed from outside (scancel, preemption, OOM, Ctrl-C): not the recipe's fault, so no
                # failure record; the next ensure builds again.
                log.warning("%s: build of %s was interrupted (exit %s); not recorded as failed", tid, key[:12], rc)
                return ImageResult(task_id=tid, key=key, status="failed", log_path=logf,
                                   reason=f"build interrupted by a signal (exit {rc}); not recorded, will be retried")
            if reason is None:
                reason = failure_reason(file_tail(logf, 300, raw=True)) or f"apptainer build exited with status {rc}"
            rec = {"key": key, "task_id": tid, "reason": reason, "exit_code": rc, "failed_at": _now(),
                   "failed_at_epoch": time.time(), "host": host, "seconds": round(time.monotonic() - t0, 2),
                   "log": str(logf), "log_tail": tail}
            atomic_write_text(self.failed_path(key), json.dumps(rec, indent=1))
            return ImageResult(task_id=tid, key=key, status="failed", reason=reason, log_path=logf)
        finally:
            tmp_out.unlink(missing_ok=True)
            _rmtree(work)

    def _stage(self, recipe: Any, work: Path) -> None:
        """Write the def into ``work`` with every copied-in file snapshotted beside it (node-local)."""
        mapping: dict[str, Path] = {}
        for i, (src, _dest) in enumerate(recipe.files):
            src = Path(src)
            staged = work / "files" / str(i) / (src.name or "root")
            staged.parent.mkdir(parents=True, exist_ok=True)
            if src.is_dir() and not src.is_symlink():
                shutil.copytree(src, staged, symlinks=True)
            else:
                shutil.copy2(src, staged, follow_symlinks=False)
            mapping[str(src)] = staged
        text = retarget_files(recipe.text, mapping)
        if self.settings.build_ca() is not None:
            text = with_build_ca(text)
        (work / "container.def").write_text(text)

    def _run_build(self, work: Path, out: Path, lf: Any) -> tuple[int | None, str | None]:
        s = self.settings
        if not shutil.which(s.apptainer):
            return None, f"{s.apptainer} not found on PATH: install Apptainer or 'module load apptainer'"
        env = apptainer_clean_env()  # no APPTAINER_*/SINGULARITY_* of the caller's (host/apptainer.py)
        tmpdir = work / "apptainer-tmp"
        tmpdir.mkdir()
        env["APPTAINER_TMPDIR"] = str(tmpdir)
        env.setdefault("APPTAINER_CACHEDIR", str(self.scratch / "apptainer-cache"))
        cmd = [s.apptainer, "build", "--fakeroot", "--force", str(out), "container.def"]
        ca = s.build_ca()
        if ca is not None:
            cmd[2:2] = ["--bind", f"{ca}:{BUILD_CA_PATH}:ro"]
        lf.write(f"$ cd {work} && {' '.join(cmd)}\n")
        lf.flush()
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=lf,
                                stderr=subprocess.STDOUT, start_new_session=True)
        guard = _start_watchdog(proc.pid)
        try:
            return proc.wait(timeout=s.build_timeout_s), None
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return None, f"build timed out after {s.build_timeout_s:.0f} s (raise build_timeout_s or ET_HPC_BUILD_TIMEOUT)"
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            _stop_watchdog(guard)

    def ensure_many(self, tasks: Iterable[Any], *, jobs: int | None = None, progress: bool = True,
                    retry_failed: bool = False, build: bool = True) -> list[ImageResult]:
        """``ensure`` for many tasks with ``jobs`` builds at once; results in input order."""
        tasks = list(tasks)
        jobs = max(1, jobs or default_jobs())
        results: list[ImageResult | None] = [None] * len(tasks)
        bar = None
        if progress:
            bar = progress_bar(total=len(tasks), desc="images", unit="task", show=True, dynamic_ncols=True)
        counts: dict[str, int] = {}

        def one(i: int) -> None:
            try:
                r = self.ensure(tasks[i], retry_failed=retry_failed, build=build)
            except Exception as e:  # an infrastructure surprise on one task must not stop the others
                log.exception("image for %s", _task_id(tasks[i]))
                r = ImageResult(task_id=_task_id(tasks[i]), key=None, status="failed", reason=f"{type(e).__name__}: {e}")
            results[i] = r
            if bar is not None:
                counts[r.status] = counts.get(r.status, 0) + 1
                bar.set_postfix(counts, refresh=False)
                bar.update(1)

        try:
            with ThreadPoolExecutor(max_workers=jobs) as ex:
                list(ex.map(one, range(len(tasks))))
        finally:
            if bar is not None:
                bar.close()
            self.index.save()
        return [r for r in results if r is not None]


# -- helpers ---------------------------------------------------------------------------------
# Lines that say why a build failed, most telling first; the last matching line of the log wins.
_REASONS = [re.compile(p) for p in (
    r"curl: \(\d+\).*",
    r"wget: .*(unable|failed|error).*",
    r"^E: .*",
    r"ERROR: (Could not find a version|No matching distribution).*",
    r"^(ERROR|error): .*",
    r".*: command not found",
    r".*(Could not resolve host|Temporary failure (in )?(name )?resolution|Name or service not known).*",
    r".*No such file or directory.*",
    r"^(FATAL|ERROR): .*",
)]
_NOISE = re.compile(r"^(INFO|WARNING|VERBOSE|DEBUG):|^#|^\$ ")


_SIGNALLED = re.compile(r"exit status (130|137|143)\b|signal: (killed|terminated|interrupt)", re.I)


def interrupted(rc: int | None, tail: list[str]) -> bool:
    """Did the build die of a signal (ours or a step's: SIGINT, SIGKILL, SIGTERM) rather than fail?"""
    if rc is None:
        return False
    if rc < 0 or rc in (130, 137, 143):
        return True
    return any(_SIGNALLED.search(ln) for ln in tail[-5:])


def failure_reason(lines: list[str]) -> str | None:
    """The most telling error line of a build log tail, as one line."""
    clean = [ln.strip() for ln in lines if ln.strip()]
    for rx in _REASONS:
        for ln in reversed(clean):
            m = rx.search(ln)
            if m and not _NOISE.match(ln):
                return re.sub(r"\s+", " ", m.group(0))[:300]  # from the match: drops progress-meter junk
    for ln in reversed(clean):
        if not _NOISE.match(ln):
            return re.sub(r"\s+", " ", ln)[:300]
    return None


def default_jobs() -> int:
    """Parallel builds by default: half the cores (a build is itself multi-threaded), at least one."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, n // 2)


def retarget_files(text: str, mapping: dict[str, Path]) -> str:
    """Point ``%files`` sources named in ``mapping`` (host path -> staged copy) at the staged copies."""
    out, in_files = [], False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("%"):
            name, _, args = stripped[1:].partition(" ")
            in_files = name in ("files", "appfiles") and not args.strip().startswith("from ")
        elif in_files and stripped and not stripped.startswith("#"):
            try:
                toks = shlex.split(stripped)
            except ValueError:
                toks = []
            if toks and toks[0] in mapping:
                indent = line[: len(line) - len(line.lstrip())]
                line = indent + " ".join(shlex.quote(t) for t in [str(mapping[toks[0]]), *toks[1:]])
        out.append(line)
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def _task_id(task: Any) -> str:
    return str(getattr(task, "id", None) or task)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Runs beside a build: when the building process dies (even by SIGKILL) its end of the pipe closes
# and this ends the build's process group, which apptainer's fakeroot helpers would otherwise outlive.
_WATCHDOG = """
import os, signal, sys, time
pgid = int(sys.argv[1])
if sys.stdin.read() != "done":
    for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        end = time.monotonic() + grace
        while time.monotonic() < end:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                sys.exit(0)
            time.sleep(0.2)
"""


def _start_watchdog(pgid: int) -> subprocess.Popen | None:
    try:
        return subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(pgid)], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                text=True)
    except OSError as e:
        log.warning("no watchdog for build group %s: %s", pgid, e)
        return None


def _stop_watchdog(guard: subprocess.Popen | None) -> None:
    if guard is None:
        return
    try:
        guard.communicate("done", timeout=30)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        guard.kill()
        guard.wait()


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():  # files owned by mapped ids (fakeroot): remove inside a user namespace
        subprocess.run(["unshare", "--map-auto", "--map-root-user", "rm", "-rf", str(path)], capture_output=True)
