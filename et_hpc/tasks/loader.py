"""One entry point for every task source: ``load_tasks(source, ...) -> LoadResult``.

``source`` may be a task folder (native or Harbor), a folder of task folders (mixed layouts),
a parquet file, a folder of parquet files, or a hub data set name (``org/name``). Detection is
automatic. Problems with one task become a ``TaskError`` in ``LoadResult.errors`` and the other
tasks load; a missing source or tasks dir raises ``UserError`` for the whole load.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from et_hpc.errors import TaskError, UserError
from et_hpc.tasks import dataset, filters
from et_hpc.tasks.base_names import default_base_map
from et_hpc.tasks.folder import is_task_folder, load_task_folder  # noqa: F401  (re-exported)
from et_hpc.tasks.model import Task
from et_hpc.util import progress_bar

log = logging.getLogger(__name__)
Want = Callable[[str], bool]  # does a task id pass the id and glob filters


class TaskSelectionConfig(BaseModel):
    """Where tasks come from and which of them to run (passed to ``load_tasks``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    source: str | None = None
    """A task folder, a folder of task folders, a parquet file (or a folder of them) or a dataset name (org/name)."""
    tasks_dir: Path | None = None
    """The folder holding the task_* folders that parquet rows name; the source when none is given."""
    ids: list[str] | None = None
    """Only these task ids."""
    glob: str | None = None
    """Only task ids matching this shell pattern."""
    split: str | None = None
    """Only tasks of this split."""
    sample: int | None = None
    """Pick this many tasks at random (after the other filters)."""
    seed: int = 0
    """The seed of ``sample``'s random pick."""


TaskSelection = TaskSelectionConfig  # its old name


@dataclass
class LoadResult:
    tasks: list[Task] = field(default_factory=list)
    errors: list[TaskError] = field(default_factory=list)  # per-task problems; the other tasks loaded
    skipped: int = 0  # parquet rows whose task folder is missing
    kind: str = ""  # task | folder | parquet | hub

    def by_id(self, task_id: str) -> Task | None:
        return next((t for t in self.tasks if t.id == task_id), None)


def validate_recipe(task: Task, base_map: dict[str, Path] | None = None) -> None:
    """Parse (and normalise) the task's recipe; raises ``TaskError`` for def or Dockerfile problems."""
    from et_hpc.tasks.recipe import normalise

    normalise(task, base_map=base_map if base_map is not None else default_base_map())


def _progress(items: list, desc: str, enabled: bool):
    if not enabled or len(items) < 50:
        return items
    return progress_bar(items, desc=desc, unit="task", leave=False)


def load_tasks(
    source: str | Path,
    *,
    tasks_dir: str | Path | None = None,
    ids: Iterable[str] | None = None,
    glob: str | Iterable[str] | None = None,
    split: str | None = None,
    sample: int | None = None,
    seed: int = 0,
    validate: bool = False,
    base_map: dict[str, Path] | None = None,
    progress: bool = True,
) -> LoadResult:
    """Load, filter and (optionally) validate tasks from any source; see the module docstring."""
    ids = list(ids) if ids is not None else None
    tdir = _tasks_dir(tasks_dir)
    want = filters.id_predicate(ids, glob)
    res = LoadResult()
    p = Path(source).expanduser()
    if p.is_file():
        _load_file(p, tdir, split, want, res)
    elif p.is_dir():
        _load_dir(p, tdir, split, want, res, progress)
    elif dataset.HUB_RE.match(str(source)) and not str(source).startswith((".", "/")):
        _load_hub(str(source), tdir, split, want, res)
    else:
        raise UserError(f"{source}: no such file or folder; pass a task folder, a folder of tasks, a .parquet file or org/name")
    if ids is not None:
        _note_missing_ids(source, ids, res)
    res.tasks = _dedupe(res.tasks)
    if split is not None or sample is not None:
        res.tasks = filters.apply_filters(res.tasks, split=split, sample=sample, seed=seed)
    if validate:
        _validate(res, base_map if base_map is not None else default_base_map())
    return res


def _tasks_dir(tasks_dir: str | Path | None) -> Path | None:
    if tasks_dir is None:
        return None
    tdir = Path(tasks_dir).expanduser()
    if not tdir.is_dir():
        raise UserError(f"tasks dir {tdir} does not exist or is not a folder; pass --tasks-dir with the folder holding task_* folders")
    return tdir


def _load_file(p: Path, tdir: Path | None, split: str | None, want: Want, res: LoadResult) -> None:
    if p.suffix != ".parquet":
        raise UserError(f"{p}: not a task source (expected a task folder, a folder of tasks, a .parquet file or org/name)")
    res.kind = "parquet"
    _load_parquets([p], tdir, split, want, res)


def _load_dir(p: Path, tdir: Path | None, split: str | None, want: Want, res: LoadResult, progress: bool) -> None:
    """A task folder, a folder of parquet files, or a folder of task folders."""
    if is_task_folder(p):
        res.kind = "task"
        if want(p.name):
            _load_one(p, res)
        return
    children = sorted(c for c in p.iterdir() if not c.name.startswith("."))
    parquets = [c for c in children if c.is_file() and c.suffix == ".parquet"]
    folders = [c for c in children if c.is_dir() and is_task_folder(c)]
    if parquets and not folders:
        res.kind = "parquet"
        _load_parquets(parquets, tdir, split, want, res)
        return
    res.kind = "folder"
    for c in _progress([c for c in folders if want(c.name)], "loading tasks", progress):
        _load_one(c, res)
    ignored = [c.name for c in children if c.is_dir() and c not in folders]
    if ignored:
        log.debug("%s: ignored %d folders that are not tasks: %s", p, len(ignored), ", ".join(ignored[:5]))
    if not folders:
        log.warning("%s: no task folders found (task.json or instruction.md inside)", p)


def _load_hub(name: str, tdir: Path | None, split: str | None, want: Want, res: LoadResult) -> None:
    res.kind = "hub"
    try:
        tasks, errors, skipped = dataset.load_parquet(name, tasks_dir=tdir, split=split, want=want, hub=True)
    except TaskError as e:
        res.errors.append(e)
        return
    res.tasks += tasks
    res.errors += errors
    res.skipped += skipped


def _note_missing_ids(source: str | Path, ids: list[str], res: LoadResult) -> None:
    found = {t.id for t in res.tasks} | {e.task_id for e in res.errors}
    for i in ids:
        if i not in found:
            res.errors.append(TaskError(f"{source}: no task with id {i!r}; check the id ('et-hpc tasks list {source}')"))


def _validate(res: LoadResult, bm: dict[str, Path]) -> None:
    good = []
    for t in res.tasks:
        try:
            validate_recipe(t, bm)
        except TaskError as e:
            res.errors.append(TaskError(str(e), task_id=t.id))
        else:
            good.append(t)
    res.tasks = good


def _dedupe(tasks: list[Task]) -> list[Task]:
    seen: dict[tuple[str, str | None], Task] = {}
    for t in sorted(tasks, key=lambda t: (t.id, t.split or "")):
        key = (t.id, t.split)
        if key in seen:
            log.warning("task %s listed twice (%s and %s); keeping the first", t.id, seen[key].source, t.source)
            continue
        seen[key] = t
    return list(seen.values())


def _load_one(folder: Path, res: LoadResult) -> None:
    try:
        res.tasks.append(load_task_folder(folder))
    except TaskError as e:
        res.errors.append(TaskError(str(e), task_id=folder.name))


def _load_parquets(files: list[Path], tdir: Path | None, split: str | None, want: Want, res: LoadResult) -> None:
    for f in files:
        try:
            tasks, errors, skipped = dataset.load_parquet(f, tasks_dir=tdir, split=split, want=want)
        except TaskError as e:
            res.errors.append(e)
            continue
        res.tasks += tasks
        res.errors += errors
        res.skipped += skipped
