"""The Slurm executor: units in chunks, chunks as submitit array tasks, arrays split at MaxArraySize.

Each array task is a :class:`ChunkJob`: it reaps stale sandboxes, skips units already ok in the
store (so a requeued or rerun task never redoes finished work), and runs the rest with local
concurrency. On preemption or timeout submitit calls ``checkpoint()``, which interrupts running
episodes and requeues the same chunk. Submissions are saved in ``<run_dir>/jobs.json``.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from submitit.helpers import Checkpointable, DelayedSubmission

from et_hpc.errors import UserError
from et_hpc.runner.config import RunConfig
from et_hpc.runner.local import ExecResult, UnitPool, WorkItem, resolve_runner, stop_on_signals, work_items
from et_hpc.runner.plan import OK, Plan, open_store
from et_hpc.util import atomic_write_text

log = logging.getLogger(__name__)
CHECKPOINT_GRACE_S = 60.0


def _reap() -> None:
    from et_hpc.sandbox.reaper import reap

    try:
        reap()
    except Exception:  # a failed sweep must not lose the array task
        log.exception("sandbox reaper failed")


class ChunkJob(Checkpointable):
    """One array task: run a chunk of units, skipping those the store already has."""

    def __init__(self, cfg: RunConfig, run_dir: Path, items: list[WorkItem]):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.items = items
        self._pool: UnitPool | None = None

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["_pool"] = None
        return d

    def todo(self, store: Any) -> list[WorkItem]:
        done = store.units()
        keep = []
        for task, sample, image in self.items:
            st = done.get((task.id, sample))
            if st == OK or (st is not None and not self.cfg.retry_errors):
                continue
            keep.append((task, sample, image))
        return keep

    def __call__(self) -> dict[str, Any]:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        _reap()
        store = open_store(self.run_dir)
        items = self.todo(store)
        log.info("chunk of %d units, %d to run", len(self.items), len(items))
        stop = threading.Event()
        self._pool = UnitPool(items, resolve_runner(self.cfg.unit_runner), self.cfg, store,
                              self.cfg.node_concurrency(), stop)
        with stop_on_signals(stop, (signal_term(),)):
            res = self._pool.run()
        log.info("chunk finished: %s", res)
        return _result_dict(res, len(self.items))

    def checkpoint(self, *args: Any, **kwargs: Any) -> DelayedSubmission:
        pool = self._pool
        if pool is not None:
            log.warning("checkpoint: interrupting running episodes before requeue")
            pool.stop.set()
            if not pool.join(CHECKPOINT_GRACE_S):
                log.warning("episodes still running after %.0f s; requeueing anyway", CHECKPOINT_GRACE_S)
        return DelayedSubmission(ChunkJob(self.cfg, self.run_dir, self.items))


def signal_term() -> int:
    import signal

    return signal.SIGTERM


def _result_dict(r: ExecResult, n: int) -> dict[str, Any]:
    return {"units": n, "started": r.started, "ok": r.ok, "errors": r.errors, "passed": r.passed,
            "crashed": r.crashed, "dropped": r.dropped, "interrupted": r.interrupted}


def max_array_size() -> int:
    """Slurm's MaxArraySize (an array holds indices 0..MaxArraySize-1)."""
    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    m = re.search(r"^MaxArraySize\s*=\s*(\d+)", out, re.M)
    return int(m.group(1)) if m else 1001


def make_executor(cfg: RunConfig, run_dir: Path) -> Any:
    import submitit

    s = cfg.slurm
    ex = submitit.AutoExecutor(folder=str(run_dir / "slurm" / "%j"), cluster="slurm",
                               slurm_max_num_timeout=s.max_num_timeout,
                               slurm_python=s.python or sys.executable)
    params: dict[str, Any] = {
        "name": f"et-hpc-{cfg.run_name()}",
        "timeout_min": s.time_min,
        "cpus_per_task": s.cpus_per_task,
        "slurm_array_parallelism": s.array_parallelism,
        "slurm_wckey": "",
    }
    if s.mem_gb is not None:
        params["mem_gb"] = s.mem_gb
    for key in ("partition", "account", "qos"):
        if getattr(s, key):
            params[f"slurm_{key}"] = getattr(s, key)
    if s.setup:
        params["slurm_setup"] = list(s.setup)
    if s.additional_parameters:
        params["slurm_additional_parameters"] = dict(s.additional_parameters)
    try:
        ex.update_parameters(**params)
    except (ValueError, TypeError) as e:
        raise UserError(f"slurm settings rejected: {e}") from None
    return ex


def chunked(seq: list[Any], n: int) -> list[list[Any]]:
    return [seq[i:i + n] for i in range(0, len(seq), n)]


def submit(plan: Plan) -> list[dict[str, Any]]:
    """Submit the plan's units as one or more arrays; returns (and saves) the submissions."""
    cfg, run_dir = plan.cfg, plan.run_dir
    chunks = chunked(work_items(plan, plan.units), cfg.slurm.units_per_task)
    if not chunks:
        return []
    per_array = cfg.slurm.max_array_size or max_array_size()
    ex = make_executor(cfg, run_dir)
    jobs_file = load_jobs(run_dir)
    attempt = 1 + max((s["attempt"] for s in jobs_file["submissions"]), default=0)
    subs = []
    for group in chunked(chunks, per_array):
        try:
            jobs = ex.submit_array([ChunkJob(cfg, run_dir, c) for c in group])
        except Exception as e:  # sbatch refused: say why, in one line
            msg = str(e).strip().splitlines()
            raise UserError(f"sbatch refused the array: {msg[-1] if msg else e}") from None
        array_id = str(jobs[0].job_id).split("_")[0]
        subs.append({"attempt": attempt, "array_id": array_id, "tasks": len(group),
                     "job_ids": [str(j.job_id) for j in jobs],  # a one-task array is a plain job
                     "units": sum(len(c) for c in group), "submitted_at": time.time(),
                     "folder": str(run_dir / "slurm")})
        jobs_file["submissions"].append(subs[-1])
        save_jobs(run_dir, jobs_file)  # after each array, so a failure later keeps the earlier ids
    return subs


def task_ids(subs: list[dict[str, Any]]) -> list[str]:
    """Slurm ids of every array task of ``subs`` (``"<array>_<i>"``, or ``"<job>"`` for one task)."""
    out = []
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
