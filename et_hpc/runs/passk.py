"""Evaluation numbers with their uncertainty: pass@1 with a 95% Wilson interval, per task and overall,
and pass@k (the unbiased estimator of Chen et al. 2021) where a task has k or more scored samples.

Only ``ok`` episodes count (errors are not failures); solved = full reward (``record.solved``).
Overall pass@1 is solved / ok over all episodes, its interval Wilson's over those episodes (samples
of one task are treated as independent: with many samples of few tasks the interval is too narrow).
Overall pass@k is the mean over the tasks with at least k samples (``tasks`` says how many). Used by
``et-hpc status``, ``et-hpc store summary`` and ``et-hpc report``. Details: docs/reports.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from pydantic import BaseModel

from et_hpc.record import solved as is_solved

Z95 = 1.959963984540054
KS = (1, 2, 4, 8, 16)  # the k of pass@k reported (where enough samples exist)


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float] | None:
    """Wilson score interval of a binomial proportion ``k/n``; ``None`` for ``n == 0``."""
    if n <= 0:
        return None
    p = k / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    lo = 0.0 if k == 0 else max(0.0, centre - half)  # exact at the ends (no rounding residue)
    return lo, 1.0 if k == n else min(1.0, centre + half)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k from ``n`` samples of which ``c`` passed: 1 - C(n-c, k) / C(n, k) (n >= k)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class PassStats(BaseModel):
    """pass@1 (with its 95% Wilson interval) and pass@k of one task, or overall."""

    n: int  # ok samples
    solved: int
    pass1: float | None
    pass1_ci: tuple[float, float] | None
    pass_at: dict[int, float] = {}  # k -> pass@k, for k in KS with k <= n (overall: mean over such tasks)
    tasks: dict[int, int] = {}  # overall only: k -> tasks the pass@k is averaged over


class Evaluation(BaseModel):
    overall: PassStats
    per_task: dict[str, PassStats]


def _stats(n: int, c: int) -> PassStats:
    return PassStats(
        n=n,
        solved=c,
        pass1=c / n if n else None,
        pass1_ci=wilson(c, n),
        pass_at={k: pass_at_k(n, c, k) for k in KS if 1 < k <= n},
    )


def evaluate(rows: Iterable[tuple[str, str | None, float | None]]) -> Evaluation:
    """From (task_id, status, reward), one per unit (deduped)."""
    counts: dict[str, list[int]] = {}
    for task, status, reward in rows:
        if status != "ok":
            continue
        c = counts.setdefault(task, [0, 0])
        c[0] += 1
        c[1] += int(is_solved(reward))
    per_task = {t: _stats(n, c) for t, (n, c) in sorted(counts.items())}
    n_all = sum(v[0] for v in counts.values())
    c_all = sum(v[1] for v in counts.values())
    overall = PassStats(n=n_all, solved=c_all, pass1=c_all / n_all if n_all else None, pass1_ci=wilson(c_all, n_all))
    for k in KS[1:]:
        vals = [s.pass_at[k] for s in per_task.values() if k in s.pass_at]
        if vals:
            overall.pass_at[k] = sum(vals) / len(vals)
            overall.tasks[k] = len(vals)
    return Evaluation(overall=overall, per_task=per_task)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def line(s: PassStats) -> str:
    """``pass@1 50% [30%, 70%] (5/10)  pass@2 70%  pass@4 ...``"""
    ci = f" [{_pct(s.pass1_ci[0])}, {_pct(s.pass1_ci[1])}]" if s.pass1_ci else ""
    ks = "".join(f"  pass@{k} {_pct(v)}" + (f" ({s.tasks[k]} tasks)" if k in s.tasks else "") for k, v in s.pass_at.items())
    return f"pass@1 {_pct(s.pass1)}{ci} ({s.solved}/{s.n}){ks}"


def table(e: Evaluation) -> tuple[list[str], list[list[object]]]:
    """Headers and rows: one row per task, then ``(all)``."""
    ks = sorted({k for s in e.per_task.values() for k in s.pass_at})
    head = ["task", "ok", "solved", "pass@1", "95% interval", *[f"pass@{k}" for k in ks]]
    rows: list[list[object]] = []
    for name, s in [*e.per_task.items(), ("(all)", e.overall)]:
        ci = f"[{_pct(s.pass1_ci[0])}, {_pct(s.pass1_ci[1])}]" if s.pass1_ci else "-"
        rows.append([name, s.n, s.solved, _pct(s.pass1), ci, *[_pct(s.pass_at.get(k)) for k in ks]])
    return head, rows
