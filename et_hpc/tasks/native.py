"""Load a task folder in the Endless Terminals generator's own layout into a ``Task``.

Layout: ``task.json`` (``description`` = prompt, ``truth``, ``name``), ``container.def`` (or a
prebuilt ``container.sif``, which then wins), ``test_initial_state.py``, ``test_final_state.py``,
``solutions/<model>_summary.json`` (recorded runs; empty placeholders are ignored) and, in
folders made for this project, ``solution/solve.sh``.
"""

from __future__ import annotations

import json
from pathlib import Path

from et_hpc.errors import TaskError
from et_hpc.tasks.files import read_text
from et_hpc.tasks.model import Limits, Recipe, SourceKind, Task

MARKERS = ("task.json", "container.def", "container.sif")
_SMALL = 4096  # summaries at most this big are parsed to see whether they hold any run


def is_native(folder: Path) -> bool:
    return any((folder / m).exists() for m in MARKERS)


def read_json(path: Path, what: str) -> object:
    text = read_text(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise TaskError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}; fix the syntax") from None


def read_task_json(path: Path) -> dict:
    data = read_json(path, "task.json")
    if not isinstance(data, dict):
        raise TaskError(f'{path}: expected a JSON object with "description" and "truth"; got {type(data).__name__}')
    return data


def recorded_runs(folder: Path) -> list[Path]:
    """``solutions/*summary.json`` files that hold runs (``{}`` placeholders are skipped)."""
    sol = folder / "solutions"
    if not sol.is_dir():
        return []
    out = []
    for p in sorted(sol.glob("*summary.json")):
        try:
            size = p.stat().st_size
        except OSError:
            continue
        if size <= _SMALL:
            try:
                data = json.loads(p.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if not (isinstance(data, dict) and data.get("results")):
                continue
        out.append(p.resolve())
    return out


def load_native(folder: Path) -> Task:
    """Load one native task folder; ``TaskError`` names the file and the fix on any problem."""
    folder = Path(folder).resolve()
    tj = folder / "task.json"
    if not tj.exists():
        raise TaskError(f'{folder}: no task.json; add one with "description" (the prompt) and "truth"')
    data = read_task_json(tj)
    prompt = data.get("description")
    if not isinstance(prompt, str) or not prompt.strip():
        raise TaskError(f'{tj}: no "description" (the task prompt); add it as a non-empty string')
    truth = data.get("truth")
    if truth is not None and not isinstance(truth, str):
        truth = json.dumps(truth)
    sif, df = folder / "container.sif", folder / "container.def"
    if sif.is_file():
        recipe = Recipe(kind="sif", path=sif, context_dir=folder)
    elif df.is_file():
        recipe = Recipe(kind="def", path=df, context_dir=folder)
    else:
        raise TaskError(f"{folder}: no recipe (container.def or container.sif); add the Apptainer def the task builds from")
    meta: dict = {"layout": "native"}
    if isinstance(data.get("name"), str):
        meta["name"] = data["name"]
    return task_from_folder(
        folder,
        prompt=prompt,
        truth=truth,
        recipe=recipe,
        kind="native",
        metadata=meta,
        initial=folder / "test_initial_state.py",
        final=folder / "test_final_state.py",
    )


def task_from_folder(
    folder: Path,
    *,
    prompt: str,
    truth: str | None,
    recipe: Recipe,
    kind: SourceKind,
    initial: Path,
    final: Path,
    metadata: dict,
    limits: Limits | None = None,
) -> Task:
    """The Task of a task folder, with the optional files (tests, solution, recorded runs) that exist."""
    solve = folder / "solution" / "solve.sh"
    return Task(
        id=folder.name,
        prompt=prompt,
        truth=truth,
        recipe=recipe,
        initial_tests=initial if initial.is_file() else None,
        final_tests=final if final.is_file() else None,
        solution=solve if solve.is_file() else None,
        recorded_runs=recorded_runs(folder),
        limits=limits or Limits(),
        source=folder,
        source_kind=kind,
        metadata=metadata,
    )
