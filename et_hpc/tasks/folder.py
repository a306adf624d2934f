"""One task folder, native or Harbor: recognise it and load it."""

from __future__ import annotations

from pathlib import Path

from et_hpc.errors import TaskError
from et_hpc.tasks.harbor import is_harbor, load_harbor
from et_hpc.tasks.model import Task
from et_hpc.tasks.native import is_native, load_native


def is_task_folder(folder: Path) -> bool:
    return is_native(folder) or is_harbor(folder)


def load_task_folder(folder: Path) -> Task:
    """Load one task folder, native or Harbor (Harbor wins when both kinds of files are there)."""
    folder = Path(folder)
    if is_harbor(folder):
        return load_harbor(folder)
    if is_native(folder):
        return load_native(folder)
    raise TaskError(f"{folder}: not a task folder (no task.json/container.def or instruction.md/environment/Dockerfile)")
