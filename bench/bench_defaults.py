"""Default settings against the defaults of an earlier revision: what a plain ``et-hpc run`` gets.

    python bench/bench_defaults.py --baseline REV                       # c = 1
    python bench/bench_defaults.py --baseline REV --rounds 2 --append bench/RESULTS.md

Every run is ``et-hpc run defs/demo --policy oracle --samples S --concurrency C`` with no
``--set`` at all (real episodes on the 4 demo tasks through the local executor, one process each,
as bench/bench_throughput.py runs them), in two shapes:

- *groups*: ``--samples 4`` (16 episodes, 4 per image on this node): "auto" picks the warm pool and
  unpacked images (et_hpc.runner.fastpath);
- *evaluation*: ``--samples 1`` (4 episodes, one per image): unpacking does not pay, "auto" starts
  from the SIF.

Settings, interleaved per shape: ``baseline`` (the revision ``--baseline`` from git: its
defaults, warm 0 and no local copy on one filesystem), ``now, fresh node`` (this tree's defaults
on an empty scratch directory: a first run pays the unpacking inside its wall time) and ``now``
(this tree's defaults again on the same scratch: the trees are there, as for every later run on
the node). Each setting has its own store; episodes/min is episodes over the command's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_throughput import REPO, overhead, pct, run_once

SHAPES = (("groups (4 per image)", 16), ("evaluation (1 per image)", 4))
LABELS = ("baseline", "now, fresh node", "now")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="git revision whose defaults are compared")
    ap.add_argument("--concurrency", default="1")
    ap.add_argument("--rounds", type=int, default=1, help="each round runs every setting once, fresh scratch each")
    ap.add_argument("--append", type=Path, help="append a markdown section to this file")
    a = ap.parse_args()
    concs = [int(c) for c in a.concurrency.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="et-bench-defaults-") as tmp:
        t = Path(tmp)
        base_tree = t / "baseline"
        base_tree.mkdir()
        git = ["git", "-c", "safe.directory=*", "-C", str(REPO)]
        archive = subprocess.run([*git, "archive", "--format=tar", a.baseline], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(base_tree)], input=archive.stdout, check=True)
        rev = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        walls: dict[tuple, list[float]] = {}
        timings: dict[tuple, list[dict]] = {}
        chosen: dict[tuple, str] = {}
        for rnd in range(a.rounds):
            for c in concs:
                for shape, units in SHAPES:
                    scratch = t / f"scratch-{c}-{units}-r{rnd}"
                    scratch.mkdir(mode=0o700)
                    for label, tree, env in (
                        ("baseline", base_tree, {"ET_HPC_SCRATCH": str(t / f"base-{c}-{units}")}),
                        ("now, fresh node", REPO, {"ET_HPC_SCRATCH": str(scratch)}),
                        ("now", REPO, {"ET_HPC_SCRATCH": str(scratch)}),
                    ):
                        name = f"{label.split(',')[0]}{'-fresh' if 'fresh' in label else ''}-c{c}-u{units}-r{rnd}"
                        wall, ts = run_once(tree, t / "store", name, units, c, None, env)
                        meta = json.loads((t / "store" / name / "run.json").read_text())
                        sb = meta["plan"].get("sandbox") or {}
                        key = (shape, units, c, label)
                        chosen[key] = f"warm {sb['warm']}, {sb['local_copy']}" if "warm" in sb else "warm 0, auto (old)"
                        walls.setdefault(key, []).append(wall)
                        timings.setdefault(key, []).extend(ts)
                        print(f"{name}: {wall:.1f} s, {60 * units / wall:.1f} episodes/min ({chosen[key]})", file=sys.stderr)
        for c in concs:
            for shape, units in SHAPES:
                base_rate = None
                for label in LABELS:
                    key = (shape, units, c, label)
                    ws, ts = walls[key], timings[key]
                    rate = 60 * units * len(ws) / sum(ws)
                    base_rate = base_rate or rate
                    oh = [overhead(x) for x in ts]
                    med = {
                        k: statistics.median([x[k] for x in ts if x.get(k) is not None] or [float("nan")]) for k in ("setup_s", "score_s")
                    }
                    rows.append(
                        f"| {shape} | {c} | {label} | {chosen[key]} | {rate:.1f} | {rate / base_rate:.2f}x | "
                        f"{statistics.median(oh):.2f} / {pct(oh, 0.95):.2f} | {med['setup_s']:.3f} | "
                        f"{med['score_s']:.2f} |"
                    )
    load = os.getloadavg()
    lines = [
        f"`python bench/bench_defaults.py --baseline {a.baseline} --concurrency {a.concurrency} --rounds {a.rounds}` "
        f"at {rev}: "
        f"real oracle episodes on the 4 demo tasks with no --set, load average {load[0]:.1f} at the end.",
        "",
        "| shape | concurrency | setting | chosen | episodes/min | x baseline | overhead median / p95 s | "
        "setup median s | scoring median s |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.append:
        with open(a.append, "a") as f:
            f.write("\n## Default settings against the old defaults (bench/bench_defaults.py)\n\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
