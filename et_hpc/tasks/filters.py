"""Choose tasks: by exact ids, an id glob, a split, and a seeded (deterministic) random sample."""

from __future__ import annotations

import fnmatch
import logging
import random
from collections.abc import Callable, Iterable

from et_hpc.tasks.model import Task

log = logging.getLogger(__name__)


def _patterns(glob: str | Iterable[str] | None) -> list[str]:
    if glob is None:
        return []
    items = [glob] if isinstance(glob, str) else list(glob)
    return [p.strip() for g in items for p in g.split(",") if p.strip()]


def id_predicate(ids: Iterable[str] | None = None, glob: str | Iterable[str] | None = None) -> Callable[[str], bool]:
    """A test on a task id alone (used before loading a folder, so unwanted folders cost nothing)."""
    idset = set(ids) if ids is not None else None
    pats = _patterns(glob)

    def want(task_id: str) -> bool:
        if idset is not None and task_id not in idset:
            return False
        return not pats or any(fnmatch.fnmatchcase(task_id, p) for p in pats)

    return want


def sample_tasks(tasks: list[Task], n: int, seed: int = 0) -> list[Task]:
    """``n`` tasks chosen with ``seed``; the same input and seed always give the same ids (in id order)."""
    if n < 0:
        raise ValueError("sample size must be >= 0")
    ordered = sorted(tasks, key=lambda t: (t.id, t.split or ""))
    if n >= len(ordered):
        return ordered
    picked = random.Random(seed).sample(range(len(ordered)), n)
    return [ordered[i] for i in sorted(picked)]


def apply_filters(
    tasks: list[Task],
    *,
    ids: Iterable[str] | None = None,
    glob: str | Iterable[str] | None = None,
    split: str | None = None,
    sample: int | None = None,
    seed: int = 0,
) -> list[Task]:
    want = id_predicate(ids, glob)
    out = [t for t in tasks if want(t.id)]
    if split is not None:
        if out and not any(t.split for t in out):
            log.warning("--split %s: these tasks carry no split (only parquet sources do); none kept", split)
        out = [t for t in out if t.split == split]
    if sample is not None:
        out = sample_tasks(out, sample, seed)
    return out
