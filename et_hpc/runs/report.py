"""``et-hpc report``: the trend of pass rate over a series of runs (e.g. nightly checkpoint scores).

For every run of a store whose name matches a glob, by time: episodes, errors, pass rate with a
95% Wilson interval, mean reward and passed/total, the change against the previous run with a
95% Newcombe interval, the tasks newly solved and failed between the last two runs, and a
capacity section (``et_hpc.runs.capacity``). Counting follows the store: one record per unit,
only ``ok`` episodes are scored, errors are counted apart (never as failures). Output: a table,
JSON or one self-contained HTML file with an inline SVG chart. Details: docs/reports.md.
"""

from __future__ import annotations

import fnmatch
import html
import math
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from et_hpc.errors import UserError
from et_hpc.record import solved as is_solved
from et_hpc.runs.capacity import run_capacity
from et_hpc.runs.passk import Evaluation, evaluate, wilson
from et_hpc.runs.passk import table as pass_table
from et_hpc.runs.store import RUN_CONFIG, RunStore, Store
from et_hpc.util import format_table, num, pct, progress_bar

Z95 = 1.959963984540054
_COLUMNS = ["task_id", "sample", "status", "reward", "passed", "total", "split", "model", "created_at", "episode_id"]


class RunRow(BaseModel):
    """One run of the trend."""

    run: str
    path: str
    time: str | None  # ISO time the row is ordered by
    time_source: str  # "planned_at" | "created_at" | "none"
    model: str | None
    episodes: int  # units after dedupe (and split filter)
    ok: int
    errors: int
    solved: int  # ok episodes with reward 1
    pass_rate: float | None  # solved / ok
    pass_rate_ci: tuple[float, float] | None  # 95% Wilson interval
    mean_reward: float | None
    mean_test_fraction: float | None  # mean passed/total over ok episodes with tests
    delta: float | None = None  # pass_rate - previous run's pass_rate
    delta_ci: tuple[float, float] | None = None  # 95% Newcombe interval of the difference
    significant: bool | None = None  # delta_ci excludes 0
    task_rates: dict[str, float] = {}  # per task: solved / ok samples (tasks with an ok sample)
    capacity: dict[str, Any] | None = None  # et_hpc.runs.capacity.capacity() of every recorded episode
    evaluation: Evaluation | None = None  # pass@1 with its 95% interval and pass@k, per task and overall


class TaskChanges(BaseModel):
    """Per-task changes between the last two runs (tasks scored in both)."""

    previous: str
    last: str
    newly_solved: list[str]
    newly_failed: list[str]
    still_solved: int
    still_failed: int
    only_previous: list[str]  # scored only in the previous run
    only_last: list[str]  # scored only in the last run


class Report(BaseModel):
    store: str
    glob: str
    split: str | None
    runs: list[RunRow]
    changes: TaskChanges | None


# --- statistics ------------------------------------------------------------------------------
def newcombe(k1: int, n1: int, k2: int, n2: int, z: float = Z95) -> tuple[float, float] | None:
    """95% interval of ``k2/n2 - k1/n1`` (Newcombe's hybrid score method, from two Wilson intervals)."""
    a, b = wilson(k1, n1, z), wilson(k2, n2, z)
    if a is None or b is None:
        return None
    p1, p2 = k1 / n1, k2 / n2
    d = p2 - p1
    lo = d - math.sqrt((p2 - b[0]) ** 2 + (a[1] - p1) ** 2)
    hi = d + math.sqrt((b[1] - p2) ** 2 + (p1 - a[0]) ** 2)
    return max(-1.0, lo), min(1.0, hi)


# --- reading runs ----------------------------------------------------------------------------
def _parse_time(s: object) -> datetime | None:
    if not isinstance(s, str) or not s:
        return None
    for parse in (datetime.fromisoformat, lambda v: datetime.strptime(v, "%Y-%m-%dT%H:%M:%S%z")):
        try:
            t = parse(s)
        except ValueError:
            continue
        return t.replace(tzinfo=timezone.utc) if t.tzinfo is None else t.astimezone(timezone.utc)
    return None


def run_row(rs: RunStore, split: str | None = None) -> RunRow:
    """Score one run (optionally only the episodes of ``split``)."""
    cfg = rs.config() or {}
    rows = rs.read(columns=_COLUMNS).to_pylist()
    if split is not None:
        rows = [r for r in rows if r["split"] == split]
    when = _parse_time(cfg.get("planned_at"))
    source = "planned_at"
    if when is None:
        stamps = [r["created_at"] for r in rows if r["created_at"] is not None]
        when = min(stamps).astimezone(timezone.utc) if stamps else None
        source = "created_at" if when else "none"
    ok = [r for r in rows if r["status"] == "ok"]
    n_solved = sum(1 for r in ok if is_solved(r["reward"]))
    rewards = [r["reward"] for r in ok if r["reward"] is not None]
    fracs = [r["passed"] / r["total"] for r in ok if r["passed"] is not None and r["total"]]
    per_task: dict[str, list[int]] = {}
    for r in ok:
        c = per_task.setdefault(r["task_id"], [0, 0])
        c[0] += is_solved(r["reward"])
        c[1] += 1
    policy = cfg.get("config", {}).get("policy", {}) if isinstance(cfg.get("config"), dict) else {}
    models = sorted({r["model"] for r in rows if r["model"]})
    model = (policy.get("model") if isinstance(policy, dict) else None) or (", ".join(models) or None)
    return RunRow(
        run=rs.name,
        path=str(rs.path),
        time=when.isoformat() if when else None,
        time_source=source,
        model=model,
        episodes=len(rows),
        ok=len(ok),
        errors=len(rows) - len(ok),
        solved=n_solved,
        pass_rate=n_solved / len(ok) if ok else None,
        pass_rate_ci=wilson(n_solved, len(ok)),
        mean_reward=sum(rewards) / len(rewards) if rewards else None,
        mean_test_fraction=sum(fracs) / len(fracs) if fracs else None,
        task_rates={t: c[0] / c[1] for t, c in sorted(per_task.items())},
        evaluation=evaluate((r["task_id"], r["status"], r["reward"]) for r in rows),
    )


def task_changes(prev: RunRow, last: RunRow) -> TaskChanges:
    """Tasks that went from unsolved to solved and back between two runs (solved = any sample passed)."""
    both = sorted(set(prev.task_rates) & set(last.task_rates))
    was = {t: prev.task_rates[t] > 0 for t in both}
    now = {t: last.task_rates[t] > 0 for t in both}
    return TaskChanges(
        previous=prev.run,
        last=last.run,
        newly_solved=[t for t in both if now[t] and not was[t]],
        newly_failed=[t for t in both if was[t] and not now[t]],
        still_solved=sum(1 for t in both if now[t] and was[t]),
        still_failed=sum(1 for t in both if not now[t] and not was[t]),
        only_previous=sorted(set(prev.task_rates) - set(last.task_rates)),
        only_last=sorted(set(last.task_rates) - set(prev.task_rates)),
    )


def build_report(store: Path | str, glob: str = "*", split: str | None = None) -> Report:
    """Score every run of ``store`` matching ``glob`` and compare each with the one before."""
    root = Path(store).expanduser()
    if not root.exists():
        raise UserError(f"store {root} does not exist; pass the store folder that holds the runs (e.g. $ET_HPC_STORE)")
    if not root.is_dir():
        raise UserError(f"store {root} is not a directory; pass the store folder that holds the runs")
    if (root / RUN_CONFIG).exists() or any(root.glob("part-*.parquet")):
        raise UserError(
            f"{root} is one run, not a store; pass its parent folder {root.parent} (with --glob '{root.name}' to report only this run)"
        )
    names = Store(root).runs()
    chosen = [n for n in names if fnmatch.fnmatchcase(n, glob)]
    if not chosen:
        shown = ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
        raise UserError(
            f"no run in {root} matches --glob {glob!r}" + (f" (runs there: {shown})" if names else " (the store holds no runs)")
        )
    rows = [run_row(RunStore(root / n), split) for n in _progress(chosen)]
    for r in rows:
        r.capacity = run_capacity(RunStore(r.path), cores=os.cpu_count() or 1)
    rows.sort(key=lambda r: (r.time is None, r.time or "", r.run))
    prev: RunRow | None = None
    for r in rows:
        if prev is not None and r.pass_rate is not None and prev.pass_rate is not None:
            r.delta = r.pass_rate - prev.pass_rate
            r.delta_ci = newcombe(prev.solved, prev.ok, r.solved, r.ok)
            r.significant = r.delta_ci is not None and (r.delta_ci[0] > 0 or r.delta_ci[1] < 0)
        if r.pass_rate is not None:
            prev = r
    scored = [r for r in rows if r.ok]
    changes = task_changes(scored[-2], scored[-1]) if len(scored) >= 2 else None
    return Report(store=str(root), glob=glob, split=split, runs=rows, changes=changes)


def _progress(items: list[str]):
    return progress_bar(items, desc="report", unit="run", show=None if len(items) > 3 else False)


# --- output ----------------------------------------------------------------------------------
def _delta(r: RunRow) -> str:
    if r.delta is None:
        return "-"
    ci = f" [{100 * r.delta_ci[0]:+.1f}, {100 * r.delta_ci[1]:+.1f}]" if r.delta_ci else ""
    return f"{100 * r.delta:+.1f}pp{ci}{' *' if r.significant else ''}"


HEADERS = [
    "run",
    "date",
    "model",
    "episodes",
    "ok",
    "errors",
    "pass rate [95% CI]",
    "mean reward",
    "mean passed/total",
    "change vs previous [95% CI]",
]


def table_rows(rep: Report) -> list[list[str]]:
    out = []
    for r in rep.runs:
        ci = f" [{pct(r.pass_rate_ci[0])}, {pct(r.pass_rate_ci[1])}]" if r.pass_rate_ci else ""
        out.append(
            [
                r.run,
                (r.time or "-")[:16].replace("T", " "),
                r.model or "-",
                str(r.episodes),
                str(r.ok),
                str(r.errors),
                pct(r.pass_rate) + ci,
                num(r.mean_reward, "{:.3f}"),
                num(r.mean_test_fraction, "{:.3f}"),
                _delta(r),
            ]
        )
    return out


CAPACITY_HEADERS = [
    "run",
    "episodes/hour",
    "model share",
    "infra overhead median / p95 s",
    "sandbox MB median / p95 / max",
    "accepted / GPU-hour",
]


def capacity_rows(rep: Report) -> list[list[str]]:
    out = []
    for r in rep.runs:
        c = r.capacity
        if not c or not c["episodes"]:
            out.append([r.run, "-", "-", "-", "-", "-"])
            continue
        io, mem = c["infra_overhead_s"], c["sandbox_mem_mb"]
        out.append(
            [
                r.run,
                num(c["episodes_per_hour"]),
                pct(c["model_share"]),
                f"{num(io['median'], '{:.2f}')} / {num(io['p95'], '{:.2f}')}",
                f"{num(mem['median'])} / {num(mem['p95'])} / {num(mem['max'])}",
                num(c["trainer"]["accepted_per_gpu_hour"]),
            ]
        )
    return out


CAPACITY_NOTE = (
    "capacity: every recorded episode (retries included); episodes/hour over busy time; infra "
    "overhead = setup + scoring + teardown + queue; accepted = ok episodes of groups without an "
    "error member ('et-hpc status RUN --capacity' has the details and a projection)"
)


def format_text(rep: Report) -> str:
    lines = [
        format_table(HEADERS, table_rows(rep)),
        "* the 95% interval of the change excludes 0 (pp = percentage points)",
        "",
        format_table(CAPACITY_HEADERS, capacity_rows(rep)),
        CAPACITY_NOTE,
    ]
    if rep.runs and rep.runs[-1].evaluation is not None:
        head, rows = pass_table(rep.runs[-1].evaluation)
        lines += ["", f"{rep.runs[-1].run}: pass@1 per task (95% Wilson interval) and pass@k (unbiased)", format_table(head, rows)]
    c = rep.changes
    if c is not None:
        lines.append(
            f"\n{c.previous} -> {c.last}: {len(c.newly_solved)} newly solved, "
            f"{len(c.newly_failed)} newly failed, {c.still_solved} still solved, "
            f"{c.still_failed} still failed"
        )
        for label, tasks in (("newly solved", c.newly_solved), ("newly failed", c.newly_failed)):
            if tasks:
                lines.append(f"  {label}: {', '.join(tasks[:20])}" + (" ..." if len(tasks) > 20 else ""))
    return "\n".join(lines)


def svg_chart(runs: list[RunRow], width: int = 760, height: int = 300) -> str:
    """An inline SVG line chart of pass rate per run with the 95% intervals as error bars."""
    pts = [(i, r, r.pass_rate) for i, r in enumerate(runs) if r.pass_rate is not None]
    labels = [r.run if len(r.run) <= 32 else r.run[:14] + "…" + r.run[-17:] for r in runs]
    longest = max((len(s) for s in labels), default=0)
    left, right, top, bottom = max(50, int(5.3 * longest)), 20, 20, 25 + int(3.3 * longest)
    width, height = width + left - 50, height + bottom - 60
    w, h = width - left - right, height - top - bottom
    n = max(len(runs) - 1, 1)

    def x(i: int) -> float:
        return left + (w * i / n if len(runs) > 1 else w / 2)

    def y(v: float) -> float:
        return top + h * (1 - v)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="pass rate per run">'
    ]
    for v in (0, 0.25, 0.5, 0.75, 1.0):
        out.append(
            f'<line x1="{left}" y1="{y(v):.1f}" x2="{left + w}" y2="{y(v):.1f}" stroke="#ddd"/>'
            f'<text x="{left - 6}" y="{y(v) + 4:.1f}" font-size="11" text-anchor="end">{int(v * 100)}%</text>'
        )
    if pts:
        path = " ".join(f"{'M' if k == 0 else 'L'}{x(i):.1f},{y(rate):.1f}" for k, (i, _, rate) in enumerate(pts))
        out.append(f'<path d="{path}" fill="none" stroke="#1f77b4" stroke-width="2"/>')
    for i, r, rate in pts:
        cx, cy = x(i), y(rate)
        if r.pass_rate_ci:
            lo, hi = y(r.pass_rate_ci[0]), y(r.pass_rate_ci[1])
            out.append(
                f'<line x1="{cx:.1f}" y1="{lo:.1f}" x2="{cx:.1f}" y2="{hi:.1f}" stroke="#555"/>'
                f'<line x1="{cx - 4:.1f}" y1="{lo:.1f}" x2="{cx + 4:.1f}" y2="{lo:.1f}" stroke="#555"/>'
                f'<line x1="{cx - 4:.1f}" y1="{hi:.1f}" x2="{cx + 4:.1f}" y2="{hi:.1f}" stroke="#555"/>'
            )
        out.append(
            f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="4" fill="#1f77b4">'
            f"<title>{html.escape(r.run)}: {pct(r.pass_rate)} of {r.ok}</title></circle>"
        )
    for i, (r, label) in enumerate(zip(runs, labels)):
        out.append(
            f'<text x="{x(i):.1f}" y="{top + h + 14}" font-size="10" text-anchor="end" '
            f'transform="rotate(-30 {x(i):.1f} {top + h + 14})"><title>{html.escape(r.run)}</title>'
            f"{html.escape(label)}</text>"
        )
    out.append("</svg>")
    return "\n".join(out)


def format_html(rep: Report) -> str:
    """One self-contained HTML page: chart, table and the task changes between the last two runs."""
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in HEADERS)
    body = "\n".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in table_rows(rep))
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>et-hpc report: {e(rep.glob)}</title>",
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}td:first-child,th{text-align:left}"
        "h2{margin-top:1.5em}</style></head><body>",
        f"<h1>Pass rate over runs</h1><p>store <code>{e(rep.store)}</code>, runs <code>{e(rep.glob)}</code>"
        + (f", split <code>{e(rep.split)}</code>" if rep.split else "")
        + ". Error bars and intervals: 95% (Wilson for a rate, Newcombe for a change); "
        "* marks a change whose interval excludes 0. Errors are not counted as failures.</p>",
        svg_chart(rep.runs),
        f"<p>Episodes, transcripts and tests: <code>et-hpc view {e(rep.store)}/RUN</code> writes a viewer per run.</p>",
        f"<h2>Runs</h2><table><thead><tr>{head}</tr></thead><tbody>\n{body}\n</tbody></table>",
        "<h2>Capacity</h2><table><thead><tr>"
        + "".join(f"<th>{e(h)}</th>" for h in CAPACITY_HEADERS)
        + "</tr></thead><tbody>\n"
        + "\n".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in capacity_rows(rep))
        + f"\n</tbody></table><p>{e(CAPACITY_NOTE)}</p>",
    ]
    c = rep.changes
    if c is not None:
        parts.append(
            f"<h2>Tasks changed: {e(c.previous)} &rarr; {e(c.last)}</h2>"
            f"<p>{c.still_solved} still solved, {c.still_failed} still failed.</p>"
        )
        for label, tasks in (
            ("Newly solved", c.newly_solved),
            ("Newly failed", c.newly_failed),
            ("Scored only in the previous run", c.only_previous),
            ("Scored only in the last run", c.only_last),
        ):
            items = "".join(f"<li><code>{e(t)}</code></li>" for t in tasks) or "<li>none</li>"
            parts.append(f"<h3>{label} ({len(tasks)})</h3><ul>{items}</ul>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


# --- command line ----------------------------------------------------------------------------
