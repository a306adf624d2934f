"""Oracle episodes per minute on 1, 2 and 3 nodes of the multi-node rig (docs/rig.md), beside
``et-hpc status --capacity``'s projection for the same setup.

    python bench/bench_rig.py                      # 8 episodes (2 demo tasks x 4) per setting
    python bench/bench_rig.py --samples 2 --nodes 1,3 --tasks demo_hello_file

Each setting is one ``et-hpc run defs/demo --policy oracle --executor slurm`` (``--tasks``: which
demo tasks, their images built) on partition
``multi``, its array tasks kept to the first N nodes (``--exclude`` the others), 2-core array
tasks of ``--units-per-task`` units each. Episodes/min is units over the command's wall time
(submission, Slurm's scheduling and the array tasks' start-up included). The projection is
``et-hpc status RUN --capacity --nodes N --cores 2`` on that run. The rig's nodes share this
machine's 2 cores: compare projection and measurement, do not expect speed-up.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NODES = ("rig1", "rig2", "rig3")


def one(store: Path, n: int, samples: int, per_task: int, tasks: list[str]) -> tuple[int, float, str]:
    name = f"rig-{n}n"
    exclude = ",".join(NODES[n:])
    sets = [
        f"tasks.ids=[{','.join(tasks)}]",
        "slurm.partition=multi",
        "slurm.cpus_per_task=2",
        f"slurm.units_per_task={per_task}",
        "slurm.poll_s=2",
        "slurm.time_min=30",
    ]
    if exclude:
        sets.append(f"slurm.additional_parameters={{exclude: '{exclude}'}}")
    cmd = [sys.executable, "-m", "et_hpc.cli", "run", str(REPO / "defs" / "demo"), "--policy", "oracle", "--samples", str(samples)]
    cmd += ["--executor", "slurm", "--store", str(store), "--run-name", name]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if r.returncode != 0:
        sys.exit(f"{name} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    cap = subprocess.run(
        [sys.executable, "-m", "et_hpc.cli", "status", str(store / name), "--capacity", "--nodes", str(n), "--cores", "2"],
        capture_output=True,
        text=True,
    ).stdout
    return samples * len(tasks), wall, cap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--tasks", default="demo_hello_file,demo_csv_sum")
    ap.add_argument("--units-per-task", type=int, default=2)
    ap.add_argument("--nodes", default="1,2,3")
    args = ap.parse_args()
    store = Path(tempfile.mkdtemp(prefix="bench-rig-", dir=Path.home()))  # shared by every node
    print(f"load before: {os.getloadavg()[0]:.1f}")
    for n in map(int, args.nodes.split(",")):
        units, wall, cap = one(store, n, args.samples, args.units_per_task, args.tasks.split(","))
        print(f"\n## {n} node(s): {units} episodes in {wall:.1f} s = {units / wall * 60:.1f} episodes/min")
        print("\n".join(line for line in cap.splitlines() if line.strip()))
    print(f"\nload after: {os.getloadavg()[0]:.1f}; store: {store}")


if __name__ == "__main__":
    main()
