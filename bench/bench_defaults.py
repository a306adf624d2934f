"""Default settings against the defaults of an earlier revision: what a plain ``et-hpc run`` gets.

    python bench/bench_defaults.py --baseline REV                       # c = 1
    python bench/bench_defaults.py --baseline REV --append bench/RESULTS.md

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="git revision whose defaults are compared")
    ap.add_argument("--concurrency", default="1")
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
        for c in concs:
            for shape, units in (("groups (4 per image)", 16), ("evaluation (1 per image)", 4)):
                scratch = t / f"scratch-{c}-{units}"
                scratch.mkdir(mode=0o700)
                base_rate = None
                for label, tree, env in (("baseline", base_tree, {"ET_HPC_SCRATCH": str(t / f"base-{c}-{units}")}),
                                         ("now, fresh node", REPO, {"ET_HPC_SCRATCH": str(scratch)}),
                                         ("now", REPO, {"ET_HPC_SCRATCH": str(scratch)})):
                    name = f"{label.split(',')[0]}{'-fresh' if 'fresh' in label else ''}-c{c}-u{units}"
                    wall, ts = run_once(tree, t / "store", name, units, c, None, env)
                    meta = json.loads((t / "store" / name / "run.json").read_text())
                    sb = meta["plan"].get("sandbox") or {}
                    chosen = f"warm {sb['warm']}, {sb['local_copy']}" if "warm" in sb else "warm 0, auto (old)"
                    rate = 60 * units / wall
                    base_rate = base_rate or rate
                    oh = [overhead(x) for x in ts]
                    med = {k: statistics.median([x[k] for x in ts if x.get(k) is not None] or [float("nan")])
                           for k in ("setup_s", "score_s")}
                    rows.append(f"| {shape} | {c} | {label} | {chosen} | {rate:.1f} | {rate / base_rate:.2f}x | "
                                f"{statistics.median(oh):.2f} / {pct(oh, 0.95):.2f} | {med['setup_s']:.3f} | "
                                f"{med['score_s']:.2f} |")
                    print(f"{name}: {wall:.1f} s, {rate:.1f} episodes/min ({chosen})", file=sys.stderr)
    load = os.getloadavg()
    lines = [f"`python bench/bench_defaults.py --baseline {a.baseline} --concurrency {a.concurrency}` at {rev}: "
             f"real oracle episodes on the 4 demo tasks with no --set, load average {load[0]:.1f} at the end.", "",
             "| shape | concurrency | setting | chosen | episodes/min | x baseline | overhead median / p95 s | "
             "setup median s | scoring median s |",
             "|---|---|---|---|---|---|---|---|---|", *rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.append:
        with open(a.append, "a") as f:
            f.write("\n## Default settings against the old defaults (bench/bench_defaults.py)\n\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
