"""Planning a run: load tasks, check their images, list the (task, sample) units the store lacks.

Also home of ``open_store`` (the run's :class:`~et_hpc.store.RunStore`) and of ``run.json``,
the run's description (config + plan summary) in the run directory.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from et_hpc.errors import UserError
from et_hpc.runner.config import RunConfig
from et_hpc.store import RunStore
from et_hpc.util import atomic_write_text

log = logging.getLogger(__name__)

Unit = tuple[str, int]  # (task_id, sample)
OK = "ok"


# ---------------------------------------------------------------- records and stores
def rec_get(rec: Any, key: str, default: Any = None) -> Any:
    if isinstance(rec, dict):
        return rec.get(key, default)
    return getattr(rec, key, default)


def rec_passed(rec: Any) -> bool:
    """An ok episode whose reward is full (Endless Terminals rewards are 0/1)."""
    if rec_get(rec, "status") != OK:
        return False
    reward = rec_get(rec, "reward")
    return reward is not None and float(reward) >= 1.0 - 1e-9


def open_store(run_dir: Path) -> RunStore:
    """The record store of a run (its directory)."""
    return RunStore(Path(run_dir))


def store_records(store: RunStore) -> list[dict[str, Any]]:
    """Every unit's record (one per unit, deduped) as plain dicts."""
    return store.read().to_pylist()


# ---------------------------------------------------------------- plan
@dataclass
class Plan:
    cfg: RunConfig
    run_dir: Path
    tasks: dict[str, Any]
    images: dict[str, Any]
    units: list[Unit]  # still to run
    total: int  # tasks x samples
    done_ok: int = 0
    done_error: int = 0
    load_errors: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "tasks": len(self.tasks),
            "samples": self.cfg.samples,
            "units_total": self.total,
            "done_ok": self.done_ok,
            "done_error": self.done_error,
            "to_run": len(self.units),
            "retry_errors": self.cfg.retry_errors,
            "load_errors": len(self.load_errors),
        }


def load_run_tasks(cfg: RunConfig) -> tuple[list[Any], list[str]]:
    try:
        from et_hpc.tasks.loader import load_tasks  # type: ignore[attr-defined]
    except ImportError:
        raise UserError("this et-hpc has no task loader (et_hpc.tasks.loader); cannot load tasks") from None
    sel = cfg.tasks
    source = sel.source or (str(sel.tasks_dir) if sel.tasks_dir else None)
    if not source:
        raise UserError("no tasks given: pass SOURCE or --tasks-dir DIR, or set tasks.source in the run config")
    res = load_tasks(source, tasks_dir=sel.tasks_dir, ids=sel.ids, glob=sel.glob, split=sel.split,
                     sample=sel.sample, seed=sel.seed)
    errors = [str(e) for e in (getattr(res, "errors", None) or [])]
    return list(res.tasks), errors


def image_missing(img: Any) -> str | None:
    """None when the image is usable, else the reason it is not."""
    if img is None:
        return "not built"
    status = str(getattr(img, "status", "") or "")
    if status in ("missing", "failed", "error", "unbuildable"):
        return getattr(img, "reason", None) or status
    path = getattr(img, "path", None)
    if path is None or not Path(path).exists():
        return getattr(img, "reason", None) or "not built"
    return None


def default_image_lookup() -> Callable[[Any], Any]:
    try:
        from et_hpc.images.store import ImageStore  # type: ignore[attr-defined]
    except ImportError:
        raise UserError("this et-hpc has no image store (et_hpc.images.store); cannot check task images") from None
    return ImageStore().lookup


def make_plan(cfg: RunConfig, *, tasks: list[Any] | None = None,
              image_lookup: Callable[[Any], Any] | None = None, store: Any = None,
              write: bool = True) -> Plan:
    """Units still to run for ``cfg``; fails fast (UserError) when task images are missing."""
    run_dir = cfg.run_dir()
    load_errors: list[str] = []
    if tasks is None:
        tasks, load_errors = load_run_tasks(cfg)
    if not tasks:
        raise UserError("no tasks were selected: check the source and the ids/glob/split filters")
    by_id = {t.id: t for t in tasks}
    store = store if store is not None else open_store(run_dir)
    done = store.units()
    todo: list[Unit] = []
    ok = err = 0
    for tid in by_id:
        for s in range(cfg.samples):
            st = done.get((tid, s))
            if st == OK:
                ok += 1
            elif st is not None and not cfg.retry_errors:
                err += 1
            else:
                if st is not None:
                    err += 1
                todo.append((tid, s))
    need = sorted({tid for tid, _ in todo})
    images: dict[str, Any] = {}
    if need:
        lookup = image_lookup or default_image_lookup()
        missing = []
        for tid in need:
            img = lookup(by_id[tid])
            why = image_missing(img)
            if why:
                missing.append(f"{tid} ({why})")
            images[tid] = img
        if missing:
            src = cfg.tasks.source or cfg.tasks.tasks_dir or "SOURCE"
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise UserError(f"{len(missing)} task image(s) missing: {shown}; build them first with "
                            f"'et-hpc build {src}' (add --slurm to build on the cluster)")
    plan = Plan(cfg=cfg, run_dir=run_dir, tasks=by_id, images=images, units=todo,
                total=len(by_id) * cfg.samples, done_ok=ok, done_error=err, load_errors=load_errors)
    if write:
        write_run_json(plan)
    return plan


def write_run_json(plan: Plan) -> Path:
    path = plan.run_dir / "run.json"
    data = {
        "name": plan.cfg.run_name(),
        "run_dir": str(plan.run_dir),
        "planned_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": plan.cfg.model_dump(mode="json"),
        "plan": plan.summary(),
    }
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")
    return path


def read_run_json(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / "run.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path} not found: is {run_dir} a run directory (made by 'et-hpc run')?") from None
    except ValueError as e:
        raise UserError(f"{path} is not valid JSON ({e}); rerun 'et-hpc run' to rewrite it") from None
