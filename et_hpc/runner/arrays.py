"""Arrays of tasks through an executor: runs' chunks, continuous workers and image builds all use it.

``Executor.submit_array(tasks, spec)`` starts every task and returns an ``Array`` to watch, wait
for, stop and collect. A task is picklable and is called with no argument in a process of its own
(a Slurm array task: ``SlurmArray``, submitit underneath), or ``run(stop)`` in a thread of this
process (``LocalArray``; ``stop`` asks it to end). States use Slurm's names either way, so
``et_hpc.host.slurm.category``/``counts`` read them. With ``spec.run_dir`` set, a Slurm
submission is appended to that run's ``jobs.json`` (``spec.record``: the entry's extra fields).
A Slurm array goes in chunks that fit the site's submit limits (``SlurmArray``): a run larger
than MaxSubmitJobs completes instead of being refused (docs/runner.md, "Submitting within limits").
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from et_hpc.host import slurm as host_slurm
from et_hpc.host.slurm import SlurmConfig
from et_hpc.host.slurm_limits import Pacer, SubmitLimits

log = logging.getLogger(__name__)
OnPoll = Callable[[dict[str, str]], None]


class ArrayTask(Protocol):
    def __call__(self) -> Any: ...

    def run(self, stop: threading.Event) -> Any: ...


@dataclass
class ArraySpec:
    folder: Path  # logs (Slurm: submitit's files, one folder per job id below it)
    name: str  # the job name
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    what: str = "array"  # in "sbatch refused the <what>: ..."
    run_dir: Path | None = None  # record the submission in <run_dir>/jobs.json
    record: dict[str, Any] = field(default_factory=dict)  # extra fields of that record
    task_units: list[int] | None = None  # units of each task: a chunk's record says how many it holds


class Array(Protocol):
    ids: list[str]  # one per task, in order
    in_process: bool  # the tasks run in this process (they stop with it)

    def states(self) -> dict[str, str]: ...

    def ended(self) -> bool: ...

    def wait(self, *, poll_s: float, timeout_s: float | None = None, on_poll: OnPoll | None = None) -> tuple[dict[str, str], bool]: ...

    def stop(self, grace_s: float, poll_s: float = 2.0) -> None: ...

    def result(self, i: int) -> Any: ...

    def log_path(self, i: int) -> Path | None: ...


class LocalArray:
    """Each task's ``run(stop)`` in a daemon thread of this process."""

    in_process = True

    def __init__(self, tasks: Sequence[ArrayTask], name: str):
        self.ids = [f"local_{i}" for i in range(len(tasks))]
        self._stop = threading.Event()
        self._results: list[Any] = [None] * len(tasks)
        self._errors: list[BaseException | None] = [None] * len(tasks)
        self._threads = [threading.Thread(target=self._one, args=(i, t), name=f"{name}-{i}", daemon=True) for i, t in enumerate(tasks)]
        for t in self._threads:
            t.start()

    def _one(self, i: int, task: ArrayTask) -> None:
        try:
            self._results[i] = task.run(self._stop)
        except BaseException as e:  # noqa: BLE001 - kept for result()
            log.exception("%s raised", self.ids[i])
            self._errors[i] = e

    def states(self) -> dict[str, str]:
        return {
            tid: "RUNNING" if t.is_alive() else ("FAILED" if e is not None else "COMPLETED")
            for tid, t, e in zip(self.ids, self._threads, self._errors)
        }

    def ended(self) -> bool:
        return not any(t.is_alive() for t in self._threads)

    def wait(self, *, poll_s: float, timeout_s: float | None = None, on_poll: OnPoll | None = None) -> tuple[dict[str, str], bool]:
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            done = self.ended()  # before the states: a task ending in between is not left "RUNNING"
            states = self.states()
            if on_poll:
                on_poll(states)
            if done or (end is not None and time.monotonic() >= end):
                return states, done
            left = poll_s if end is None else max(0.0, min(poll_s, end - time.monotonic()))
            for t in self._threads:  # in short slices, so signals are handled
                t.join(min(left, 0.5))
                if t.is_alive():
                    break

    def stop(self, grace_s: float, poll_s: float = 2.0) -> None:
        """Ask every task to end, and wait up to ``grace_s`` for them."""
        self._stop.set()
        end = time.monotonic() + grace_s
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))

    def result(self, i: int) -> Any:
        err = self._errors[i]
        if err is not None:
            raise err
        return self._results[i]

    def log_path(self, i: int) -> Path | None:
        return None


NOT_SUBMITTED = "NOT_SUBMITTED"  # the state of a task never submitted (the array was stopped first)
UNSUBMITTED = "unsubmitted_"  # the id of a task not submitted yet, before its index


class SubmitDeferred(Exception):
    """sbatch refused a chunk because the queue is full for this user now: submit it later."""


SubmitChunk = Callable[[list[Any], int], list[Any]]  # (tasks, index of the first) -> submitit jobs
Limits = Callable[[int], SubmitLimits]  # (this array's live tasks) -> what Slurm accepts now


class SlurmArray:
    """Array tasks submitted to Slurm in chunks within the site's limits (``feed``).

    Each chunk is a submitit array of what ``limits`` leaves free now (MaxSubmitJobs of the QOS or
    association, MaxJobCount, ``slurm.max_submit_jobs``), at most MaxArraySize tasks and
    ``slurm.max_submits_per_min`` per minute; every poll (``states``, ``wait``, ``ended``) submits
    the next chunk that fits. A task not submitted yet has the id ``unsubmitted_<i>`` and the state
    PENDING; ``ids`` is updated in place as tasks are submitted.
    """

    in_process = False

    def __init__(self, tasks: Sequence[Any], spec: ArraySpec, submit_chunk: SubmitChunk, limits: Limits):
        self.tasks = list(tasks)
        self.jobs: list[Any] = [None] * len(self.tasks)
        self.ids = [f"{UNSUBMITTED}{i}" for i in range(len(self.tasks))]
        self.sent = 0
        self.waiting = ""  # why tasks wait to be submitted ("" when none does)
        self._submit, self._limits = submit_chunk, limits
        self._pacer = Pacer(spec.slurm.max_submits_per_min)
        self._closed = False
        self.feed(0)

    @property
    def array_id(self) -> str:
        return self.ids[0].split("_")[0]

    @property
    def array_ids(self) -> list[str]:
        """The Slurm job ids of the arrays submitted so far."""
        return list(dict.fromkeys(i.split("_")[0] for i in self.ids[: self.sent]))

    def feed(self, live: int) -> int:
        """Submit the next tasks that fit now (``live``: ours queued or running); how many."""
        left = len(self.tasks) - self.sent
        if left == 0 or self._closed:
            return 0
        lim = self._limits(live)
        free = left if lim.free is None else min(left, lim.free)
        pace = self._pacer.room()
        why = lim.why
        if pace is not None and pace < free:
            free, why = pace, f"slurm.max_submits_per_min={self._pacer.per_min}"
        done = 0
        while done < free:
            a = self.sent
            chunk = self.tasks[a : a + min(free - done, lim.max_array_size)]
            try:
                jobs = self._submit(chunk, a)
            except SubmitDeferred as e:
                why = str(e)
                break
            self.jobs[a : a + len(jobs)] = jobs
            self.ids[a : a + len(jobs)] = [str(j.job_id) for j in jobs]
            self.sent += len(jobs)
            self._pacer.add(len(jobs))
            done += len(jobs)
            log.info("submitted array %s: tasks %d-%d of %d", self.ids[a].split("_")[0], a, self.sent - 1, len(self.tasks))
        left = len(self.tasks) - self.sent
        self.waiting = f"{left} array task(s) wait to be submitted: {why}" if left else ""
        return done

    def states(self) -> dict[str, str]:
        sent = self.ids[: self.sent]
        got = host_slurm.task_states(sent) if sent else {}
        if self.sent < len(self.tasks) and not self._closed:
            live = sum(1 for s in got.values() if host_slurm.category(s) in ("queued", "running", "unknown"))
            before = self.sent
            if self.feed(live):
                got.update(host_slurm.task_states(self.ids[before : self.sent]))
        rest = NOT_SUBMITTED if self._closed else "PENDING"
        return {i: got.get(i, rest) for i in self.ids}

    def ended(self) -> bool:
        return all(host_slurm.ended(s) for s in self.states().values())

    def wait(self, *, poll_s: float, timeout_s: float | None = None, on_poll: OnPoll | None = None) -> tuple[dict[str, str], bool]:
        """Poll (submitting what fits) until every task has ended or ``timeout_s`` passes."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            states = self.states()
            if on_poll:
                on_poll(states)
            if all(host_slurm.ended(s) for s in states.values()):
                return states, True
            if end is not None and time.monotonic() >= end:
                return states, False
            time.sleep(poll_s if end is None else max(0.0, min(poll_s, end - time.monotonic())))

    def stop(self, grace_s: float, poll_s: float = 2.0) -> None:
        """Submit nothing more; wait up to ``grace_s`` for the tasks to end, then cancel what is left."""
        self._closed = True
        end = time.monotonic() + grace_s
        while time.monotonic() < end and not self.ended():
            time.sleep(poll_s)
        if not self.ended():
            log.warning("array tasks still running after %.0f s: cancelling them", grace_s)
            subprocess.run(["scancel", *self.ids[: self.sent]], capture_output=True, timeout=60)

    def result(self, i: int) -> Any:
        if self.jobs[i] is None:
            raise RuntimeError(f"array task {i} was never submitted")
        return self.jobs[i].result()

    def log_path(self, i: int) -> Path | None:
        return None if self.jobs[i] is None else Path(self.jobs[i].paths.stderr)
