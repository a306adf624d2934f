"""The Slurm executor: units in chunks, chunks as submitit array tasks, arrays split at MaxArraySize.

Each array task is a :class:`ChunkJob`: it reaps stale sandboxes, skips units already ok in the
store (a requeued task never redoes finished work) and runs the rest with local concurrency; on
preemption or timeout it requeues itself. Submissions are saved in ``<run_dir>/jobs.json``.
:func:`submit_limits` asks Slurm how many more array tasks it accepts: a run that needs more is
refused in one line naming the ``slurm.units_per_task`` that fits.
Specification: docs/runner.md ("The Slurm executor").
"""

from __future__ import annotations

import getpass
import json
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from submitit.helpers import Checkpointable, DelayedSubmission

from et_hpc.errors import UserError
from et_hpc.host import slurm as host_slurm
from et_hpc.host.slurm import submitit_executor
from et_hpc.runner.arrays import ArraySpec, SlurmArray
from et_hpc.runner.base import Notify, Outcome, Progress
from et_hpc.runner.config import RunConfig
from et_hpc.runner.local import ExecResult, UnitPool, WorkItem, resolve_runner, stop_on_signals, work_items
from et_hpc.runner.plan import OK, Plan, open_store
from et_hpc.runs.store import RunStore
from et_hpc.text import configure_logging
from et_hpc.util import atomic_write_text

log = logging.getLogger(__name__)
T = TypeVar("T")
CHECKPOINT_GRACE_S = 60.0
REAP_EVERY_S = 30.0  # an array task reaps dead workers' sandboxes on its node this often


class ChunkJob(Checkpointable):
    """One array task: run a chunk of units, skipping those the store already has."""

    def __init__(self, cfg: RunConfig, run_dir: Path, items: list[WorkItem], ready_at: float | None = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.items = items
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
            items, resolve_runner(self.cfg.unit_runner), self.cfg, store, self.cfg.node_concurrency(), stop, ready_at=self.ready_at
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
        return DelayedSubmission(ChunkJob(self.cfg, self.run_dir, self.items, self.ready_at))


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


DEFAULT_MAX_ARRAY_SIZE = 1001  # Slurm's defaults, when scontrol does not answer
DEFAULT_MAX_JOB_COUNT = 10000


def parse_sacctmgr(text: str, fields: list[str]) -> list[dict[str, str]]:
    """Rows of ``sacctmgr -n -P show ... format=<fields>`` as dicts (empty string: no limit)."""
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = line.split("|")
        rows.append({f: (cells[i].strip() if i < len(cells) else "") for i, f in enumerate(fields)})
    return rows


def _int(v: Any) -> int | None:
    try:
        return int(str(v).strip())
    except (TypeError, ValueError):
        return None


def max_array_size() -> int:
    """Slurm's MaxArraySize (an array holds indices 0..MaxArraySize-1)."""
    return _int(host_slurm.scontrol_config().get("MaxArraySize")) or DEFAULT_MAX_ARRAY_SIZE


def _count_jobs(*filters: str) -> int | None:
    """Jobs in the queue matching squeue ``filters``, each array task counted (as Slurm does)."""
    out = host_slurm.query(["squeue", "-h", "-r", "-o", "%i", *filters])
    return None if out is None else len([ln for ln in out.splitlines() if ln.strip()])


@dataclass
class SubmitLimits:
    """How many array tasks Slurm accepts now, and why (the tightest limit)."""

    max_array_size: int
    free: int | None = None  # array tasks that may still be queued; None: no limit known
    why: str = ""  # the binding limit, e.g. "MaxJobCount=10000, 9990 jobs queued"
    limits: list[tuple[int, str]] = field(default_factory=list)  # (free, description) of each limit

    def add(self, limit: int | None, queued: int | None, name: str) -> None:
        if limit is None:
            return
        q = queued or 0
        self.limits.append((limit - q, f"{name}={limit}" + (f", {q} jobs queued" if q else "")))
        self.free, self.why = min(self.limits)


def submit_limits(cfg: RunConfig) -> SubmitLimits:
    """Query Slurm for the limits on how many array tasks this run may queue (see module doc)."""
    s = cfg.slurm
    conf = host_slurm.scontrol_config()
    real_size = _int(conf.get("MaxArraySize")) or DEFAULT_MAX_ARRAY_SIZE
    lim = SubmitLimits(max_array_size=min(s.max_array_size, real_size) if s.max_array_size else real_size)
    if s.max_submit_jobs:
        lim.add(s.max_submit_jobs, 0, "slurm.max_submit_jobs")
    if not conf:  # Slurm does not answer: sbatch will say why
        return lim
    user = getpass.getuser()
    lim.add(_int(conf.get("MaxJobCount")) or DEFAULT_MAX_JOB_COUNT, _count_jobs(), "MaxJobCount")
    mine: int | None = None
    account, qos = s.account, s.qos
    users = parse_sacctmgr(
        host_slurm.query(["sacctmgr", "-n", "-P", "show", "user", user, "format=User,DefaultAccount"]) or "", ["user", "account"]
    )
    account = account or (users[0]["account"] if users else None)
    if account:
        fields = ["account", "user", "partition", "max_submit", "grp_submit", "default_qos"]
        out = (
            host_slurm.query(
                [
                    "sacctmgr",
                    "-n",
                    "-P",
                    "show",
                    "assoc",
                    "where",
                    f"user={user}",
                    f"account={account}",
                    "format=Account,User,Partition,MaxSubmit,GrpSubmit,DefaultQOS",
                ]
            )
            or ""
        )
        for r in parse_sacctmgr(out, fields):
            if r["user"] != user or r["partition"] not in ("", s.partition or ""):
                continue
            if _int(r["max_submit"]) is not None or _int(r["grp_submit"]) is not None:
                mine = _count_jobs("-u", user) if mine is None else mine
            lim.add(_int(r["max_submit"]), mine, f"MaxSubmitJobs of association {account}/{user}")
            lim.add(_int(r["grp_submit"]), mine, f"GrpSubmitJobs of association {account}/{user}")
            qos = qos or r["default_qos"] or None
    qos = qos or ("normal" if account else None)
    if qos:
        fields = ["name", "max_submit_pu", "max_submit_pa", "grp_submit"]
        out = host_slurm.query(["sacctmgr", "-n", "-P", "show", "qos", qos, "format=Name,MaxSubmitPU,MaxSubmitPA,GrpSubmit"]) or ""
        for r in parse_sacctmgr(out, fields):
            if r["name"] != qos:
                continue
            if _int(r["max_submit_pu"]) is not None:
                mine = _count_jobs("-u", user) if mine is None else mine
                lim.add(_int(r["max_submit_pu"]), mine, f"MaxSubmitPU of QOS {qos}")
            if _int(r["max_submit_pa"]) is not None and account:
                lim.add(_int(r["max_submit_pa"]), _count_jobs("-A", account), f"MaxSubmitPA of QOS {qos}")
            if _int(r["grp_submit"]) is not None:
                lim.add(_int(r["grp_submit"]), _count_jobs("-q", qos), f"GrpSubmitJobs of QOS {qos}")
    return lim


def check_fits(n_units: int, units_per_task: int, limits: SubmitLimits) -> int:
    """Array tasks the units need; ``UserError`` naming the units_per_task that fits when too many."""
    n_tasks = math.ceil(n_units / units_per_task)
    if limits.free is None or n_tasks <= limits.free:
        return n_tasks
    if limits.free <= 0:
        raise UserError(f"Slurm accepts no more jobs now ({limits.why}): wait for queued jobs to end ('squeue --me'), then rerun")
    fit = math.ceil(n_units / limits.free)
    raise UserError(
        f"{n_units} units at slurm.units_per_task={units_per_task} need {n_tasks} array tasks but "
        f"Slurm accepts {limits.free} more ({limits.why}): rerun with "
        f"--set slurm.units_per_task={fit}"
    )


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


def submit_array(tasks: Sequence[Callable[[], Any]], spec: ArraySpec) -> SlurmArray:
    """Submit ``tasks`` as one submitit array (sbatch refusing it: one-line ``UserError``); with
    ``spec.run_dir``, append the submission to that run's ``jobs.json``."""
    ex = submitit_executor(spec.slurm, spec.folder / "%j", spec.name)
    try:
        arr = SlurmArray(ex.submit_array(list(tasks)))
    except UserError:
        raise
    except Exception as e:  # sbatch refused (bad partition, limits): say why, in one line
        msg = str(e).strip().splitlines()
        raise UserError(f"sbatch refused the {spec.what}: {msg[-1] if msg else e}") from None
    if spec.run_dir is not None:
        jobs_file = load_jobs(spec.run_dir)
        attempt = spec.record.get("attempt") or next_attempt(jobs_file)
        jobs_file["submissions"].append(
            {
                "attempt": attempt,
                "array_id": arr.array_id,
                "tasks": len(arr.ids),
                "job_ids": arr.ids,
                **{k: v for k, v in spec.record.items() if k != "attempt"},
                "submitted_at": time.time(),
                "folder": str(spec.folder),
            }
        )
        save_jobs(spec.run_dir, jobs_file)  # after each array, so a failure later keeps the earlier ids
    return arr


def next_attempt(jobs_file: dict[str, Any]) -> int:
    return 1 + max((s["attempt"] for s in jobs_file["submissions"]), default=0)


def submit(plan: Plan) -> list[dict[str, Any]]:
    """Submit the plan's units as one or more arrays; returns (and saves) the submissions."""
    cfg, run_dir = plan.cfg, plan.run_dir
    chunks = chunked(work_items(plan, plan.units), cfg.slurm.units_per_task)
    if not chunks:
        return []
    limits = submit_limits(cfg)
    check_fits(len(plan.units), cfg.slurm.units_per_task, limits)
    cfg = key_by_reference(cfg)
    attempt = next_attempt(load_jobs(run_dir))
    for group in chunked(chunks, limits.max_array_size):
        spec = ArraySpec(
            folder=run_dir / "slurm",
            name=f"et-hpc-{cfg.run_name()}",
            slurm=cfg.slurm,
            run_dir=run_dir,
            record={"attempt": attempt, "units": sum(len(c) for c in group)},
        )
        submit_array([ChunkJob(cfg, run_dir, c, plan.planned_at) for c in group], spec)
    return [s for s in load_jobs(run_dir)["submissions"] if s["attempt"] == attempt]


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
        subs = submit(plan)
        ids = ", ".join(f"{s['array_id']} ({s['tasks']} tasks, {s['units']} units)" for s in subs)
        notify(f"submitted array job(s): {ids}")
        if detach:
            return Outcome(detached=True, settled=False, submissions=subs)
        todo = set(plan.units)

        def on_poll(states: dict[str, str]) -> None:
            if progress is not None:
                done = store.units()
                progress(sum(1 for u in todo if u in done), host_slurm.counts(states))

        timeout = cfg.slurm.wait_timeout_min * 60 if cfg.slurm.wait_timeout_min else None
        states, all_ended = host_slurm.wait_tasks(task_ids(subs), poll_s=cfg.slurm.poll_s, timeout_s=timeout, on_poll=on_poll)
        failed = {t: states[t] for t in sorted(states) if host_slurm.category(states[t]) == "failed"}
        if failed:
            shown = ", ".join(f"{t} {s}" for t, s in list(failed.items())[:8])
            notify(f"{len(failed)} array task(s) ended without completing: {shown}")
        if not all_ended:
            notify(f"stopped watching after {cfg.slurm.wait_timeout_min} min; jobs keep running: et-hpc status {plan.run_dir}")
            return Outcome(rc=3, settled=False, submissions=subs, failed_tasks=failed)
        return Outcome(submissions=subs, failed_tasks=failed)
