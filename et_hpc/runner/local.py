"""The local executor: run units a few at a time in threads, write each record as it finishes.

A shared ``threading.Event`` *stop* is passed to every unit runner: once set (Ctrl-C, SIGTERM, a
Slurm checkpoint) no new episode starts and running ones must return soon; records of episodes
that did not finish ok after it are dropped, so a resumed run does them again. An episode that
ended with an error outside the agent's reach (``RETRIED``) is rerun at once, up to ``retries``
times; only the last attempt is stored. ``UnitPool`` keeps warm sandboxes (``sandbox.warm``) for
the units that run next. Specification: docs/runner.md ("The local executor").
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import signal
import sys
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from et_hpc.errors import UserError
from et_hpc.host import slurm as host_slurm
from et_hpc.record import EpisodeRecord, write_failed_record
from et_hpc.runner.arrays import ArraySpec, ArrayTask, LocalArray
from et_hpc.runner.base import Notify, Outcome, Progress
from et_hpc.runner.config import RunConfig
from et_hpc.runner.plan import OK, GroupTags, Plan, Record, Unit, open_store, rec_get, rec_passed, tag_record
from et_hpc.runs.store import RunStore
from et_hpc.util import progress_bar

if TYPE_CHECKING:
    from et_hpc.images.store import ImageResult
    from et_hpc.sandbox.warm import SandboxSpec, Ticket, WarmPool
    from et_hpc.tasks.model import Task

log = logging.getLogger(__name__)

# Statuses rerun at once (``retries``): the sandbox side of the host. A policy_error has spent the
# policy's own retry budget against the server already, and no_image will not change by itself.
RETRIED = ("infra_error", "shell_error", "score_error")

UnitRunner = Callable[..., Any]  # (task, sample, cfg, image, stop) -> record (an EpisodeRecord or its dict)
WorkItem = tuple[Any, int, "ImageResult | None"]  # (task, sample, image): the task is what the unit runner takes


def episode_runner(
    task: Task, sample: int, cfg: RunConfig, image: ImageResult | None, stop: threading.Event, warm: Ticket | None = None
) -> EpisodeRecord:
    """The default unit runner: one real episode (``et_hpc.episode.run.run_episode``), called directly.

    ``warm``: a reserved warm sandbox (et_hpc.sandbox.warm.Ticket), passed only to runners that
    set ``uses_warm_pool``; other unit runners are called as ``(task, sample, cfg, image, stop)``.
    """
    from et_hpc.episode.run import run_episode  # imported here: it pulls in the sandbox and agent code

    return run_episode(task, sample, cfg, image, stop=stop, warm=warm)


episode_runner.uses_warm_pool = True  # type: ignore[attr-defined]
EPISODE_RUNNER = "et_hpc.runner.local:episode_runner"  # its name in configs written before it was the default


class Warming:
    """A worker process's ``WarmPool``, made at the first unit (none when ``sandbox.warm`` is 0 or
    the unit runner does not take warm sandboxes): reserve one for a unit, say which units come next."""

    def __init__(self, runner: UnitRunner, cfg: RunConfig, stop: threading.Event) -> None:
        self.size = cfg.sandbox.warm_count() if getattr(runner, "uses_warm_pool", False) else 0
        self.stop = stop
        self.pool: WarmPool | None = None  # made at the first reserve
        self._lock = threading.Lock()
        self._closed = False

    @staticmethod
    def spec(task: Task, cfg: RunConfig, image: ImageResult | None) -> SandboxSpec | None:
        from et_hpc.episode.run import sandbox_spec

        return sandbox_spec(task, cfg, image)

    def reserve(self, task: Task, cfg: RunConfig, image: ImageResult | None, source: Hashable, upcoming: list[WorkItem]) -> Ticket | None:
        """A ticket for ``task``'s sandbox (or None); then warm ``upcoming`` for ``source``."""
        if not self.size:
            return None
        with self._lock:
            if self.pool is None and not self._closed:
                from et_hpc.sandbox.warm import WarmPool

                self.pool = WarmPool(self.size, stop=self.stop)
            pool = self.pool
        if pool is None:
            return None
        ticket = pool.reserve(self.spec(task, cfg, image))
        pool.want(source, [self.spec(t, cfg, im) for t, _, im in upcoming])
        return ticket

    def run(
        self,
        runner: UnitRunner,
        ticket: Ticket | None,
        task: Any,
        sample: int,
        cfg: RunConfig,
        image: ImageResult | None,
        stop: threading.Event,
    ) -> Any:
        """``runner`` on the unit, with ``ticket`` when there is one; the ticket is discarded after."""
        if ticket is None:
            return runner(task, sample, cfg, image, stop)
        try:
            return runner(task, sample, cfg, image, stop, warm=ticket)
        finally:
            ticket.discard()

    def close(self) -> None:
        with self._lock:
            self._closed, pool = True, self.pool
        if pool is not None:
            pool.close()


def resolve_runner(spec: str | None) -> UnitRunner:
    """The unit runner a run config names: unset (the default) is the episode itself
    (:func:`episode_runner`); ``"package.module:function"`` is that function."""
    if spec is None or spec == EPISODE_RUNNER:
        return episode_runner
    mod, sep, attr = spec.partition(":")
    if not sep:
        raise UserError(f"unit_runner {spec!r}: expected 'module:function'")
    try:
        fn = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise UserError(f"unit_runner {spec!r} cannot be imported: {e}") from None
    return fn


@dataclass
class ExecResult:
    started: int = 0
    ok: int = 0
    errors: int = 0
    passed: int = 0
    crashed: int = 0  # the unit runner raised: nothing recorded, the unit stays to do
    dropped: int = 0  # interrupted by stop: nothing recorded
    not_started: int = 0
    interrupted: bool = False
    failures: list[str] = field(default_factory=list)

    @property
    def pass_rate(self) -> float | None:
        return self.passed / self.ok if self.ok else None


@contextlib.contextmanager
def stop_on_signals(stop: threading.Event, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Set ``stop`` on the first SIGINT/SIGTERM; a second SIGINT raises KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {}

    def handler(signum: int, frame: Any) -> None:
        if stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not stop.is_set():
            print(
                f"et-hpc: {signal.Signals(signum).name}: stopping, no new episodes; running ones are being interrupted",
                file=sys.stderr,
                flush=True,
            )
        stop.set()

    for s in signals:
        old[s] = signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class UnitPool:
    """Threads that pull work items and run them with a unit runner until done or stopped."""

    def __init__(
        self,
        items: list[WorkItem],
        runner: UnitRunner,
        cfg: RunConfig,
        store: RunStore,
        concurrency: int,
        stop: threading.Event,
        progress: tqdm | None = None,
        ready_at: float | None = None,
        tags: GroupTags | None = None,
    ):
        self.items = list(items)
        self.tags = tags  # the invocation's groups (Plan.group_tags): every record gets its task's
        self.ready_at = ready_at  # Unix time the units became runnable: records get queue_s from it
        self.runner, self.cfg, self.store = runner, cfg, store
        self.stop = stop
        self.progress = progress
        self.result = ExecResult()
        self._lock = threading.Lock()
        self._next = 0
        self.warming = Warming(runner, cfg, stop)
        n = max(1, min(concurrency, len(self.items) or 1))
        self.threads = [threading.Thread(target=self._work, name=f"unit-{i}", daemon=True) for i in range(n)]

    def _take(self) -> tuple[WorkItem, Ticket | None] | None:
        """The next item and its warm sandbox ticket (None without one); the pool then warms the
        ``sandbox.warm`` items after it."""
        with self._lock:
            if self.stop.is_set() or self._next >= len(self.items):
                return None
            item = self.items[self._next]
            self._next += 1
            self.result.started += 1
            upcoming = self.items[self._next : self._next + self.cfg.sandbox.warm_count()]
            return item, self.warming.reserve(item[0], self.cfg, item[2], "units", upcoming)

    def _work(self) -> None:
        while (taken := self._take()) is not None:
            (task, sample, image), ticket = taken
            retried: list[str] = []
            while True:
                try:
                    rec = self.warming.run(self.runner, ticket, task, sample, self.cfg, image, self.stop)
                except Exception as e:  # a bug or an interrupt in the unit runner: leave the unit to redo
                    rec = e
                    break
                finally:
                    ticket = None  # a warm sandbox serves one attempt
                status = rec_get(rec, "status")
                if status not in RETRIED or len(retried) >= self.cfg.retries or self.interrupted():
                    break
                # outside the agent's reach (host, server, our bugs): run the unit again at once
                why = f"{status}: {rec_get(rec, 'error') or ''}"[:300]
                log.warning("unit %s/%s ended %s; running it again", task.id, sample, why)
                retried.append(f"retried after {why}")
            if isinstance(rec, Exception):
                if self.stop.is_set():
                    with self._lock:
                        self.result.dropped += 1
                    continue
                log.error("unit %s/%s raised", task.id, sample, exc_info=rec)
                with self._lock:
                    self.result.crashed += 1
                    self.result.failures.append(f"{task.id}#{sample}: {type(rec).__name__}: {rec}")
                self._tick()
                continue
            if isinstance(rec, EpisodeRecord):
                rec = rec.with_queue(self.ready_at)
            # Interrupted episodes (stop, or the Slurm job being cancelled under us) are redone on resume.
            # So is one the agent is blamed for when that blame may be the cancel's signals (a shell
            # or the tests killed): whatever is not a clean ok is checked.
            if not _clean(rec) and self.interrupted():
                with self._lock:
                    self.result.dropped += 1
                continue
            if retried:
                rec = _with_events(rec, retried)
            rec = tag_record(rec, self.tags, self.cfg.reward)
            written = self._write(rec, task.id, sample)
            if written is None:
                self._tick()
                continue
            rec, status = written, rec_get(written, "status")
            with self._lock:
                if status == OK:
                    self.result.ok += 1
                    self.result.passed += int(rec_passed(rec))
                else:
                    self.result.errors += 1
            self._tick()

    def _write(self, rec: Any, task_id: str, sample: int) -> Any:
        """Store ``rec``; a write that keeps failing leaves an error record naming the cause
        instead (what was stored is returned). None when nothing could be stored: the unit is
        counted as crashed, with the cause, and the thread goes on with the next unit."""
        try:
            write_or_error = getattr(self.store, "write_or_error", None)
            if write_or_error is None:  # a store without the fallback: its write, guarded
                self.store.write([rec])
                return rec
            _, cause = write_or_error([rec])
            return rec if cause is None else write_failed_record(rec, cause)
        except Exception as e:  # noqa: BLE001 - never end the worker thread over a write
            log.error("unit %s/%s: its record could not be stored", task_id, sample, exc_info=True)
            with self._lock:
                self.result.crashed += 1
                self.result.failures.append(f"{task_id}#{sample}: the record could not be stored: {type(e).__name__}: {e}")
            return None

    def interrupted(self) -> bool:
        """Asked to stop, or the Slurm job is being cancelled under us (asked only after an error)."""
        return self.stop.is_set() or host_slurm.slurm_job_ending()

    def _tick(self) -> None:
        if self.progress is None:
            return
        with self._lock:
            r = self.result
            rate = f"{100 * r.pass_rate:.0f}%" if r.pass_rate is not None else "-"
            self.progress.set_postfix_str(f"pass {rate} err {r.errors + r.crashed}", refresh=False)
            self.progress.update(1)

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for every thread (in short slices so signals are handled); True when all ended."""
        import time

        end = None if timeout is None else time.monotonic() + timeout
        for t in self.threads:
            while t.is_alive():
                left = 0.5 if end is None else min(0.5, end - time.monotonic())
                if left <= 0:
                    return False
                t.join(left)
        return True

    def run(self) -> ExecResult:
        try:
            self.start()
            self.join()
        finally:
            self.warming.close()
        self.result.not_started = len(self.items) - self.result.started
        self.result.interrupted = self.stop.is_set()
        return self.result


def run_local(
    plan: Plan,
    runner: UnitRunner | None = None,
    *,
    store: RunStore | None = None,
    stop: threading.Event | None = None,
    progress: bool = True,
    handle_signals: bool = True,
) -> ExecResult:
    """Run every unit of ``plan`` on this machine with ``cfg.node_concurrency()`` at once."""
    cfg = plan.cfg
    runner = runner or resolve_runner(cfg.unit_runner)
    store = store if store is not None else open_store(plan.run_dir)
    stop = stop or threading.Event()
    items = work_items(plan, plan.units)
    if items and cfg.unit_runner in (None, EPISODE_RUNNER):
        from et_hpc.host.runtime import refuse_unusable
        from et_hpc.paths import scratch_dir

        scratch_dir()  # a scratch directory we must not use: one line and exit 2 before any episode
        refuse_unusable()  # no container can start on this node (no user namespace, no setuid starter)
    bar = progress_bar(total=len(items), desc=f"run {cfg.run_name()}", unit="ep", show=bool(progress), dynamic_ncols=True)
    pool = UnitPool(items, runner, cfg, store, cfg.node_concurrency(), stop, bar, ready_at=plan.planned_at, tags=plan.group_tags())
    try:
        with stop_on_signals(stop) if handle_signals else contextlib.nullcontext():
            return pool.run()
    finally:
        bar.close()


class LocalExecutor:
    """Runs the plan's units on this machine (``run_local``); Ctrl-C or SIGTERM stops it cleanly."""

    name = "local"
    in_process = True  # its arrays' tasks run in this process

    def submit_array(self, tasks: Sequence[ArrayTask], spec: ArraySpec) -> LocalArray:
        """Each task's ``run(stop)`` in a thread of this process (``spec`` names the threads)."""
        return LocalArray(tasks, spec.name)

    def run(
        self, plan: Plan, store: RunStore, *, detach: bool = False, notify: Notify | None = None, progress: Progress | None = None
    ) -> Outcome:
        res = run_local(plan, store=store)
        if res.interrupted:
            return Outcome(rc=130, settled=False, result=res)
        return Outcome(result=res)


def _clean(rec: Record) -> bool:
    """Ok, and nothing in it that a signal to the job's processes could have caused."""
    return rec_get(rec, "status") == OK and not rec_get(rec, "score_note") and rec_get(rec, "stop_reason") != "shell_broken"


def _with_events(rec: Record, lines: list[str]) -> Record:
    """``rec`` with ``lines`` put before its own events (a record object or a dict)."""
    if isinstance(rec, dict):
        return {**rec, "events": [*lines, *(rec.get("events") or [])]}
    return rec.model_copy(update={"events": [*lines, *(rec.events or [])]})


def work_items(plan: Plan, units: list[Unit]) -> list[WorkItem]:
    return [(plan.tasks[tid], s, plan.images.get(tid)) for tid, s in units]
