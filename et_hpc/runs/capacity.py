"""Capacity of a run: throughput, where episode time goes, sandbox memory, and a projection.

``capacity(rows, ...)`` turns a run's raw episode rows (every episode that ran, retries included:
each one used the machine) into one JSON-friendly dict, shown by ``et-hpc status RUN --capacity``
and in ``et-hpc report``: episodes per busy hour (overall, per node, per worker), the time split
and infra overhead, sandbox peak memory, a projection to N nodes of K episodes, and the
trainer's accepted episodes per GPU-hour and wait. Percentiles are nearest-rank (always a
measured value). Every key and the projection's model: docs/reports.md.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from et_hpc.host import slurm
from et_hpc.util import num, pct

if TYPE_CHECKING:
    from et_hpc.runs.store import RunStore

MODEL = (
    "episodes/hour per node = 3600 * min(K / T, C / c): T = mean episode wall time (slot held), "
    "c = mean node CPU time per episode (setup + exec + score + teardown + warm; model time is spent on "
    "the GPU server), C = cores per node, K = concurrent episodes per node; N nodes: N times that, "
    "while the model server keeps its measured latency"
)

COLUMNS = ["episode_id", "status", "timings", "host", "worker", "slurm_job_id", "slurm_array_task_id", "peak_mem_mb", "peak_pids"]
PARTS = ("queue_s", "setup_s", "model_s", "exec_s", "score_s", "teardown_s", "total_s", "warm_s")
INFRA = ("setup_s", "score_s", "teardown_s", "queue_s")
CPU = ("setup_s", "exec_s", "score_s", "teardown_s", "warm_s")


# --- statistics ------------------------------------------------------------------------------
def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (see the module doc); None for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


def dist(values: list[float]) -> dict[str, Any]:
    """``n``, ``median`` (p50), ``p95``, ``mean``, ``max`` of ``values`` (None when empty)."""
    return {
        "n": len(values),
        "median": percentile(values, 50),
        "p95": percentile(values, 95),
        "mean": sum(values) / len(values) if values else None,
        "max": max(values) if values else None,
    }


def busy_s(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``[start, stop]`` intervals."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def hist_percentile(hist: dict[str, int], p: float) -> int | None:
    """Nearest-rank percentile of a ``{"k": count}`` histogram (non-integer keys ignored)."""
    counts = sorted((int(k), int(n)) for k, n in hist.items() if k.lstrip("-").isdigit() and n > 0)
    n = sum(c for _, c in counts)
    if not n:
        return None
    rank, seen = max(1, math.ceil(p / 100 * n)), 0
    for k, c in counts:
        seen += c
        if seen >= rank:
            return k
    return counts[-1][0]


# --- the computation -------------------------------------------------------------------------
def worker_key(row: dict[str, Any]) -> str:
    """A Slurm array task (``<job>_<task>``) or job, else the process ``<host>:<pid>``, else the host."""
    job, task = row.get("slurm_job_id"), row.get("slurm_array_task_id")
    if job and task is not None:
        return f"{job}_{task}"
    return job or row.get("worker") or row.get("host") or "?"


def _rate(n: int, seconds: float) -> float | None:
    return n * 3600.0 / seconds if seconds > 0 else None


def _per(rows: list[dict[str, Any]], key: Callable[[dict[str, Any]], str]) -> list[dict[str, Any]]:
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(key(r), []).append(r)
    out = []
    for k, rs in sorted(by.items()):
        span = busy_s([(r["timings"]["start_s"], r["timings"]["stop_s"]) for r in rs])
        wall = sum(r["timings"]["total_s"] or 0.0 for r in rs)
        out.append(
            {
                "key": k,
                "episodes": len(rs),
                "busy_h": span / 3600,
                "episodes_per_hour": _rate(len(rs), span),
                "mean_concurrency": wall / span if span > 0 else None,
            }
        )
    return out


def projection(t_s: float | None, cpu_s: float | None, cores: int, nodes: list[int], per_node: list[int]) -> dict[str, Any]:
    """Episodes/hour for each (nodes, per_node) from the stated MODEL."""
    out: dict[str, Any] = {"model": MODEL, "cores_per_node": cores, "episode_s": t_s, "cpu_s": cpu_s, "cpu_bound_at_k": None, "rows": []}
    if not t_s or t_s <= 0:
        return out
    cpu_rate = cores / cpu_s if cpu_s and cpu_s > 0 else math.inf
    out["cpu_bound_at_k"] = cores * t_s / cpu_s if cpu_s and cpu_s > 0 else None
    for n in nodes:
        for k in per_node:
            slot_rate = k / t_s
            rate = min(slot_rate, cpu_rate)
            out["rows"].append(
                {"nodes": n, "per_node": k, "episodes_per_hour": n * 3600 * rate, "bound": "cpu" if cpu_rate < slot_rate else "slots"}
            )
    return out


def capacity(
    rows: list[dict[str, Any]],
    *,
    cores: int,
    nodes: list[int] | None = None,
    per_node: list[int] | None = None,
    accepted: int | None = None,
    gpu_hours: float | None = None,
    gpu_hours_source: str | None = None,
    consumers: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The capacity dict of the module docstring. ``rows`` need the ``COLUMNS``; rows without
    ``start_s``/``stop_s``/``total_s`` (episodes refused before they started) are left out."""
    seen: set[str | None] = set()
    timed = []
    for r in rows:
        t = r.get("timings") or {}
        if r.get("episode_id") in seen or None in (t.get("start_s"), t.get("stop_s"), t.get("total_s")):
            continue
        seen.add(r.get("episode_id"))
        timed.append(r)

    def col(part: str) -> list[float]:
        return [r["timings"][part] for r in timed if r["timings"].get(part) is not None]

    def summed(r: dict[str, Any], parts: tuple[str, ...]) -> float:
        return sum(r["timings"].get(p) or 0.0 for p in parts)

    total = sum(col("total_s"))
    span = busy_s([(r["timings"]["start_s"], r["timings"]["stop_s"]) for r in timed])
    by_host = _per(timed, lambda r: r.get("host") or "?")
    by_worker = _per(timed, worker_key)
    mem = [r["peak_mem_mb"] for r in timed if r.get("peak_mem_mb") is not None]
    pids = [r["peak_pids"] for r in timed if r.get("peak_pids") is not None]
    t_mean = total / len(timed) if timed else None
    cpu_mean = sum(summed(r, CPU) for r in timed) / len(timed) if timed else None
    k_seen = max((h["mean_concurrency"] or 0 for h in by_host), default=0)
    ks = per_node or sorted({max(1, round(k_seen)), max(1, 2 * round(k_seen))})
    proj = projection(t_mean, cpu_mean, cores, nodes or [1, 4, 16], ks)
    out: dict[str, Any] = {
        "episodes": len(timed),
        "ok": sum(1 for r in timed if r.get("status") == "ok"),
        "busy_h": span / 3600,
        "episodes_per_hour": _rate(len(timed), span),
        "by_host": by_host,
        "by_worker": by_worker,
        "model_share": sum(col("model_s")) / total if total > 0 else None,
        "exec_share": sum(col("exec_s")) / total if total > 0 else None,
        "time_split": {p.removesuffix("_s"): dist(col(p)) for p in PARTS},
        "infra_overhead_s": dist([summed(r, INFRA) for r in timed]),
        "node_overhead_s": dist([summed(r, INFRA[:-1]) for r in timed]),
        "sandbox_mem_mb": dist(mem),
        "sandbox_pids_max": max(pids) if pids else None,
        "projection": proj,
    }
    trainer: dict[str, Any] = {
        "accepted_episodes": accepted,
        "gpu_hours": gpu_hours,
        "gpu_hours_source": gpu_hours_source,
        "accepted_per_gpu_hour": None,
    }
    if accepted is not None and gpu_hours:
        trainer["accepted_per_gpu_hour"] = accepted / gpu_hours
    trainer["consumers"] = [consumer_kpis(c) for c in consumers or []]
    out["trainer"] = trainer
    return out


def consumer_kpis(cursor: dict[str, Any]) -> dict[str, Any]:
    """Trainer-wait fraction and staleness p50/p95 of one stream consumer's cursor."""
    tm = cursor.get("telemetry")
    tm = tm if isinstance(tm, dict) else {}
    first, last = tm.get("first_call_at"), tm.get("last_return_at")
    span = (last - first) if isinstance(first, (int, float)) and isinstance(last, (int, float)) else None
    raw = tm.get("staleness")
    hist = {str(k): v for k, v in raw.items() if isinstance(v, int)} if isinstance(raw, dict) else {}
    return {
        "consumer": cursor.get("consumer"),
        "delivered": cursor.get("delivered"),
        "calls": tm.get("calls", 0),
        "wait_s": tm.get("wait_s"),
        "wait_fraction": tm["wait_s"] / span if span and isinstance(tm.get("wait_s"), (int, float)) else None,
        "staleness_p50": hist_percentile(hist, 50),
        "staleness_p95": hist_percentile(hist, 95),
        "staleness": hist,
    }


# --- reading a run ---------------------------------------------------------------------------
def read_consumers(run_dir: Path) -> list[dict[str, Any]]:
    """The stream cursors of a continuous run (``consumers/*.json``); unreadable ones are skipped."""
    out = []
    for p in sorted((Path(run_dir) / "consumers").glob("*.json")):
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(d, dict):
            d.setdefault("consumer", p.stem)
            out.append(d)
    return out


def sacct_gpu_hours(job_id: str, timeout: float = 10.0) -> float | None:
    """GPU-hours Slurm accounted to job ``job_id`` (elapsed x allocated GPUs), or None."""
    if not job_id:
        return None
    out = slurm.query(["sacct", "-n", "-P", "-X", "-j", str(job_id), "-o", "ElapsedRaw,AllocTRES"], timeout)
    return None if out is None else gpu_hours_from_sacct(out)


def gpu_hours_from_sacct(text: str) -> float | None:
    """Sum of ElapsedRaw x ``gres/gpu=N`` over ``sacct -P -o ElapsedRaw,AllocTRES`` lines; None
    when no line allocated GPUs."""
    hours = 0.0
    found = False
    for line in text.splitlines():
        elapsed, _, tres = line.partition("|")
        gpus = next((t.split("=", 1)[1] for t in tres.split(",") if t.startswith("gres/gpu=")), None)
        if elapsed.strip().isdigit() and gpus and gpus.isdigit():
            hours += int(elapsed) * int(gpus) / 3600
            found = True
    return hours if found else None


def endpoint_gpu_hours(config: dict[str, Any]) -> float | None:
    """GPU-hours of the vLLM job(s) named in the run's endpoint file, or in the endpoint files
    still in its ``endpoint_dir`` (a server's file goes when its job ends: those jobs are missed).
    Only ``job_id`` is read from the files."""
    policy = (config.get("config") or {}).get("policy") or {}
    if not isinstance(policy, dict):
        return None
    if policy.get("endpoint_file"):
        files = [Path(policy["endpoint_file"]).expanduser()]
    elif policy.get("endpoint_dir"):
        files = sorted(Path(policy["endpoint_dir"]).expanduser().glob("*.json"))
    else:
        return None
    hours = [h for h in map(_file_gpu_hours, files) if h is not None]
    return sum(hours) if hours else None


def _file_gpu_hours(path: Path) -> float | None:
    try:
        job = json.loads(path.read_text()).get("job_id")
    except (OSError, ValueError, AttributeError):
        return None
    return sacct_gpu_hours(str(job)) if job is not None else None


def run_capacity(
    store: RunStore, *, cores: int, nodes: list[int] | None = None, per_node: list[int] | None = None, gpu_hours: float | None = None
) -> dict[str, Any]:
    """``capacity`` of one ``RunStore``: every raw row, the accepted count from ``select()``, the
    GPU-hours given (else from sacct of the endpoint file's job) and the stream consumers."""
    rows = store.read(columns=COLUMNS, dedupe=False).to_pylist()
    _, _, counts = store.select(columns=["episode_id"])
    source = "given" if gpu_hours is not None else None
    if gpu_hours is None:
        gpu_hours = endpoint_gpu_hours(store.config() or {})
        source = "sacct of the endpoint files' jobs" if gpu_hours is not None else None
    return capacity(
        rows,
        cores=cores,
        nodes=nodes,
        per_node=per_node,
        accepted=counts.episodes,
        gpu_hours=gpu_hours,
        gpu_hours_source=source,
        consumers=read_consumers(store.path),
    )


# --- text ------------------------------------------------------------------------------------
def format_capacity(cap: dict[str, Any]) -> str:
    """The capacity dict as plain-text lines and tables."""
    from et_hpc.util import format_table

    ts, io, mem = cap["time_split"], cap["infra_overhead_s"], cap["sandbox_mem_mb"]
    lines = [
        f"capacity: {cap['episodes']} episodes ({cap['ok']} ok) in {num(cap['busy_h'], '{:.2f}')} busy hours: "
        f"{num(cap['episodes_per_hour'])} episodes/hour",
        f"model time {pct(cap['model_share'])} of episode wall time, agent commands {pct(cap['exec_share'])}",
        f"infra overhead per episode (setup+score+teardown+queue): median {num(io['median'], '{:.2f}')} s, "
        f"p95 {num(io['p95'], '{:.2f}')} s; without queue: median {num(cap['node_overhead_s']['median'], '{:.2f}')} s, "
        f"p95 {num(cap['node_overhead_s']['p95'], '{:.2f}')} s",
        f"sandbox peak memory: median {num(mem['median'])} MB, p95 {num(mem['p95'])} MB, max {num(mem['max'])} MB; "
        f"peak processes max {cap['sandbox_pids_max'] if cap['sandbox_pids_max'] is not None else '-'}",
        "",
        format_table(
            ["part", "median s", "p95 s", "mean s"],
            [[k, num(d["median"], "{:.3f}"), num(d["p95"], "{:.3f}"), num(d["mean"], "{:.3f}")] for k, d in ts.items()],
        ),
        "",
        format_table(
            ["node", "episodes", "busy h", "episodes/hour", "mean concurrent"],
            [
                [h["key"], h["episodes"], num(h["busy_h"], "{:.3f}"), num(h["episodes_per_hour"]), num(h["mean_concurrency"], "{:.2f}")]
                for h in cap["by_host"]
            ],
        ),
        "",
        format_table(
            ["worker", "episodes", "busy h", "episodes/hour"],
            [[w["key"], w["episodes"], num(w["busy_h"], "{:.3f}"), num(w["episodes_per_hour"])] for w in cap["by_worker"]],
        ),
    ]
    pr = cap["projection"]
    lines += [
        "",
        f"projection: {pr['model']}.",
        f"measured T {num(pr['episode_s'], '{:.2f}')} s, c {num(pr['cpu_s'], '{:.2f}')} s; C {pr['cores_per_node']} "
        f"(--cores); CPU-bound above K = {num(pr['cpu_bound_at_k'])} per node",
    ]
    if pr["rows"]:
        lines.append(
            format_table(
                ["nodes", "episodes per node", "episodes/hour", "bound by"],
                [[r["nodes"], r["per_node"], num(r["episodes_per_hour"]), r["bound"]] for r in pr["rows"]],
            )
        )
    tr = cap["trainer"]
    lines += [
        "",
        f"trainer: {tr['accepted_episodes'] if tr['accepted_episodes'] is not None else '-'} accepted episodes "
        "(ok, in groups without an error member)"
        + (
            f"; {num(tr['gpu_hours'], '{:.2f}')} GPU-hours ({tr['gpu_hours_source']}): "
            f"{num(tr['accepted_per_gpu_hour'])} accepted episodes per GPU-hour"
            if tr["gpu_hours"]
            else "; GPU-hours unknown (--gpu-hours X)"
        ),
    ]
    if tr["consumers"]:
        lines.append(
            format_table(
                ["consumer", "groups delivered", "next_batch calls", "trainer waiting", "staleness p50", "staleness p95"],
                [
                    [
                        c["consumer"],
                        c["delivered"] if c["delivered"] is not None else "-",
                        c["calls"],
                        pct(c["wait_fraction"]),
                        num(c["staleness_p50"], "{}"),
                        num(c["staleness_p95"], "{}"),
                    ]
                    for c in tr["consumers"]
                ],
            )
        )
    return "\n".join(lines)
