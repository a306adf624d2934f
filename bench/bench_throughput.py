"""Oracle throughput and per-episode overhead: this tree against an earlier revision, in one run.

    python bench/bench_throughput.py                                  # against 7986464, c = 1,2,4
    python bench/bench_throughput.py --baseline REV --units 16 --concurrency 1,2,4 --warm 2
    python bench/bench_throughput.py ... --append bench/RESULTS.md    # add a section with the tables

Each setting is one ``et-hpc run defs/demo --policy oracle`` of ``--units`` real episodes (the
4 demo tasks x units/4 samples: an apptainer instance each, the oracle's commands, the final
tests) through the local executor, started as its own process from a source tree:

- ``baseline``: the revision ``--baseline`` unpacked from git into a temporary folder (the code as
  it was, re-measured here rather than quoted from an older run);
- ``now``: this tree with ``sandbox.warm=0``;
- ``now+warm``: this tree with ``sandbox.warm=K``;
- ``now+warm+unpack``: the same with ``sandbox.local_copy=unpack`` (instances start from the
  images unpacked once on this node; an unmeasured run of 4 episodes unpacks them first and its
  wall time is printed as the one-time cost).

The settings are interleaved round by round, so load from elsewhere hits them alike. Per
episode, *overhead* is everything but the agent's own commands and model time: ``total_s`` minus
``exec_s`` and ``model_s`` where the record has them, else minus ``agent_s``. *Setup* is setup on
the critical path (with a warm sandbox, its hand-out), *scoring* the final tests. Episodes/min is
units over the command's wall time (process start to exit, so it includes start-up and the
run's bookkeeping). The images must be built (``et-hpc build defs/demo``) and the baseline must
use the same image keys (it does for every revision of this project so far).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))] if xs else float("nan")


def overhead(t: dict) -> float:
    if t.get("exec_s") is not None and t.get("model_s") is not None:
        return t["total_s"] - t["exec_s"] - t["model_s"]
    return t["total_s"] - (t.get("agent_s") or 0.0)


def run_once(
    tree: Path, store: Path, name: str, units: int, conc: int, sets: list[str] | None, extra_env: dict[str, str] | None = None
) -> tuple[float, list[dict]]:
    cmd = [
        sys.executable,
        "-m",
        "et_hpc.cli",
        "run",
        str(REPO / "defs" / "demo"),
        "--policy",
        "oracle",
        "--samples",
        str(units // 4),
        "--concurrency",
        str(conc),
        "--store",
        str(store),
        "--run-name",
        name,
        "--json",
        "--no-compact",
    ]
    for kv in sets or []:
        cmd += ["--set", kv]
    env = dict(os.environ, PYTHONPATH=str(tree), **(extra_env or {}))
    t0 = time.monotonic()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree, timeout=3600)
    wall = time.monotonic() - t0
    if r.returncode != 0:
        raise SystemExit(f"{name}: exit {r.returncode}: {r.stderr[-2000:]}")
    rows = []
    for p in sorted((store / name).glob("part-*.parquet")):
        rows += pq.read_table(p, columns=["status", "reward", "timings"]).to_pylist()
    bad = [r for r in rows if r["status"] != "ok" or r["reward"] != 1.0]
    if len(rows) != units or bad:
        raise SystemExit(f"{name}: {len(rows)} records, {len(bad)} not ok with reward 1.0")
    return wall, [r["timings"] for r in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="7986464", help="git revision to compare with")
    ap.add_argument("--units", type=int, default=16, help="episodes per run (a multiple of 4)")
    ap.add_argument("--concurrency", default="1,2,4")
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--append", type=Path, help="append a markdown section to this file")
    a = ap.parse_args()
    concs = [int(c) for c in a.concurrency.split(",")]
    warm, unpack = f"sandbox.warm={a.warm}", "sandbox.local_copy=unpack"
    settings = [
        ("baseline", None),
        ("now", ["sandbox.warm=0"]),
        (f"now+warm{a.warm}", [warm]),
        (f"now+warm{a.warm}+unpack", [warm, unpack]),
    ]
    walls: dict[tuple[str, int], list[float]] = {}
    timings: dict[tuple[str, int], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="et-bench-tp-") as tmp:
        base_tree = Path(tmp) / "baseline"
        base_tree.mkdir()
        git = ["git", "-c", "safe.directory=*", "-C", str(REPO)]  # read-only: works on a checkout of another user
        archive = subprocess.run([*git, "archive", "--format=tar", a.baseline], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(base_tree)], input=archive.stdout, check=True)
        rev = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        wall, _ = run_once(REPO, Path(tmp) / "store", "unpack-first", 4, 1, [unpack])
        print(f"unpack-first: {wall:.1f} s for 4 episodes (unpacks the images not yet on this node)", file=sys.stderr)
        for rnd in range(a.rounds):
            for c in concs:
                for label, sets in settings:
                    tree = base_tree if label == "baseline" else REPO
                    name = f"{label.replace('+', '-')}-c{c}-r{rnd}"
                    wall, ts = run_once(tree, Path(tmp) / "store", name, a.units, c, sets)
                    walls.setdefault((label, c), []).append(wall)
                    timings.setdefault((label, c), []).extend(ts)
                    print(f"{name}: {wall:.1f} s, {60 * a.units / wall:.1f} episodes/min", file=sys.stderr)
    load = os.getloadavg()
    lines = [
        f"`python bench/bench_throughput.py --baseline {a.baseline} --units {a.units} --concurrency {a.concurrency} "
        f"--warm {a.warm} --rounds {a.rounds}` at {rev}: real oracle episodes on the 4 demo tasks, "
        f"load average {load[0]:.1f} at the end.",
        "",
        "| setting | concurrency | episodes/min | x baseline | overhead median / p95 s | setup median s | "
        "scoring median s | teardown median s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    out = {}
    for c in concs:
        base_rate = None
        for label, _ in settings:
            ws, ts = walls[(label, c)], timings[(label, c)]
            rate = 60 * a.units * len(ws) / sum(ws)
            base_rate = base_rate or rate
            oh = [overhead(t) for t in ts]

            def med(k: str, ts: list[dict] = ts) -> float:
                return statistics.median([t[k] for t in ts if t.get(k) is not None] or [float("nan")])

            out[f"{label}-c{c}"] = {"episodes_per_min": rate, "overhead_median_s": statistics.median(oh), "overhead_p95_s": pct(oh, 0.95)}
            lines.append(
                f"| {label} | {c} | {rate:.1f} | {rate / base_rate:.2f}x | {statistics.median(oh):.2f} / "
                f"{pct(oh, 0.95):.2f} | {med('setup_s'):.3f} | {med('score_s'):.2f} | {med('teardown_s'):.2f} |"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    print(json.dumps(out, indent=1), file=sys.stderr)
    if a.append:
        with open(a.append, "a") as f:
            f.write("\n## Oracle throughput against the round's start (bench/bench_throughput.py)\n\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
