"""The executor contract: something that runs a plan's units and says how it went.

``Executor.run(plan, store, ...)`` runs (or submits) the plan's units and returns an ``Outcome``.
Backends: ``local.LocalExecutor`` (threads on this machine) and ``slurm.SlurmExecutor`` (submitit
arrays, then waiting for them); ``executors.get_executor(name)`` picks one. Executors report
progress through callbacks and never print: ``notify`` gets one human line per event worth
telling (the command line writes them to stderr), ``progress(done_units, array_counts)`` the
count of units stored so far. ``submit_array(tasks, spec)`` starts any array of tasks (a run's
chunks, continuous workers, image builds) and returns what watches it (et_hpc.runner.arrays).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from et_hpc.runner.arrays import Array, ArraySpec, ArrayTask
    from et_hpc.runner.local import ExecResult
    from et_hpc.runner.plan import Plan
    from et_hpc.runs.store import RunStore

Notify = Callable[[str], None]
Progress = Callable[[int, dict[str, int]], None]


@dataclass
class Outcome:
    rc: int = 0  # 0: every unit ran; 3: stopped watching jobs that keep running; 130: interrupted
    settled: bool = True  # no episode of the run is running any more (its store may be compacted)
    detached: bool = False  # submitted and returned without waiting
    submissions: list[dict[str, Any]] = field(default_factory=list)  # slurm: the arrays submitted
    failed_tasks: dict[str, str] = field(default_factory=dict)  # slurm: array task -> end state, not completed
    result: ExecResult | None = None  # local


class Executor(Protocol):
    name: str
    in_process: bool  # its arrays' tasks run in this process (local) or as processes of their own

    def run(
        self, plan: Plan, store: RunStore, *, detach: bool = False, notify: Notify | None = None, progress: Progress | None = None
    ) -> Outcome: ...

    def submit_array(self, tasks: Sequence[ArrayTask], spec: ArraySpec) -> Array: ...
