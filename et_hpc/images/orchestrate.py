"""Building many tasks' images: on this node, or as a Slurm array that this process waits for.

``build_here`` and ``build_on_slurm`` return every task's ``ImageResult`` (in input order); what
they have to say while they work (the submission, a give-up) goes to ``notify`` as one line each,
and progress to ``on_progress``. Arrays are submitted through the caller's ``submit`` (an
executor's ``submit_array``), so this layer needs no executor of its own.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from et_hpc.errors import UserError
from et_hpc.host import slurm as host_slurm
from et_hpc.host.slurm import SlurmConfig
from et_hpc.images.slurm_build import BuildChunk
from et_hpc.images.store import ImageResult, ImageStore, default_jobs

if TYPE_CHECKING:
    from et_hpc.runner.arrays import Array
    from et_hpc.tasks.model import Task

log = logging.getLogger(__name__)

# submit(chunks, log folder, job name, Slurm settings) -> the array (an executor's submit_array, wrapped)
Submit = Callable[[list[BuildChunk], Path, str, SlurmConfig | None], "Array"]
Notify = Callable[[str], None]
OnProgress = Callable[[int, int, dict[str, int]], None]  # (images done, images to do, Slurm state counts)


@dataclass
class SlurmBuildRequest:
    """How to build as an array: one array task builds ``per_task`` images (default: enough to
    stay within 1000 array tasks); ``deadline_min`` defaults to walltime x waves + 10."""

    time_min: int = 60
    cpus: int = 2
    mem_gb: float | None = None
    partition: str | None = None
    array_parallelism: int = 32
    per_task: int | None = None
    deadline_min: float | None = None
    retry_failed: bool = False


def _quiet(line: str) -> None:
    log.info("%s", line)


def todo_of(store: ImageStore, tasks: Sequence[Task], retry_failed: bool) -> tuple[dict[str, ImageResult], list[Task]]:
    """(every task's current result, the tasks whose image needs a build)."""
    first = {t.id: store.lookup(t) for t in tasks}
    todo = [t for t in tasks if first[t.id].status == "missing" or (retry_failed and first[t.id].status == "failed")]
    return first, todo


def build_here(
    store: ImageStore, tasks: list[Task], submit: Submit, *, retry_failed: bool = False, jobs: int | None = None
) -> list[ImageResult]:
    """Every task's image built on this node, as one in-process task of the local executor."""
    chunk = BuildChunk(store.cache_dir, store.settings, store.base_map, tasks, retry_failed, jobs or default_jobs())
    chunk.progress, chunk.store = True, store
    arr = submit([chunk], store.cache_dir / "slurm", "build", None)
    try:
        arr.wait(poll_s=1.0)
    except KeyboardInterrupt:  # the builds got the signal too: let them end and the index be saved
        arr.stop(60.0)
        raise
    return [ImageResult(**d) for d in arr.result(0)]


def build_on_slurm(
    store: ImageStore,
    tasks: list[Task],
    req: SlurmBuildRequest,
    submit: Submit,
    *,
    notify: Notify = _quiet,
    on_progress: OnProgress | None = None,
) -> list[ImageResult]:
    """Build the tasks that need it as a Slurm array, wait for it, and collect every result."""
    if req.cpus < 1 or req.array_parallelism < 1:
        raise UserError("--cpus and --array-parallelism must be 1 or more")
    # Only tasks that need work go to Slurm; the rest are answered from the cache now.
    first, todo = todo_of(store, tasks, req.retry_failed)
    if not todo:
        return [first[t.id] for t in tasks]
    per = req.per_task or max(1, math.ceil(len(todo) / 1000))
    chunks = [todo[i : i + per] for i in range(0, len(todo), per)]
    slurm_cfg = SlurmConfig(
        partition=req.partition, time_min=req.time_min, cpus_per_task=req.cpus, mem_gb=req.mem_gb, array_parallelism=req.array_parallelism
    )
    jobs_per_node = max(1, req.cpus // 2)
    arr = submit(
        [BuildChunk(store.cache_dir, store.settings, store.base_map, c, req.retry_failed, jobs_per_node) for c in chunks],
        store.cache_dir / "slurm",
        "et-hpc-build",
        slurm_cfg,
    )
    # arr.ids are updated in place as the rest is submitted (within the site's submit limits)
    waiting = getattr(arr, "waiting", "")
    notify(
        f"submitted Slurm array {', '.join(getattr(arr, 'array_ids', [])) or '(none yet)'}: {len(chunks)} array tasks for "
        f"{len(todo)} images (logs in {store.cache_dir / 'slurm'})" + (f"; {waiting}" if waiting else "")
    )
    waves = math.ceil(len(chunks) / req.array_parallelism)
    deadline_s = 60 * (req.deadline_min if req.deadline_min else req.time_min * waves + 10)
    last = [0.0]

    def on_poll(states: dict[str, str]) -> None:
        now = time.monotonic()
        if on_progress is None or (now - last[0] < 10 and not all(host_slurm.ended(s) for s in states.values())):
            return
        last[0] = now
        done = sum(1 for t in todo if store.lookup(t).status in ("cached", "failed"))
        on_progress(done, len(todo), host_slurm.counts(states))

    try:
        states, all_ended = arr.wait(poll_s=3.0, timeout_s=deadline_s, on_poll=on_poll)
    except KeyboardInterrupt:
        notify(f"stopped waiting; the array keeps running (scancel {' '.join(getattr(arr, 'array_ids', []))} to stop it)")
        raise
    by_id: dict[str, ImageResult] = {}
    for i, chunk in enumerate(chunks):
        by_id.update(collect(store, arr, i, chunk, states.get(arr.ids[i], host_slurm.UNKNOWN)))
    if not all_ended:
        notify(f"gave up waiting after {deadline_s / 60:.0f} min (--deadline); the array keeps running")
    return [by_id.get(t.id) or first[t.id] for t in tasks]


def collect(store: ImageStore, arr: Array, i: int, chunk: Sequence[Task], st: str) -> dict[str, ImageResult]:
    """The results of array task ``i`` (in state ``st``): what it returned, else what the cache says."""
    tid = arr.ids[i]
    got: list[dict[str, Any]] | None = None
    if host_slurm.ended(st):
        try:
            got = arr.result(i)
        except Exception as e:  # killed, timed out, or crashed: the cache tells what got built
            log.info("array task %s: %s", tid, str(e).strip().splitlines()[-1:] or e)
    out: dict[str, ImageResult] = {}
    if got:
        for d in got:
            r = ImageResult(**d)
            if r.status == "failed" and st not in host_slurm.DONE:
                r.reason = f"{r.reason} (Slurm array task {tid} ended {st})"
            out[r.task_id] = r
        return out
    for t in chunk:
        r = store.lookup(t)
        if r.status == "missing":
            why = (
                f"Slurm array task {tid} ended {st} before building it (log: {arr.log_path(i)})"
                if host_slurm.ended(st)
                else f"still building in Slurm array task {tid} ({st}) when the wait ended; rerun to collect"
            )
            r = r.model_copy(update={"status": "failed", "reason": why})
        out[t.id] = r
    return out
