"""ImageStore: content-addressed task images, built rootless once into a shared cache.

Layout under the cache dir: ``images/<key[:2]>/<key>.sif`` (appears by atomic rename) and
``.json`` (task ids, host, seconds, digest), ``failed/<key>.json`` (one-line reason, log tail),
``logs/<key>.log``, ``locks/<key>.lock`` (held while a build runs). Keys: ``keys.py``; the build
steps: ``build.py``. Many processes may ``ensure`` one key at once: one builds, the others wait
for the lock and find the image. ``lookup`` never builds and is cheap. An image whose size,
mtime or inode changed since its build is checked against its recorded sha256; one that no
longer matches is refused as ``missing`` with a one-line reason.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from et_hpc import paths
from et_hpc.errors import InfraError, UserError
from et_hpc.host import slurm
from et_hpc.host.apptainer import exe as apptainer_exe
from et_hpc.images import keys
from et_hpc.images.build import (  # noqa: F401  (failure_reason, interrupted, retarget_files: re-exported)
    BUILD_CA_PATH,
    HOST_CA_BUNDLE,
    as_built,
    default_jobs,
    failure_reason,
    fsync_file,
    interrupted,
    now_utc,
    remove_tree,
    retarget_files,
    run_build,
    stage,
    with_build_ca,
)
from et_hpc.images.keys import FORMAT, DigestCache, LookupIndex
from et_hpc.images.lock import BuildLock, LockInfo, LockTimeout
from et_hpc.util import atomic_write_text, file_tail, fsync_dir, progress_bar, sha256_file

if TYPE_CHECKING:
    from et_hpc.tasks.model import NormalisedRecipe, Recipe, Task

    Buildable = Task | Recipe | Path | str  # what has an image: a task, its recipe, or a recipe file

log = logging.getLogger(__name__)

Status = Literal["built", "cached", "failed", "missing"]


class ImageStoreConfig(BaseModel):
    """What a user can tune about building (times in seconds)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    build_timeout_s: float = 1800.0
    """The time limit of one apptainer build ($ET_HPC_BUILD_TIMEOUT)."""
    stale_after_s: float = 60.0
    """A build lock without heartbeat for this long is taken over ($ET_HPC_LOCK_STALE)."""
    wait_timeout_s: float | None = None
    """How long to wait for another builder; default: the build timeout + 2 * stale_after_s."""
    apptainer: str = Field(default_factory=apptainer_exe)
    """The apptainer executable: $ET_HPC_APPTAINER, else apptainer."""
    keep_failed_logs_lines: int = 40
    """Lines of a failed build's log kept in its failure record."""
    ca_bundle: str | None = HOST_CA_BUNDLE
    """CA bundle that %post's pip/curl/git trust during builds (sites whose TLS proxy re-signs traffic;
    $ET_HPC_BUILD_CA_BUNDLE): default the host's system bundle; "none" turns it off. It is bound
    read-only for the build only and does not change the image key."""

    download_cache: str | None = None
    """Where builds share what %post downloads (apt .debs, pip's cache; et_hpc.images.downloads):
    a directory, or "on" for <cache>/downloads ($ET_HPC_DOWNLOAD_CACHE). Default off. Bound for the
    build only; the image key is unchanged."""

    layout: Literal["sif", "cas"] = "sif"
    """How task images are kept ($ET_HPC_IMAGE_LAYOUT): "sif", one SIF per task; "cas", each
    distinct file once in a content-addressed store plus a manifest per task, made into node-local
    trees by hard links (et_hpc.images.cas; docs/images.md, "The layered store")."""

    step_builds: bool = True
    """In the CAS layout, build a recipe step by step and reuse the steps other recipes built
    ($ET_HPC_STEP_BUILDS=0 turns it off; et_hpc.images.steps). No effect on the SIF layout."""

    @classmethod
    def from_env(cls, **overrides: Any) -> ImageStoreConfig:
        env = {
            "build_timeout_s": os.environ.get("ET_HPC_BUILD_TIMEOUT"),
            "stale_after_s": os.environ.get("ET_HPC_LOCK_STALE"),
        }
        vals: dict[str, Any] = {k: float(v) for k, v in env.items() if v}
        if os.environ.get("ET_HPC_DOWNLOAD_CACHE"):
            vals["download_cache"] = os.environ["ET_HPC_DOWNLOAD_CACHE"]
        if os.environ.get("ET_HPC_IMAGE_LAYOUT"):
            vals["layout"] = os.environ["ET_HPC_IMAGE_LAYOUT"]
        if os.environ.get("ET_HPC_STEP_BUILDS"):
            vals["step_builds"] = os.environ["ET_HPC_STEP_BUILDS"].strip().lower() not in ("0", "off", "no", "false")
        if os.environ.get("ET_HPC_BUILD_CA_BUNDLE"):
            vals["ca_bundle"] = os.environ["ET_HPC_BUILD_CA_BUNDLE"]
        vals.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**vals)

    def downloads_dir(self, cache_dir: Path) -> Path | None:
        v = (self.download_cache or "").strip()
        if not v or v.lower() in ("off", "none", "0", "no"):
            return None
        return cache_dir / "downloads" if v.lower() in ("on", "1", "yes") else Path(v)

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
        normalise: Callable[..., NormalisedRecipe] | None = None,
        **overrides: Any,
    ) -> None:
        self.cache_dir = Path(cache_dir).expanduser().absolute() if cache_dir else paths.cache_dir()  # builds run in other dirs
        self._base_map = base_map
        self._scratch = Path(scratch) if scratch else None
        self.settings = settings or ImageStoreConfig.from_env(**overrides)
        self._normalise = normalise
        self._digests = DigestCache()
        self._base_digests: dict[str, tuple[tuple[int, int, int], str]] = {}
        self._index: LookupIndex | None = None

    @property
    def index(self) -> LookupIndex:
        if self._index is None:
            sig = hashlib.sha256(keys._code_signature().encode())
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

    def cas_ref_path(self, key: str) -> Path:
        """The CAS layout's image: a small JSON naming the image's manifest."""
        return self.cache_dir / "images" / key[:2] / f"{key}.cas"

    def meta_path(self, key: str) -> Path:
        return self.cache_dir / "images" / key[:2] / f"{key}.json"

    def failed_path(self, key: str) -> Path:
        return self.cache_dir / "failed" / f"{key}.json"

    def log_path(self, key: str) -> Path:
        return self.cache_dir / "logs" / f"{key}.log"

    def lock_path(self, key: str) -> Path:
        return self.cache_dir / "locks" / f"{key}.lock"

    # -- keys --------------------------------------------------------------------------------
    def normalised(self, task: Buildable) -> NormalisedRecipe:
        if self._normalise is not None:
            return self._normalise(task, base_map=self.base_map)
        from et_hpc.tasks.recipe import normalise

        return normalise(task, base_map=self.base_map)

    def base_digest(self, base: Path) -> str:
        """sha256 of a base SIF: from memory, its sidecar (.json with size/mtime), or computed once."""
        return keys.base_digest(base, self._base_digests)

    def key_for(self, recipe: NormalisedRecipe) -> str:
        return keys.recipe_key(recipe, self.base_digest, self._digests)

    def _prebuilt(self, task: Buildable, recipe: NormalisedRecipe) -> ImageResult | None:
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
        ref = self.cas_ref_path(key)
        if not sif.exists() and ref.exists():
            man = (self._read_json(ref) or {}).get("manifest")
            from et_hpc.images import cas

            if not man or not cas.manifest_path(self.cache_dir, man).is_file():
                return ImageResult(task_id=task_id, key=key, status="missing", reason=f"image {ref} names no stored manifest")
            return ImageResult(task_id=task_id, key=key, status="cached", path=ref, digest=man, log_path=self.log_path(key))
        if sif.exists():
            meta = self._read_json(self.meta_path(key)) or {}
            bad = self._changed_since_build(sif, meta)
            if bad:
                return ImageResult(task_id=task_id, key=key, status="missing", reason=bad, log_path=None)
            return ImageResult(task_id=task_id, key=key, status="cached", path=sif, digest=meta.get("digest"), log_path=self.log_path(key))
        failed = self._read_json(self.failed_path(key))
        if failed is not None:
            return ImageResult(task_id=task_id, key=key, status="failed", reason=failed.get("reason"), log_path=self.log_path(key))
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
            return (
                f"image {sif} does not match its recorded digest (sha256 {got[:12]}, built as {want[:12]}): "
                f"it was changed after the build; remove it and rebuild with 'et-hpc build'"
            )
        if meta.get("key"):  # verified in full: record the stat so the next lookup is cheap again
            try:
                atomic_write_text(
                    self.meta_path(meta["key"]),
                    json.dumps({**meta, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}, indent=1),
                )
            except OSError:
                pass  # a read-only cache: verified again by the next process
        return None

    def _resolve(self, task: Buildable) -> tuple[str, NormalisedRecipe] | ImageResult:
        """(key, normalised recipe), or the result of a prebuilt or unbuildable task."""
        tid = _task_id(task)
        try:
            recipe = self.normalised(task)
            pre = self._prebuilt(task, recipe)
            if pre is not None:
                return pre
            key = self.key_for(recipe)
        except UserError as e:
            return ImageResult(task_id=tid, key=None, status="failed", reason=str(e))
        self.index.remember(task, recipe, key)
        return key, recipe

    def lookup(self, task: Buildable) -> ImageResult:
        """Where the task's image is, without building: cached, failed (with reason) or missing."""
        key = self.index.key(task)
        if key is None:
            resolved = self._resolve(task)
            if isinstance(resolved, ImageResult):
                return resolved
            key = resolved[0]
        return self._from_store(_task_id(task), key)

    def lookup_many(self, tasks: Iterable[Buildable]) -> list[ImageResult]:
        """``lookup`` for many tasks; saves the lookup index so the next process is fast too."""
        out = [self.lookup(t) for t in tasks]
        self.index.save()
        return out

    # -- building ----------------------------------------------------------------------------
    def ensure(self, task: Buildable, *, retry_failed: bool = False, build: bool = True) -> ImageResult:
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
        resolved = self._resolve(task)
        if isinstance(resolved, ImageResult):
            return resolved
        key, recipe = resolved
        res = self._from_store(tid, key)
        if res.status == "cached" or not build or (res.status == "failed" and not retry_failed):
            res.seconds = time.monotonic() - t0
            return res
        s = self.settings
        wait = s.wait_timeout_s if s.wait_timeout_s is not None else s.build_timeout_s + 2 * s.stale_after_s

        def note(info: LockInfo | None, waited: float) -> None:
            log.info(
                "%s: waiting %.0f s for image %s being built by %s", tid, waited, key[:12], info.describe() if info else "another process"
            )

        lock = BuildLock(self.lock_path(key), stale_after=s.stale_after_s, timeout=wait, on_wait=note)
        try:
            lock.acquire()
        except LockTimeout as e:
            return ImageResult(
                task_id=tid, key=key, status="failed", reason=f"waited too long for the build: {e}", seconds=time.monotonic() - t0
            )
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
                    remove_tree(d)
            except OSError:
                continue

    def _build(self, tid: str, key: str, recipe: NormalisedRecipe, lock: BuildLock) -> ImageResult:
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
        header = [f"# et-hpc build of {tid} key {key}", f"# host {host} pid {os.getpid()} at {now_utc()}"]
        header += [f"# rewrite: {r}" for r in (getattr(recipe, "rewrites", None) or [])]
        if self.settings.build_ca() is not None:
            header.append(
                f"# build only: {self.settings.build_ca()} bound at {BUILD_CA_PATH}; %post exports "
                "PIP_CERT/SSL_CERT_FILE/REQUESTS_CA_BUNDLE/CURL_CA_BUNDLE/GIT_SSL_CAINFO to it "
                "(ET_HPC_BUILD_CA_BUNDLE=none turns this off)"
            )
        work = Path(tempfile.mkdtemp(prefix=f"build-{key[:12]}-", dir=self.scratch))
        rc: int | None = None
        reason: str | None = None
        stepped: tuple[Path, str, dict[str, Any]] | None = None
        try:
            with open(logf, "w") as lf:
                lf.write("\n".join(header) + "\n")
                lf.flush()
                mapping: dict[str, Path] = {}
                try:
                    mapping = stage(recipe, work, self.settings)
                except OSError as e:
                    reason = f"could not stage build files: {e}"
                shared = self.settings.downloads_dir(self.cache_dir)
                if reason is None and s.layout == "cas" and s.step_builds:
                    stepped = self._build_steps(key, recipe, work, mapping, lf, shared)
                if reason is None and stepped is None:
                    rc, reason = run_build(self.settings, work, tmp_out, lf, self.scratch, shared)
            if stepped is not None:
                out, digest, extra = stepped
            elif reason is None and rc == 0:
                out, digest, extra = self._publish(key, tmp_out)
            if stepped is not None or (reason is None and rc == 0):
                seconds = time.monotonic() - t0
                st = out.stat()
                meta = {
                    "key": key,
                    "format": FORMAT,
                    "task_ids": [tid],
                    "built_at": now_utc(),
                    "host": host,
                    "seconds": round(seconds, 2),
                    "digest": digest,
                    "size": st.st_size,
                    "mtime_ns": st.st_mtime_ns,
                    "ino": st.st_ino,  # the cheap check at lookup
                    "rewrites": list(getattr(recipe, "rewrites", None) or []),
                    "base": str(getattr(recipe, "base", None) or "") or None,
                    **extra,
                }
                atomic_write_text(self.meta_path(key), json.dumps(meta, indent=1))
                self.failed_path(key).unlink(missing_ok=True)
                return ImageResult(task_id=tid, key=key, status="built", path=out, digest=digest, log_path=logf)
            tail = file_tail(logf, s.keep_failed_logs_lines, raw=True)
            if reason is None and (interrupted(rc, tail) or slurm.slurm_job_ending()):
                # Killed from outside (scancel, preemption, OOM, Ctrl-C): not the recipe's fault, so no
                # failure record; the next ensure builds again.
                log.warning("%s: build of %s was interrupted (exit %s); not recorded as failed", tid, key[:12], rc)
                return ImageResult(
                    task_id=tid,
                    key=key,
                    status="failed",
                    log_path=logf,
                    reason=f"build interrupted by a signal (exit {rc}); not recorded, will be retried",
                )
            if reason is None:
                reason = failure_reason(file_tail(logf, 300, raw=True)) or f"apptainer build exited with status {rc}"
            rec = {
                "key": key,
                "task_id": tid,
                "reason": reason,
                "exit_code": rc,
                "failed_at": now_utc(),
                "failed_at_epoch": time.time(),
                "host": host,
                "seconds": round(time.monotonic() - t0, 2),
                "log": str(logf),
                "log_tail": tail,
            }
            atomic_write_text(self.failed_path(key), json.dumps(rec, indent=1))
            return ImageResult(task_id=tid, key=key, status="failed", reason=reason, log_path=logf)
        finally:
            tmp_out.unlink(missing_ok=True)
            remove_tree(work)

    def _build_steps(
        self, key: str, recipe: NormalisedRecipe, work: Path, mapping: dict[str, Path], lf: Any, shared: Path | None
    ) -> tuple[Path, str, dict[str, Any]] | None:
        """Build ``recipe`` step by step (et_hpc.images.steps) and publish its root: (the image's
        path, digest, extra record fields), or None when it is to be built whole: it cannot be cut,
        or a step failed (the whole build then decides)."""
        from et_hpc.images import cas, steps

        p = steps.plan(recipe)
        if p is None or recipe.base is None:
            lf.write("# not cut into steps: built whole\n")
            return None
        keys_ = steps.step_keys(p, self.base_digest(Path(recipe.base)), self._digests)
        t = time.monotonic()
        try:
            with cas.gc_guard(self.cache_dir):
                res = steps.build(
                    self.cache_dir,
                    p,
                    keys_,
                    base=Path(recipe.base),
                    work=work,
                    whole_def=(work / "container.def").read_text(),
                    run=lambda d, out: run_build(self.settings, work, out, lf, self.scratch, shared, def_name=d.name, sandbox=True),
                    preludes=lambda text: as_built(text, mapping, self.settings),
                    log=lf,
                    scratch=self.scratch,
                )
        except (InfraError, OSError) as e:
            res = steps.StepBuild(manifest=None, reason=str(e))
        if res.manifest is None:
            lf.write(f"# step build failed ({res.reason}); building the whole recipe\n")
            lf.flush()
            for d in work.glob("step-*"):
                if d.is_dir():
                    remove_tree(d)
            return None
        ref = self.cas_ref_path(key)
        size = cas.tree_bytes(self.cache_dir, res.manifest)
        atomic_write_text(ref, json.dumps({"key": key, "manifest": res.manifest, "bytes": size}))
        fsync_dir(ref.parent)
        extra = {
            "layout": "cas",
            "steps": len(keys_),
            "steps_built": res.built,
            "steps_reused": res.reused,
            "step_seconds": res.seconds,
            "new_bytes": res.new_bytes,
            "step_build_s": round(time.monotonic() - t, 2),
        }
        return ref, res.manifest, extra

    def _publish(self, key: str, built: Path, layout: str | None = None) -> tuple[Path, str, dict[str, Any]]:
        """Put a built SIF in place: (the image's path, its digest, extra record fields). In the CAS
        layout the SIF's root is stored file by file and the SIF is dropped; the digest is the manifest's."""
        if (layout or self.settings.layout) == "cas":
            from et_hpc.images import cas

            t = time.monotonic()
            ref = self.cas_ref_path(key)
            with cas.gc_guard(self.cache_dir):  # the manifest is named by an image before gc can look
                man, new = cas.ingest_sif(self.cache_dir, built, scratch=self.scratch)
                size = cas.tree_bytes(self.cache_dir, man)
                atomic_write_text(ref, json.dumps({"key": key, "manifest": man, "bytes": size}))
            fsync_dir(ref.parent)
            return (
                ref,
                man,
                {"layout": "cas", "sif_bytes": built.stat().st_size, "new_bytes": new, "ingest_s": round(time.monotonic() - t, 2)},
            )
        fsync_file(built)
        digest = sha256_file(built)
        sif = self.sif_path(key)
        os.replace(built, sif)
        fsync_dir(sif.parent)
        return sif, digest, {}

    def convert(self, key: str) -> ImageResult:
        """Move the store's SIF of ``key`` to the CAS layout (its root stored file by file, the SIF
        removed), under the key's build lock; an image already in the CAS layout is left as it is."""
        sif = self.sif_path(key)
        meta = {**(self._read_json(self.meta_path(key)) or {}), "key": key}
        tid = (meta.get("task_ids") or [key])[0]
        lock = BuildLock(self.lock_path(key), stale_after=self.settings.stale_after_s, timeout=self.settings.build_timeout_s)
        lock.acquire()
        try:
            if not sif.exists():
                return self._from_store(tid, key)
            bad = self._changed_since_build(sif, meta)
            if bad:
                return ImageResult(task_id=tid, key=key, status="missing", reason=bad)
            tmp = sif.parent / f".tmp-{key}-{uuid.uuid4().hex[:12]}.sif"
            os.link(sif, tmp)  # _publish consumes its input's name, not the image's
            try:
                out, digest, extra = self._publish(key, tmp, layout="cas")
            finally:
                tmp.unlink(missing_ok=True)
            st = out.stat()
            rec = {**meta, **extra, "digest": digest, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}
            atomic_write_text(self.meta_path(key), json.dumps(rec, indent=1))
            sif.unlink()
            return self._from_store(tid, key)
        finally:
            lock.release()

    def ensure_many(
        self, tasks: Iterable[Buildable], *, jobs: int | None = None, progress: bool = True, retry_failed: bool = False, build: bool = True
    ) -> list[ImageResult]:
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


def _task_id(task: Buildable) -> str:
    return str(getattr(task, "id", None) or task)
