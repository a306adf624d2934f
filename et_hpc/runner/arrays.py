"""Arrays of tasks through an executor: runs' chunks, continuous workers and image builds all use it.

``Executor.submit_array(tasks, spec)`` starts every task and returns an ``Array`` to watch, wait
for, stop and collect. A task is picklable and is called with no argument in a process of its own
(a Slurm array task: ``SlurmArray``, submitit underneath), or ``run(stop)`` in a thread of this
process (``LocalArray``; ``stop`` asks it to end). States use Slurm's names either way, so
``et_hpc.host.slurm.category``/``counts`` read them. With ``spec.run_dir`` set, a Slurm
submission is appended to that run's ``jobs.json`` (``spec.record``: the entry's extra fields).
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


class SlurmArray:
    """Submitted submitit jobs (one per task) and their Slurm states."""

    in_process = False

    def __init__(self, jobs: list[Any]):
        self.jobs = jobs
        self.ids = [str(j.job_id) for j in jobs]  # a one-task array is a plain job

    @property
    def array_id(self) -> str:
        return self.ids[0].split("_")[0]

    def states(self) -> dict[str, str]:
        return host_slurm.task_states(self.ids)

    def ended(self) -> bool:
        return all(host_slurm.ended(s) for s in self.states().values())

    def wait(self, *, poll_s: float, timeout_s: float | None = None, on_poll: OnPoll | None = None) -> tuple[dict[str, str], bool]:
        return host_slurm.wait_tasks(self.ids, poll_s=poll_s, timeout_s=timeout_s, on_poll=on_poll)

    def stop(self, grace_s: float, poll_s: float = 2.0) -> None:
        """Wait up to ``grace_s`` for the tasks to end by themselves, then cancel what is left."""
        end = time.monotonic() + grace_s
        while time.monotonic() < end and not self.ended():
            time.sleep(poll_s)
        if not self.ended():
            log.warning("array tasks still running after %.0f s: cancelling them", grace_s)
            subprocess.run(["scancel", *self.ids], capture_output=True, timeout=60)

    def result(self, i: int) -> Any:
        return self.jobs[i].result()

    def log_path(self, i: int) -> Path | None:
        return Path(self.jobs[i].paths.stderr)
