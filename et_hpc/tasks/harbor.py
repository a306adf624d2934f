"""Load a task folder in the Harbor layout (the public Endless Terminals data set) into a ``Task``.

Layout: ``instruction.md`` (prompt), ``task.toml`` (timeouts, resources, difficulty, category),
``environment/Dockerfile`` (recipe, build context ``environment/``), ``environment/task.json``
(``truth``), ``environment/test_initial_state.py``, ``tests/test_final_state.py``, optional
``solution/solve.sh``. ``tests/test.sh`` is not used: it downloads uv and Python at verify time,
which offline nodes cannot do; the final tests run with the image's own pytest instead.

``task.toml`` is read with ``tomllib`` (Python 3.11+) or the ``tomli`` package on 3.10.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pydantic import ValidationError

from et_hpc.errors import TaskError
from et_hpc.tasks.files import read_text
from et_hpc.tasks.model import Limits, Recipe, Task
from et_hpc.tasks.native import read_task_json, task_from_folder

if sys.version_info >= (3, 11):
    import tomllib as _toml
else:  # pragma: no cover - 3.10
    try:
        import tomli as _toml
    except ModuleNotFoundError:
        _toml = None

MARKERS = ("instruction.md", "task.toml", "environment/Dockerfile")


def is_harbor(folder: Path) -> bool:
    return any((folder / m).exists() for m in MARKERS)


def read_toml(path: Path) -> dict:
    text = read_text(path, "task.toml")
    if _toml is None:
        raise TaskError(f"{path}: reading TOML needs Python 3.11+ or the 'tomli' package; install one")
    try:
        return _toml.loads(text)
    except _toml.TOMLDecodeError as e:
        raise TaskError(f"{path}: invalid TOML: {e}; fix the syntax") from None


def limits_and_meta(toml: dict, path: Path) -> tuple[Limits, dict]:
    def table(name: str) -> dict:
        v = toml.get(name, {})
        if not isinstance(v, dict):
            raise TaskError(f"{path}: [{name}] must be a table; fix task.toml")
        return v

    env, agent, verifier, meta_t = table("environment"), table("agent"), table("verifier"), table("metadata")
    try:
        limits = Limits(
            wall_time_s=agent.get("timeout_sec"),
            verifier_timeout_s=verifier.get("timeout_sec"),
            cpus=env.get("cpus"),
            memory_mb=env.get("memory_mb"),
            storage_mb=env.get("storage_mb"),
        )
    except ValidationError as e:
        err = e.errors()[0]
        raise TaskError(f"{path}: bad value for {'.'.join(map(str, err['loc']))}: {err['msg']}; fix task.toml") from None
    meta = {k: meta_t[k] for k in ("difficulty", "category", "tags", "author_name") if k in meta_t}
    if "build_timeout_sec" in env:
        meta["build_timeout_s"] = env["build_timeout_sec"]
    if "version" in toml:
        meta["harbor_version"] = toml["version"]
    return limits, meta


def load_harbor(folder: Path) -> Task:
    """Load one Harbor task folder; ``TaskError`` names the file and the fix on any problem."""
    folder = Path(folder).resolve()
    ins = folder / "instruction.md"
    if not ins.exists():
        raise TaskError(f"{folder}: no instruction.md; add the task prompt there")
    prompt = read_text(ins, "instruction.md")
    if not prompt.strip():
        raise TaskError(f"{ins}: empty; write the task prompt into it")
    limits = Limits()
    meta: dict = {}
    tt = folder / "task.toml"
    if tt.exists():
        limits, meta = limits_and_meta(read_toml(tt), tt)
    env_dir = folder / "environment"
    if (env_dir / "Dockerfile").is_file():
        recipe = Recipe(kind="dockerfile", path=env_dir / "Dockerfile", context_dir=env_dir)
    elif (env_dir / "container.def").is_file():
        recipe = Recipe(kind="def", path=env_dir / "container.def", context_dir=env_dir)
    elif (folder / "container.sif").is_file():
        recipe = Recipe(kind="sif", path=folder / "container.sif", context_dir=folder)
    else:
        raise TaskError(f"{folder}: no recipe (environment/Dockerfile); add the Dockerfile the task builds from")
    truth = None
    tj = env_dir / "task.json"
    if tj.exists():
        data = read_task_json(tj)
        truth = data.get("truth")
        if truth is not None and not isinstance(truth, str):
            truth = json.dumps(truth)
        if isinstance(data.get("name"), str):
            meta["name"] = data["name"]
    meta["layout"] = "harbor"
    return task_from_folder(
        folder,
        prompt=prompt,
        truth=truth,
        recipe=recipe,
        kind="harbor",
        metadata=meta,
        initial=env_dir / "test_initial_state.py",
        final=folder / "tests" / "test_final_state.py",
        limits=limits,
    )
