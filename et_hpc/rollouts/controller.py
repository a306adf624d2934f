"""``et-hpc run --continuous``: keep a run's work queue full and its workers running until told to stop.

The controller writes ``run.json``, starts the workers (one in-process with the local executor,
``continuous.workers`` array tasks with Slurm; all run :class:`~et_hpc.rollouts.worker.Worker`),
then every ``continuous.poll_s`` enqueues the next epoch when the queue runs low, sweeps the
queue and checks the stop conditions (stop file, SIGTERM/SIGINT, ``--target-groups``). On stop
the workers give their units back and its array tasks still there are cancelled. The queue
stays: the same command continues it, and a controller that dies loses nothing.
Specification: docs/rollouts.md ("The controller").
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from et_hpc.rollouts.queue import WorkQueue
from et_hpc.rollouts.worker import Worker, reap_interval
from et_hpc.runner.arrays import Array, ArraySpec
from et_hpc.runner.config import RunConfig
from et_hpc.runner.executors import get_executor
from et_hpc.runner.plan import save_run_json

if TYPE_CHECKING:
    from et_hpc.images.store import ImageResult
    from et_hpc.tasks.model import Task

log = logging.getLogger(__name__)


def prepare(cfg: RunConfig) -> tuple[dict[str, Task], dict[str, ImageResult], list[str]]:
    """Tasks by id, their images (UserError when one is missing), task load errors
    (``et_hpc.runner.plan.prepare_run``, as batch runs and the Atropos env prepare theirs)."""
    from et_hpc.runner.plan import prepare_run

    prep = prepare_run(cfg, missing="refuse")
    return prep.tasks, prep.images, prep.load_errors


def write_run_json(cfg: RunConfig, run_dir: Path, n_tasks: int, sandbox: dict[str, Any] | None = None) -> None:
    save_run_json(
        cfg,
        run_dir,
        {
            "continuous": True,
            "tasks": n_tasks,
            "samples": cfg.samples,
            "reward": cfg.reward,
            "units_total": 0,
            "sandbox": {**(sandbox or {}), "binds": list(cfg.sandbox.binds)},
        },
    )


def resolve_sandbox(cfg: RunConfig, images: dict[str, ImageResult]) -> tuple[RunConfig, dict[str, Any]]:
    """``sandbox.warm``/``local_copy`` "auto" chosen for a continuous run (et_hpc.runner.fastpath)."""
    from et_hpc.runner.fastpath import check_binds, choose, resolve

    check_binds(cfg)
    as_continuous = cfg.model_copy(update={"continuous": cfg.continuous.model_copy(update={"enabled": True})})
    choice = choose(as_continuous, [(tid, 0) for tid in images], images)
    return resolve(cfg, choice), choice


class Controller:
    def __init__(self, cfg: RunConfig, tasks: dict[str, Task], images: dict[str, ImageResult], *, progress: bool = True):
        self.cfg = cfg
        self.opts = cfg.continuous
        self.run_dir = cfg.run_dir()
        self.tasks, self.images = tasks, images
        self.queue = WorkQueue(self.run_dir, lease_s=self.opts.lease_s)
        self.progress = progress
        self.stop = threading.Event()
        self.workers: Array | None = None
        self._asked = -1e9  # when the executor was last asked whether the workers ended
        self.min_sample = 0  # new epochs' samples start above every stored one (set by run)

    def slots(self) -> int:
        per = self.cfg.node_concurrency()
        return per * (1 if get_executor(self.cfg.executor).in_process else self.opts.workers)

    def start_workers(self) -> None:
        """The workers as one array of the run's executor: one in this process (local), else
        ``continuous.workers`` array tasks, recorded in the run's jobs.json."""
        ex = get_executor(self.cfg.executor)
        n = 1 if ex.in_process else self.opts.workers
        spec = ArraySpec(
            folder=self.run_dir / "slurm",
            name=f"et-hpc-{self.cfg.run_name()}",
            slurm=self.cfg.slurm,
            what="worker array",
            run_dir=self.run_dir,
            record={"units": 0, "continuous": True},
        )
        self.workers = ex.submit_array([Worker(self.cfg, self.run_dir, self.tasks, self.images, i) for i in range(n)], spec)
        if not self.workers.in_process:
            arrays = ", ".join(getattr(self.workers, "array_ids", [])) or "none yet"
            waiting = getattr(self.workers, "waiting", "")  # beyond the site's submit limits: later
            print(f"submitted {n} continuous workers: array {arrays}" + (f"; {waiting}" if waiting else ""), file=sys.stderr, flush=True)

    def workers_ended(self, every_s: float = 0.0) -> bool:
        """True when no worker is left (an executor running them elsewhere is asked at most every ``every_s``)."""
        if self.workers is None:
            return True
        if self.workers.in_process:
            return self.workers.ended()
        now = time.monotonic()
        if now - self._asked < every_s:
            return False
        self._asked = now
        return self.workers.ended()

    def refill(self) -> None:
        low = self.opts.queue_low_water or max(2 * self.slots(), 2)
        if len(self.queue.pending_names()) < low:
            e = self.queue.enqueue_epoch(sorted(self.tasks), self.cfg.samples, self.cfg.tasks.seed, self.min_sample)
            log.info("epoch %d enqueued (%d units)", e, len(self.tasks))

    def run(self, target_groups: int | None = None) -> dict[str, Any]:
        from et_hpc.runner.local import stop_on_signals
        from et_hpc.runs.store import RunStore

        self.queue.init()
        self.queue.clear_stop()
        self.min_sample = max((s for _, s in RunStore(self.run_dir).units()), default=-1) + 1
        self.refill()
        self.start_workers()
        from et_hpc.sandbox.reaper import start_reaping

        # the sandboxes of Slurm workers on this node that died (SIGKILL, OOM) go within one lease
        # period (a local worker runs in this process and reaps for it)
        reaping = threading.Event()
        if self.workers is not None and not self.workers.in_process:
            start_reaping(reaping, reap_interval(self.opts.lease_s))
        t0 = time.monotonic()
        start_pub = self.queue.published()
        last_print = 0.0
        reason = None
        with stop_on_signals(self.stop):
            while True:
                try:
                    self.refill()
                    self.queue.sweep()
                except OSError as e:  # a shared filesystem hiccup: try again next round
                    log.warning("queue upkeep failed: %s", e)
                pub = self.queue.published()
                if target_groups and pub >= target_groups:
                    reason = f"target of {target_groups} groups reached"
                    self.queue.request_stop(reason)
                if self.stop.is_set():
                    reason = reason or "signal"
                    self.queue.request_stop(reason)
                if self.queue.stopped():
                    reason = self.queue.stop_reason() or reason
                    break
                if self.workers_ended(every_s=15.0):
                    reason = "every worker ended"
                    print(
                        "et-hpc: every worker ended before the run was told to stop: see "
                        f"{self.run_dir / 'slurm'} for their logs; rerun to continue the queue",
                        file=sys.stderr,
                    )
                    break
                if self.progress and time.monotonic() - last_print >= 10:
                    last_print = time.monotonic()
                    st = self.queue.status()
                    print(
                        f"[{time.monotonic() - t0:6.0f}s] groups {pub} (+{pub - start_pub}) pending "
                        f"{st['pending']} leased {st['leased']} workers {st['workers_live']} "
                        f"epochs {st['epochs']}",
                        file=sys.stderr,
                        flush=True,
                    )
                self.stop.wait(self.opts.poll_s)
            self.shutdown()
            reaping.set()
        info = self.queue.status()
        info.update(
            {
                "run_dir": str(self.run_dir),
                "stop_reason": reason,
                "groups_this_session": info["published"] - start_pub,
                "seconds": round(time.monotonic() - t0, 1),
            }
        )
        return info

    def shutdown(self) -> None:
        """Workers give their units back and exit; what is still there after the grace is cancelled."""
        if not self.queue.stopped():
            self.queue.request_stop("controller stopping")
        if self.workers is not None:
            # in process: told to stop, joined for the grace; elsewhere: waited for, then cancelled
            self.workers.stop(self.opts.stop_grace_s, poll_s=min(2.0, self.opts.poll_s))
        try:
            self.queue.sweep()
        except OSError:
            pass


def run_continuous(cfg: RunConfig, target_groups: int | None = None, progress: bool = True) -> dict[str, Any]:
    """Run ``cfg`` continuously (see the module docstring); returns the final queue status."""
    tasks, images, errors = prepare(cfg)
    for e in errors[:5]:
        print(f"et-hpc: warning: task skipped: {e}", file=sys.stderr)
    run_dir = cfg.run_dir()
    cfg, choice = resolve_sandbox(cfg, images)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_run_json(cfg, run_dir, len(tasks), choice)
    target = target_groups or cfg.continuous.target_groups
    print(
        f"continuous run {cfg.run_name()} in {run_dir}: {len(tasks)} tasks x {cfg.samples} samples per "
        f"group, {cfg.executor} executor" + (f", until {target} groups" if target else ""),
        file=sys.stderr,
        flush=True,
    )
    return Controller(cfg, tasks, images, progress=progress).run(target)
