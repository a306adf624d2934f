"""The Slurm executor: units in chunks, chunks as submitit array tasks, arrays split at MaxArraySize.

Each array task is a :class:`ChunkJob`: it reaps stale sandboxes, skips units already ok in the
store (a requeued task never redoes finished work) and runs the rest with local concurrency; on
preemption or timeout it requeues itself. Submissions are saved in ``<run_dir>/jobs.json``.
The array is submitted in chunks within the site's limits (``et_hpc.runner.arrays.SlurmArray``),
so a run larger than MaxSubmitJobs completes; only ``--detach`` (nothing stays to submit the rest)
refuses such a run, in one line naming the ``slurm.units_per_task`` that fits.
Specification: docs/runner.md ("The Slurm executor").
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from submitit.helpers import Checkpointable, DelayedSubmission

from et_hpc.errors import UserError
from et_hpc.host import slurm as host_slurm
from et_hpc.host.slurm import SlurmConfig, submitit_executor
from et_hpc.host.slurm_limits import SUBMIT_LIMIT_RE, SubmitLimits, check_fits, parse_sacctmgr  # noqa: F401
from et_hpc.host.slurm_limits import submit_limits as _submit_limits
from et_hpc.runner.arrays import ArraySpec, SlurmArray, SubmitDeferred
from et_hpc.runner.base import Notify, Outcome, Progress
from et_hpc.runner.config import RunConfig
from et_hpc.runner.local import ExecResult, UnitPool, WorkItem, resolve_runner, stop_on_signals, work_items
from et_hpc.runner.plan import OK, GroupTags, Plan, open_store
from et_hpc.runs.store import RunStore
from et_hpc.text import configure_logging
from et_hpc.util import atomic_write_text

log = logging.getLogger(__name__)
T = TypeVar("T")
CHECKPOINT_GRACE_S = 60.0
REAP_EVERY_S = 30.0  # an array task reaps dead workers' sandboxes on its node this often


class ChunkJob(Checkpointable):
    """One array task: run a chunk of units, skipping those the store already has."""

    def __init__(self, cfg: RunConfig, run_dir: Path, items: list[WorkItem], ready_at: float | None = None, tags: GroupTags | None = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.items = items
        self.tags = tags  # the invocation's groups (Plan.group_tags)
        self.ready_at = ready_at  # the plan's time: queue_s includes the wait in Slurm's queue
        self._pool: UnitPool | None = None

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["_pool"] = None
        return d

    def todo(self, store: RunStore) -> list[WorkItem]:
        done = store.units()
        keep = []
        for task, sample, image in self.items:
            st = done.get((task.id, sample))
            if st == OK or (st is not None and not self.cfg.retry_errors):
                continue
            keep.append((task, sample, image))
        return keep

    def __call__(self) -> dict[str, Any]:
        from et_hpc.sandbox.reaper import reap_dead, start_reaping

        configure_logging(logging.INFO)
        reap_dead()
        reaping = threading.Event()
        start_reaping(reaping, REAP_EVERY_S)  # sandboxes of workers on this node that die meanwhile
        store = open_store(self.run_dir)
        items = self.todo(store)
        log.info("chunk of %d units, %d to run", len(self.items), len(items))
        stop = threading.Event()
        self._pool = UnitPool(
            items,
            resolve_runner(self.cfg.unit_runner),
            self.cfg,
            store,
            self.cfg.node_concurrency(),
            stop,
            ready_at=self.ready_at,
            tags=self.tags,
        )
        try:
            with stop_on_signals(stop, (signal.SIGTERM,)):
                res = self._pool.run()
        finally:
            reaping.set()
        log.info("chunk finished: %s", res)
        return _result_dict(res, len(self.items))

    def checkpoint(self, *args: Any, **kwargs: Any) -> DelayedSubmission:
        pool = self._pool
        if pool is not None:
            log.warning("checkpoint: interrupting running episodes before requeue")
            pool.stop.set()
            if not pool.join(CHECKPOINT_GRACE_S):
                log.warning("episodes still running after %.0f s; requeueing anyway", CHECKPOINT_GRACE_S)
        return DelayedSubmission(ChunkJob(self.cfg, self.run_dir, self.items, self.ready_at, self.tags))


def _result_dict(r: ExecResult, n: int) -> dict[str, Any]:
    return {
        "units": n,
        "started": r.started,
        "ok": r.ok,
        "errors": r.errors,
        "passed": r.passed,
        "crashed": r.crashed,
        "dropped": r.dropped,
        "interrupted": r.interrupted,
    }


def submit_limits(cfg: RunConfig | SlurmConfig, *, own: int = 0) -> SubmitLimits:
    """What Slurm accepts now for a run config's (or a ``slurm`` block's) arrays: ``et_hpc.host.slurm_limits``."""
    return _submit_limits(cfg.slurm if isinstance(cfg, RunConfig) else cfg, own=own)


KEY_ENV = "ET_HPC_POLICY_API_KEY"


def key_by_reference(cfg: RunConfig) -> RunConfig:
    """A config whose policy key travels to the array tasks in the job's environment, not in a file.

    sbatch exports the submitting environment (``--export=ALL``, Slurm's default), so the key given
    as ``policy.api_key`` is put in ``$ET_HPC_POLICY_API_KEY`` here and the pickled config names only
    that variable (``PolicyConfig`` pickles without its key anyway).
    """
    key = cfg.policy.key_value()
    if not key:
        return cfg
    os.environ[KEY_ENV] = key
    return cfg.model_copy(update={"policy": cfg.policy.model_copy(update={"api_key": None, "api_key_env": KEY_ENV})})


def chunked(seq: list[T], n: int) -> list[list[T]]:
    return [seq[i : i + n] for i in range(0, len(seq), n)]


def _limit_refusal(msg: str) -> bool:
    return bool(SUBMIT_LIMIT_RE.search(msg))


def submit_array(tasks: Sequence[Callable[[], Any]], spec: ArraySpec) -> SlurmArray:
    """Submit ``tasks`` as submitit arrays in chunks that fit the site's limits, the rest as queued
    ones end (``SlurmArray``); sbatch refusing for another reason: one-line ``UserError``. With
    ``spec.run_dir``, each chunk is appended to that run's ``jobs.json`` (one attempt for all)."""
    ex = submitit_executor(spec.slurm, spec.folder / "%j", spec.name)
    attempt = spec.record.get("attempt") or (next_attempt(load_jobs(spec.run_dir)) if spec.run_dir is not None else 0)

    def submit_chunk(chunk: list[Any], first: int) -> list[Any]:
        try:
            jobs = ex.submit_array(chunk)
        except UserError:
            raise
        except Exception as e:  # sbatch refused (bad partition, limits): say why, in one line
            msg = str(e).strip().splitlines()
            line = next((m for m in reversed(msg) if "error" in m.lower()), msg[-1] if msg else str(e))
            if _limit_refusal(str(e)):
                raise SubmitDeferred(f"sbatch refused: {line}") from None
            raise UserError(f"sbatch refused the {spec.what}: {line}") from None
        if spec.run_dir is not None:
            _record(spec, attempt, [str(j.job_id) for j in jobs], first)
        return jobs

    return SlurmArray(tasks, spec, submit_chunk, lambda own: _submit_limits(spec.slurm, own=own))


def _record(spec: ArraySpec, attempt: int, ids: list[str], first: int) -> None:
    """Append one submitted chunk to ``<run_dir>/jobs.json`` (after each chunk: a failure later
    keeps the earlier ids)."""
    assert spec.run_dir is not None
    extra = {k: v for k, v in spec.record.items() if k != "attempt"}
    if spec.task_units is not None:
        extra["units"] = sum(spec.task_units[first : first + len(ids)])
    jobs_file = load_jobs(spec.run_dir)
    jobs_file["submissions"].append(
        {
            "attempt": attempt,
            "array_id": ids[0].split("_")[0],
            "tasks": len(ids),
            "job_ids": ids,
            **extra,
            "submitted_at": time.time(),
            "folder": str(spec.folder),
        }
    )
    save_jobs(spec.run_dir, jobs_file)


def next_attempt(jobs_file: dict[str, Any]) -> int:
    return 1 + max((s["attempt"] for s in jobs_file["submissions"]), default=0)


def submit_plan(plan: Plan, *, detach: bool = False) -> SlurmArray:
    """Submit the plan's units in chunks of ``slurm.units_per_task`` as one paced ``SlurmArray``;
    ``detach`` (nothing waits to submit the rest): refused unless every task fits now."""
    cfg, run_dir = plan.cfg, plan.run_dir
    chunks = chunked(work_items(plan, plan.units), cfg.slurm.units_per_task)
    if detach and chunks:
        limits = submit_limits(cfg)
        limits.add(cfg.slurm.max_submits_per_min, 0, "slurm.max_submits_per_min")
        check_fits(len(plan.units), cfg.slurm.units_per_task, limits, detach=True)
    cfg = key_by_reference(cfg)
    spec = ArraySpec(
        folder=run_dir / "slurm",
        name=f"et-hpc-{cfg.run_name()}",
        slurm=cfg.slurm,
        run_dir=run_dir,
        record={"attempt": next_attempt(load_jobs(run_dir))},
        task_units=[len(c) for c in chunks],
    )
    tags = plan.group_tags()  # the invocation's groups, one per task
    return submit_array([ChunkJob(cfg, run_dir, c, plan.planned_at, tags) for c in chunks], spec)


def submit(plan: Plan) -> list[dict[str, Any]]:
    """Submit every unit of the plan now (refused when it does not fit); returns the submissions."""
    if not plan.units:
        return []
    submit_plan(plan, detach=True)
    return latest_submissions(plan.run_dir)


def task_ids(subs: list[dict[str, Any]]) -> list[str]:
    """Slurm ids of every array task of ``subs`` (``"<array>_<i>"``, or ``"<job>"`` for one task)."""
    out: list[str] = []
    for s in subs:
        out += s.get("job_ids") or [f"{s['array_id']}_{i}" for i in range(s["tasks"])]
    return out


def load_jobs(run_dir: Path) -> dict[str, Any]:
    p = Path(run_dir) / "jobs.json"
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        return {"submissions": []}
    except ValueError:
        log.warning("%s is unreadable; starting a new list", p)
        return {"submissions": []}


def save_jobs(run_dir: Path, data: dict[str, Any]) -> None:
    atomic_write_text(Path(run_dir) / "jobs.json", json.dumps(data, indent=2) + "\n")


def latest_submissions(run_dir: Path) -> list[dict[str, Any]]:
    subs = load_jobs(run_dir)["submissions"]
    if not subs:
        return []
    last = max(s["attempt"] for s in subs)
    return [s for s in subs if s["attempt"] == last]


def live_tasks(run_dir: Path) -> list[str]:
    """Array tasks of the run's latest submission that Slurm still has queued or running."""
    subs = latest_submissions(run_dir)
    if not subs:
        return []
    return sorted(
        t for t, s in host_slurm.task_states(task_ids(subs)).items() if host_slurm.category(s) in ("queued", "running")
    )  # unknown (no answer from Slurm): go on


def refuse_if_jobs_live(plan: Plan) -> None:
    """Two executors on the same units would run them twice: wait for the earlier arrays first."""
    live = live_tasks(plan.run_dir)
    if live:
        ids = ",".join(sorted({t.split("_")[0] for t in live}))
        raise UserError(
            f"{len(live)} array task(s) of run {plan.cfg.run_name()} are still queued or running "
            f"(job {ids}): wait for them ('et-hpc status {plan.run_dir}') or cancel them "
            f"('scancel {ids.replace(',', ' ')}'), then rerun"
        )


class SlurmExecutor:
    """Submits the plan as arrays (``submit``), then waits for them unless ``detach``."""

    name = "slurm"
    in_process = False  # its arrays' tasks run in this process

    def submit_array(self, tasks: Sequence[Callable[[], Any]], spec: ArraySpec) -> SlurmArray:
        return submit_array(tasks, spec)

    def run(
        self, plan: Plan, store: RunStore, *, detach: bool = False, notify: Notify | None = None, progress: Progress | None = None
    ) -> Outcome:
        notify = notify or log.info
        cfg = plan.cfg
        arr = submit_plan(plan, detach=detach)
        notify(_submitted_line(plan.run_dir, arr))
        if detach:
            return Outcome(detached=True, settled=False, submissions=latest_submissions(plan.run_dir))
        todo = set(plan.units)
        said = {"waiting": arr.waiting}

        def on_poll(states: dict[str, str]) -> None:
            if arr.waiting and arr.waiting != said["waiting"] and arr.sent > 0:
                notify(f"submitted {arr.sent} of {len(arr.ids)} array tasks so far")
            said["waiting"] = arr.waiting
            if progress is not None:
                done = store.units()
                progress(sum(1 for u in todo if u in done), host_slurm.counts(states))

        timeout = cfg.slurm.wait_timeout_min * 60 if cfg.slurm.wait_timeout_min else None
        states, all_ended = arr.wait(poll_s=cfg.slurm.poll_s, timeout_s=timeout, on_poll=on_poll)
        subs = latest_submissions(plan.run_dir)
        failed = {t: states[t] for t in sorted(states) if host_slurm.category(states[t]) == "failed"}
        if failed:
            shown = ", ".join(f"{t} {s}" for t, s in list(failed.items())[:8])
            notify(f"{len(failed)} array task(s) ended without completing: {shown}")
        if not all_ended:
            left = f" ({arr.waiting}; they are not submitted now: rerun to do their units)" if arr.waiting else ""
            notify(f"stopped watching after {cfg.slurm.wait_timeout_min} min; jobs keep running{left}: et-hpc status {plan.run_dir}")
            return Outcome(rc=3, settled=False, submissions=subs, failed_tasks=failed)
        return Outcome(submissions=subs, failed_tasks=failed)


def _submitted_line(run_dir: Path, arr: SlurmArray) -> str:
    subs = latest_submissions(run_dir) if arr.sent else []
    ids = ", ".join(f"{s['array_id']} ({s['tasks']} tasks, {s.get('units', 0)} units)" for s in subs)
    line = f"submitted array job(s): {ids}" if ids else "nothing submitted yet"
    return f"{line}; {arr.waiting} (the rest follow as queued jobs end)" if arr.waiting else line
