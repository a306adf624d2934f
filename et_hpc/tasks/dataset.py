"""Load tasks listed in a SkyRL / Hugging Face parquet data set (``obiwan96/endless-terminals-train``).

Rows name their task folder by a path from the authors' machines (``task_dir``,
``extra_info.task_dir`` or ``reward_spec.ground_truth``). The folder is found by its *name* under
``--tasks-dir`` (directly, or one level down, e.g. ``DIR/native/NAME``), in either layout. Rows
whose folder is missing are skipped with one warning and counted. The task comes from the
folder; the row contributes its split, ``max_time`` (as the wall-time limit when the folder sets
none) and provenance in ``metadata``.

Local files go through ``datasets.load_dataset("parquet", data_files=...)`` and work offline
(``HF_DATASETS_OFFLINE=1``); a hub name ``org/name`` goes through ``load_dataset(name, split=...)``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path, PurePath

from et_hpc.errors import TaskError, UserError
from et_hpc.tasks.model import Task

log = logging.getLogger(__name__)

COLUMNS = ["description", "truth", "task_dir", "data_source", "prompt", "env_class", "reward_spec", "extra_info"]
FOLDER_COLUMNS = ("task_dir", "extra_info", "reward_spec")
HUB_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def split_from_name(path: Path) -> str | None:
    stem = path.name.split(".")[0].lower()
    for word, split in (
        ("train", "train"),
        ("validation", "validation"),
        ("valid", "validation"),
        ("val", "validation"),
        ("test", "test"),
        ("eval", "validation"),
    ):
        if re.search(rf"(^|[^a-z]){word}([^a-z]|$)", stem):
            return split
    return None


def folder_index(tasks_dir: Path) -> dict[str, Path]:
    """Task folder name -> path, for folders directly in ``tasks_dir`` or one level below."""
    from et_hpc.tasks.folder import is_task_folder

    index: dict[str, Path] = {}
    nested: list[Path] = []
    for child in sorted(tasks_dir.iterdir()):
        if not child.is_dir() or child.name.startswith("."):
            continue
        if is_task_folder(child):
            index[child.name] = child
        else:
            nested.append(child)
    for sub in nested:
        try:
            kids = sorted(sub.iterdir())
        except OSError:
            continue
        for child in kids:
            if child.is_dir() and child.name not in index and is_task_folder(child):
                index[child.name] = child
    return index


def _row_folder_ref(row: dict) -> str | None:
    for key in ("task_dir",):
        if isinstance(row.get(key), str) and row[key]:
            return row[key]
    ei, rs = row.get("extra_info"), row.get("reward_spec")
    if isinstance(ei, dict) and isinstance(ei.get("task_dir"), str) and ei["task_dir"]:
        return ei["task_dir"]
    if isinstance(rs, dict) and isinstance(rs.get("ground_truth"), str) and rs["ground_truth"]:
        return rs["ground_truth"]
    return None


def _open(source: str | Path, *, hub: bool, split: str | None):
    import datasets

    datasets.disable_progress_bars() if hasattr(datasets, "disable_progress_bars") else None
    if hub:
        try:
            return datasets.load_dataset(str(source), split=split or "train")
        except Exception as e:  # noqa: BLE001 - datasets raises many types; all mean "cannot load"
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(
                f"cannot load hub data set {source!r} ({msg[:200]}); on an offline node download it first "
                f"(huggingface-cli download {source} --repo-type dataset) and pass the parquet file"
            ) from None
    try:
        import pyarrow.parquet as pq

        for f in sorted(Path(source).glob("*.parquet")) if Path(source).is_dir() else [Path(source)]:
            pq.read_schema(f)  # a broken file fails here, before datasets logs its own warning lines
        return datasets.load_dataset("parquet", data_files=str(source), split="train")
    except Exception as e:  # noqa: BLE001
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TaskError(f"{source}: cannot read as parquet ({msg[:200]}); check the file") from None


def load_parquet(
    source: str | Path,
    *,
    tasks_dir: Path | None = None,
    split: str | None = None,
    want: Callable[[str], bool] = lambda _id: True,
    hub: bool = False,
) -> tuple[list[Task], list[TaskError], int]:
    """Load one parquet file (or hub data set). Returns (tasks, per-task errors, rows skipped)."""
    from et_hpc.tasks.folder import load_task_folder

    ds = _open(source, hub=hub, split=split)
    cols = set(ds.column_names)
    missing = [c for c in ("description",) if c not in cols]
    if not cols.intersection(FOLDER_COLUMNS):
        missing.append("task_dir")
    if missing:
        raise TaskError(
            f"{source}: missing column(s) {', '.join(missing)} (found {', '.join(sorted(cols)) or 'none'}); "
            f"expected the SkyRL columns {', '.join(COLUMNS)}"
        )
    ds = ds.select_columns([c for c in COLUMNS if c in cols])
    row_split = split if hub else (split_from_name(Path(source)) or split)
    index = folder_index(tasks_dir) if tasks_dir is not None else None
    base = Path(source).parent if not hub else Path.cwd()
    tasks: list[Task] = []
    errors: list[TaskError] = []
    skipped: list[str] = []
    for i, row in enumerate(ds):
        ref = _row_folder_ref(row)
        if ref is None:
            errors.append(TaskError(f"{source}: row {i} names no task folder (task_dir is empty); fix the row"))
            continue
        name = PurePath(ref.replace("\\", "/")).name
        if not want(name):
            continue
        if index is not None:
            folder = index.get(name)
        else:
            cands = [Path(ref)] if Path(ref).is_absolute() else [base / ref, Path.cwd() / ref]
            folder = next((c for c in cands if c.is_dir()), None)
        if folder is None:
            skipped.append(name)
            continue
        try:
            task = load_task_folder(folder)
        except TaskError as e:
            errors.append(TaskError(str(e), task_id=name))
            continue
        meta = dict(task.metadata)
        meta.update(parquet=str(source), row=i, task_dir=ref)
        for k in ("data_source", "env_class"):
            if isinstance(row.get(k), str):
                meta[k] = row[k]
        desc = row.get("description")
        if isinstance(desc, str) and desc.strip() != task.prompt.strip():
            meta["parquet_prompt_differs"] = True
        limits = task.limits
        ei = row.get("extra_info")
        if isinstance(ei, dict) and isinstance(ei.get("max_time"), (int, float)) and limits.wall_time_s is None:
            limits = limits.model_copy(update={"wall_time_s": float(ei["max_time"])})
        tasks.append(task.model_copy(update={"split": row_split, "source_kind": "parquet", "metadata": meta, "limits": limits}))
    if skipped:
        where = tasks_dir if tasks_dir is not None else f"the paths as written (relative to {base})"
        log.warning(
            "%s: skipped %d of %d rows whose task folder is not in %s (e.g. %s); pass --tasks-dir",
            source,
            len(skipped),
            len(ds),
            where,
            skipped[0],
        )
    return tasks, errors, len(skipped)
