"""The long-lived worker of a continuous run: claim units, run their episodes, commit groups.

A ``Worker`` runs ``concurrency`` slots; each claims one unit (one group) from the
:class:`~et_hpc.rollouts.queue.WorkQueue`, stamps it with the current policy version, runs its
episodes (rerunning error statuses up to ``continuous.retries`` times) and commits the group.
Only whole groups are committed: a unit whose lease is gone, whose run is stopping, or (with
``on_version_change: abandon``) whose version fell more than ``max_staleness`` behind is
interrupted, its episodes dropped, and it is done again from its start. On Slurm it is a
submitit array task: SIGTERM gives its units back, ``checkpoint()`` also requeues the worker,
and after SIGKILL its leases expire and other workers requeue the units.
Specification: docs/rollouts.md ("The worker").
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from submitit.helpers import Checkpointable, DelayedSubmission

from et_hpc.record import EpisodeRecord, apply_reward_rule, records_to_table, write_failed_record
from et_hpc.rollouts.queue import Lease, Unit, WorkQueue, new_worker_id
from et_hpc.rollouts.versions import UNVERSIONED, PolicyVersion, VersionReader
from et_hpc.runner.config import RunConfig
from et_hpc.runs.store import WRITE_ATTEMPTS, WRITE_RETRY_S
from et_hpc.runs.version_log import TRAINER
from et_hpc.text import configure_logging

if TYPE_CHECKING:
    import pyarrow as pa

    from et_hpc.images.store import ImageResult
    from et_hpc.tasks.model import Task

log = logging.getLogger(__name__)


def reap_interval(lease_s: float) -> float:
    """How often long-lived processes of a continuous run reap dead workers' sandboxes: twice per
    lease period, so none outlives its worker by more than one lease."""
    return max(1.0, lease_s / 2)


@dataclass
class _InFlight:
    lease: Lease
    start_version: PolicyVersion | None
    stop: threading.Event = field(default_factory=threading.Event)
    why: str | None = None  # "lost" | "stopping" | "abandoned"
    seen_versions: list[int] = field(default_factory=list)  # places in the version log seen while it ran


@dataclass
class WorkerStats:
    claimed: int = 0
    committed: int = 0
    discarded: int = 0  # lease lost: another attempt does the unit
    released: int = 0  # given back: stopping or abandoned
    abandoned: int = 0
    episodes: int = 0
    retried: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class Worker(Checkpointable):
    """One worker process (a Slurm array task, or a thread of the local controller)."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        tasks: dict[str, Task],
        images: dict[str, ImageResult],
        index: int = 0,
        concurrency: int | None = None,
    ):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.tasks = tasks
        self.images = images
        self.index = index
        self.concurrency = concurrency
        self._stop: threading.Event | None = None
        self._done: threading.Event | None = None

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["_stop"] = d["_done"] = None
        return d

    # ------------------------------------------------------------ entry points
    def __call__(self) -> dict[str, Any]:
        """Slurm array task: reap dead sandboxes, then run until the run stops."""
        import signal

        from et_hpc.runner.local import stop_on_signals
        from et_hpc.sandbox.reaper import reap_dead

        configure_logging(logging.INFO)
        reap_dead()
        stop = threading.Event()
        with stop_on_signals(stop, (signal.SIGTERM,)):
            return self.run(stop)

    def checkpoint(self, *args: Any, **kwargs: Any) -> DelayedSubmission:
        if self._stop is not None:
            log.warning("checkpoint: giving units back before requeue")
            self._stop.set()
            if self._done is not None:
                self._done.wait(60.0)
        return DelayedSubmission(Worker(self.cfg, self.run_dir, self.tasks, self.images, self.index, self.concurrency))

    # ------------------------------------------------------------ the loop
    def run(self, stop: threading.Event) -> dict[str, Any]:
        from et_hpc.runner.local import Warming, resolve_runner

        opts = self.cfg.continuous
        self._stop, self._done = stop, threading.Event()
        self.queue = WorkQueue(self.run_dir, lease_s=opts.lease_s).init()
        pol = self.cfg.policy
        self.versions = VersionReader(self.run_dir, endpoint_file=pol.endpoint_file, endpoint_dir=pol.endpoint_dir)
        self.runner = resolve_runner(self.cfg.unit_runner)
        self.warming = Warming(self.runner, self.cfg, stop)
        self.wid = new_worker_id()
        self.stats = WorkerStats()
        self.lock = threading.Lock()
        self.inflight: dict[str, _InFlight] = {}
        self.started_at = time.time()
        n = self.concurrency or self.cfg.node_concurrency()
        slots = [threading.Thread(target=self._slot, args=(stop,), name=f"slot-{i}", daemon=True) for i in range(n)]
        beat = threading.Thread(target=self._beat, args=(stop,), name="heartbeat", daemon=True)
        log.info("worker %s: %d slot(s) on %s", self.wid, n, self.run_dir)
        self._write_worker()
        beat.start()
        reaping = threading.Event()
        from et_hpc.sandbox.reaper import start_reaping

        start_reaping(reaping, reap_interval(opts.lease_s))  # other dead workers' sandboxes on this node
        for t in slots:
            t.start()
        try:
            for t in slots:
                while t.is_alive():
                    t.join(0.5)
        finally:
            stop.set()
            reaping.set()
            self.warming.close()
            beat.join(5.0)
            self._write_worker(exited=True)
            self._done.set()
        log.info("worker %s exits: %s", self.wid, self.stats.as_dict())
        return self.stats.as_dict()

    def _slot(self, stop: threading.Event) -> None:
        idle = self.cfg.continuous.poll_s
        while not stop.is_set():
            if self.queue.stopped():
                stop.set()
                break
            version = self.versions.current()  # read before the claim: the unit starts under it
            lease = self.queue.claim(self.wid)
            if lease is None:
                stop.wait(idle * (0.5 + random.random()))
                continue
            with self.lock:
                self.stats.claimed += 1
                fl = _InFlight(lease=lease, start_version=version, seen_versions=[version.position] if version and version.position else [])
                self.inflight[lease.unit.uid] = fl
            try:
                self._run_unit(fl, stop)
            except Exception:  # a bug: give the unit back, keep the worker alive
                log.exception("unit %s failed in the worker", lease.unit.uid)
                self.queue.release(lease)
            finally:
                with self.lock:
                    self.inflight.pop(lease.unit.uid, None)

    def _unit_cfg(self, fl: _InFlight) -> RunConfig:
        v = fl.start_version
        if v is not None and v.model and v.source == "trainer":
            return self.cfg.model_copy(update={"policy": self.cfg.policy.model_copy(update={"model": v.model})})
        return self.cfg

    def _run_unit(self, fl: _InFlight, stop: threading.Event) -> None:
        unit = fl.lease.unit
        task = self.tasks.get(unit.task_id)
        if task is None:
            log.error("unit %s names task %s, which this run does not have: given back", unit.uid, unit.task_id)
            self.queue.release(fl.lease)
            time.sleep(self.cfg.continuous.poll_s)
            return
        image = self.images.get(unit.task_id)
        cfg = self._unit_cfg(fl)
        recs: list[EpisodeRecord] = []
        for i in range(unit.samples):
            tries = 0
            while True:
                if fl.stop.is_set():
                    break
                # a group is G episodes of one task in a row: warm the slot's next one meanwhile
                nxt = [(task, unit.sample_index(i + 1), image)] if i + 1 < unit.samples else []
                ticket = self.warming.reserve(task, cfg, image, threading.current_thread().name, nxt)
                rec = self.warming.run(self.runner, ticket, task, unit.sample_index(i), cfg, image, fl.stop)
                if not isinstance(rec, EpisodeRecord):
                    rec = EpisodeRecord.model_validate(rec)
                rec = rec.with_queue(unit.enqueued_at)
                with self.lock:
                    self.stats.episodes += 1
                if rec.status != "ok" and not fl.stop.is_set() and tries < self.cfg.continuous.retries:
                    tries += 1
                    with self.lock:
                        self.stats.retried += 1
                    continue
                break
            if fl.stop.is_set():
                break
            recs.append(rec)
        if fl.stop.is_set():
            self._interrupted(fl)
            return
        slot = self._commit(fl, [self._tag(r, unit, fl) for r in recs])
        with self.lock:
            if slot is None and not (self.queue.done / f"{unit.uid}~{fl.lease.attempt}.json").exists():
                self.stats.discarded += 1
                log.warning("unit %s: lease lost before the commit; its records are discarded", unit.uid)
            else:
                self.stats.committed += 1
        self._write_worker()

    def _commit(self, fl: _InFlight, recs: list[EpisodeRecord]) -> int | None:
        """Commit the group's records, retrying a failing write; when it keeps failing, commit
        one error record per episode naming the cause instead (outside the agent's reach: the
        group is masked). Raises only when even that fails (``_slot`` gives the unit back)."""
        cause = ""
        for attempt in range(WRITE_ATTEMPTS):
            if attempt:
                time.sleep(WRITE_RETRY_S * attempt)
            try:
                return self._commit_once(fl, records_to_table(recs))
            except Exception as e:  # noqa: BLE001 - any cause is retried, then recorded
                cause = f"{type(e).__name__}: {e}"
                log.warning(
                    "unit %s: writing its records failed (attempt %d of %d): %s", fl.lease.unit.uid, attempt + 1, WRITE_ATTEMPTS, cause
                )
        log.error("unit %s: its records could not be written (%s); committing error records", fl.lease.unit.uid, cause)
        return self._commit_once(fl, records_to_table([write_failed_record(r, cause) for r in recs]))

    def _commit_once(self, fl: _InFlight, table: pa.Table) -> int | None:
        tmp = self.queue.results_path(fl.lease)
        (tmp.parent / f".tmp-{tmp.name}").unlink(missing_ok=True)  # left by a failed attempt
        return self.queue.commit(fl.lease, table)

    def _interrupted(self, fl: _InFlight) -> None:
        with self.lock:
            why = fl.why
        if why == "lost":
            with self.lock:
                self.stats.discarded += 1
            log.warning("unit %s: lease lost; its episodes are discarded", fl.lease.unit.uid)
            return
        if self.queue.release(fl.lease):
            with self.lock:
                self.stats.released += 1
                self.stats.abandoned += why == "abandoned"
            log.info("unit %s given back (%s)", fl.lease.unit.uid, why or "stopping")

    def _tag(self, rec: EpisodeRecord, unit: Unit, fl: _InFlight) -> EpisodeRecord:
        """The unit's ``group_id``; in a trainer-owned run (the version log holds a trainer publish)
        also the versions current while *this* episode ran: ``policy_version`` = the newest one
        published before its start (``unversioned`` before the first), ``policy_versions`` = it plus
        every one published up to its end, ``crossed_version`` from those; publishes that name a model
        (``publish_version(model=...)``) do not change the default model's weights and do not count.
        A unit whose version named a model asked for those weights throughout: its version.
        Server-owned runs keep the policy's per-turn record (observed into the log first)."""
        rec = apply_reward_rule(rec, self.cfg.reward)  # the run's one reward rule, recorded
        upd: dict[str, Any] = {"group_id": unit.group_id, "group_size": unit.samples}
        self.versions.observe()
        trainer = [e for e in self.versions.log.entries() if e.source == TRAINER]
        if not trainer:
            return rec.model_copy(update=upd)
        start = fl.start_version
        t0, t1 = rec.timings.start_s, rec.timings.stop_s
        in_place = [e for e in trainer if not e.model]  # what changes the weights of the unit's default model
        if start is not None and start.source == TRAINER and start.model:
            seen = [start.name]
        elif t0 is not None and t1 is not None:
            before = [e.label for e in in_place if e.published_at <= t0]
            during = [e.label for e in in_place if t0 < e.published_at <= t1]
            seen = list(dict.fromkeys([before[-1] if before else UNVERSIONED, *during]))
        elif start is not None and start.source == TRAINER:
            seen = [start.name]
        else:
            return rec.model_copy(update=upd)
        upd.update(policy_version=seen[0], policy_versions=seen, crossed_version=len(seen) > 1, version_source="trainer")
        return rec.model_copy(update=upd)

    # ------------------------------------------------------------ heartbeat
    def _beat(self, stop: threading.Event) -> None:
        opts = self.cfg.continuous
        next_sweep = time.monotonic() + random.uniform(0, opts.heartbeat_s)
        while True:
            stopping = stop.is_set() or self.queue.stopped()
            version = self.versions.current()
            with self.lock:
                items = list(self.inflight.values())
            for fl in items:
                if fl.stop.is_set():
                    continue
                if not self.queue.heartbeat(fl.lease):
                    self._interrupt(fl, "lost")
                    continue
                if version is not None and version.position is not None:
                    with self.lock:
                        if not fl.seen_versions or fl.seen_versions[-1] != version.position:
                            fl.seen_versions.append(version.position)
                        start = fl.seen_versions[0]  # the unit's start version, else the first one it saw
                    if opts.on_version_change == "abandon" and version.position - start > opts.max_staleness:
                        self._interrupt(fl, "abandoned")
                        continue
                if stopping:
                    self._interrupt(fl, "stopping")
            if stopping:
                stop.set()
                with self.lock:
                    if not self.inflight:
                        return
            if time.monotonic() >= next_sweep:
                try:
                    self.queue.sweep()
                except OSError as e:
                    log.warning("queue sweep failed: %s", e)
                next_sweep = time.monotonic() + opts.heartbeat_s * random.uniform(1.5, 2.5)
                self._write_worker()
            stop.wait(min(opts.heartbeat_s, 1.0) if stopping else opts.heartbeat_s)

    def _interrupt(self, fl: _InFlight, why: str) -> None:
        with self.lock:
            if fl.why is None:
                fl.why = why
        fl.stop.set()

    def _write_worker(self, exited: bool = False) -> None:
        with self.lock:
            running = sorted(self.inflight)
            stats = self.stats.as_dict()
        self.queue.write_worker(
            self.wid,
            {
                "worker": self.wid,
                "index": self.index,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                "slurm_array": f"{os.environ.get('SLURM_ARRAY_JOB_ID')}_{os.environ.get('SLURM_ARRAY_TASK_ID')}"
                if os.environ.get("SLURM_ARRAY_JOB_ID")
                else None,
                "started_at": self.started_at,
                "beat_at": time.time(),
                "running": running,
                "exited": exited,
                **stats,
            },
        )
