"""Arrays through the local executor: each task's ``run(stop)`` in a thread, watched, stopped, collected."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from et_hpc.host import slurm as watch
from et_hpc.runner.arrays import ArraySpec
from et_hpc.runner.executors import get_executor


class Square:
    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self) -> int:
        return self.run(threading.Event())

    def run(self, stop: threading.Event) -> int:
        if self.n < 0:
            raise ValueError(f"negative {self.n}")
        return self.n * self.n


class UntilStopped:
    def __call__(self) -> str:
        return self.run(threading.Event())

    def run(self, stop: threading.Event) -> str:
        stop.wait(120)
        return "stopped" if stop.is_set() else "timed out"


def test_local_array_runs_every_task_and_keeps_failures(tmp_path: Path) -> None:
    ex = get_executor("local")
    assert ex.in_process
    arr = ex.submit_array([Square(2), Square(-1), Square(3)], ArraySpec(folder=tmp_path, name="sq"))
    states, ended = arr.wait(poll_s=0.1, timeout_s=60)
    assert ended and arr.ended()
    assert watch.counts(states) == {"queued": 0, "running": 0, "done": 2, "failed": 1, "unknown": 0}
    assert [arr.result(0), arr.result(2)] == [4, 9]
    with pytest.raises(ValueError, match="negative -1"):
        arr.result(1)


def test_local_array_stop_ends_tasks_that_wait_for_it(tmp_path: Path) -> None:
    arr = get_executor("local").submit_array([UntilStopped(), UntilStopped()], ArraySpec(folder=tmp_path, name="w"))
    states, ended = arr.wait(poll_s=0.05, timeout_s=0.2)
    assert not ended and set(states.values()) == {"RUNNING"}  # positive control: they do not end by themselves
    arr.stop(grace_s=30)
    assert arr.ended() and [arr.result(0), arr.result(1)] == ["stopped", "stopped"]
