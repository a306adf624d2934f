"""The registry of executors by the name a run config gives (``executor: local|slurm``).

The one place that imports the backends, on first use: the Slurm backend pulls in submitit.
"""

from __future__ import annotations

from et_hpc.errors import UserError
from et_hpc.runner.base import Executor

NAMES = ("local", "slurm")


def get_executor(name: str) -> Executor:
    if name == "local":
        from et_hpc.runner.local import LocalExecutor

        return LocalExecutor()
    if name == "slurm":
        from et_hpc.runner.slurm import SlurmExecutor

        return SlurmExecutor()
    raise UserError(f"unknown executor {name!r}: use {' or '.join(NAMES)}")
