"""Warm sandboxes (sandbox.warm): per-episode infrastructure overhead and episodes/min, warm vs cold.

    python bench/bench_warm.py                                   # 8 oracle episodes per run, 2 rounds
    python bench/bench_warm.py --units 16 --rounds 3 --warm 2 --concurrency 1
    python bench/bench_warm.py ... --append bench/RESULTS.md     # add a section with the table

Real oracle episodes (apptainer instance, oracle commands, final tests) on the 4 demo tasks of
``defs/demo`` (``units / 4`` samples each) through the local runner at one concurrency, with
``sandbox.warm=0`` and ``sandbox.warm=K`` in alternating rounds in the same process. The images
must be built (``et-hpc build defs/demo``).

Per episode, *overhead* is everything but the agent's commands and model time: ``total_s`` minus
``exec_s`` and ``model_s`` when the record has them, else minus ``agent_s`` (the agent loop: the
oracle's commands, no model). It is setup on the critical path, scoring, teardown and the runner's
bookkeeping inside the episode. *setup* is ``timings.setup_s`` (with a warm sandbox, its
hand-out), *warm start* ``timings.warm_s`` (done ahead, off the critical path). Episodes/min is
the run's episodes over its wall time, which also counts what happens between episodes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from et_hpc.runner.config import RunConfig  # noqa: E402
from et_hpc.runner.local import run_local  # noqa: E402
from et_hpc.runner.plan import make_plan, open_store  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def overhead(t: dict) -> tuple[float, str]:
    if t.get("exec_s") is not None and t.get("model_s") is not None:
        return t["total_s"] - t["exec_s"] - t["model_s"], "total - exec - model"
    return t["total_s"] - (t.get("agent_s") or 0.0), "total - agent"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--units", type=int, default=8, help="episodes per run (a multiple of 4)")
    ap.add_argument("--rounds", type=int, default=2, help="runs per setting, alternating")
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--append", type=Path, help="append a markdown section to this file")
    a = ap.parse_args()
    settings = [0, a.warm]
    recs: dict[int, list[dict]] = {k: [] for k in settings}
    walls: dict[int, list[tuple[int, float]]] = {k: [] for k in settings}
    with tempfile.TemporaryDirectory(prefix="et-bench-warm-") as tmp:
        for r in range(a.rounds):
            for k in settings:
                cfg = RunConfig(
                    name=f"bw-{r}-w{k}",
                    store=Path(tmp) / "store",
                    policy={"kind": "oracle"},
                    tasks={"source": str(HERE.parent / "defs" / "demo")},
                    samples=max(1, a.units // 4),
                    concurrency=a.concurrency,
                    sandbox={"warm": k},
                )
                plan = make_plan(cfg)
                t0 = time.monotonic()
                res = run_local(plan, progress=False, handle_signals=False)
                dt = time.monotonic() - t0
                rows = open_store(plan.run_dir).read().to_pylist()
                bad = [x for x in rows if x["status"] != "ok"]
                recs[k] += [x for x in rows if x["status"] == "ok"]
                walls[k].append((res.ok + res.errors, dt))
                print(
                    f"round {r} warm={k}: {res.ok} ok, {res.errors} errors in {dt:.1f} s"
                    + (f" ({bad[0]['status']}: {bad[0]['error']})" if bad else ""),
                    file=sys.stderr,
                )
    table = [
        "| sandbox.warm | episodes | overhead median s | overhead p95 s | setup median s | setup p95 s "
        "| warm start median s | score median s | teardown median s | episodes/min |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    how = set()
    for k in settings:
        ts = [x["timings"] for x in recs[k]]
        ov = []
        for t in ts:
            v, h = overhead(t)
            ov.append(v)
            how.add(h)
        setup = [t["setup_s"] for t in ts]
        warm = [t["warm_s"] for t in ts if t.get("warm_s") is not None]
        n = sum(e for e, _ in walls[k])
        wall = sum(d for _, d in walls[k])
        table.append(
            f"| {k} | {len(ts)} | {statistics.median(ov):.3f} | {pct(ov, 0.95):.3f} | {statistics.median(setup):.3f} "
            f"| {pct(setup, 0.95):.3f} | {statistics.median(warm) if warm else float('nan'):.3f} "
            f"| {statistics.median(t['score_s'] for t in ts):.3f} | {statistics.median(t['teardown_s'] for t in ts):.3f} "
            f"| {60 * n / wall:.1f} |"
        )
    text = "\n".join(table)
    print(text)
    if a.append:
        with open(a.append, "a") as f:
            f.write(
                f"\n## Warm sandboxes (bench/bench_warm.py)\n`python bench/bench_warm.py --units {a.units} "
                f"--rounds {a.rounds} --warm {a.warm} --concurrency {a.concurrency}`: oracle episodes on "
                f"defs/demo at concurrency {a.concurrency}, warm=0 and warm={a.warm} in alternating rounds, "
                f"{os.cpu_count()} cores. Overhead = {' / '.join(sorted(how))}.\n\n{text}\n"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
