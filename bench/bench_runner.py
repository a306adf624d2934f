"""Episodes per minute through the runner: local executor at several concurrencies, and Slurm.

    python bench/bench_runner.py                                  # stand-in episodes (sleep 2 s)
    python bench/bench_runner.py --slurm --units 24               # also through Slurm arrays
    python bench/bench_runner.py --demo --slurm --units 32        # real oracle episodes, demo tasks
    python bench/bench_runner.py --runner et_hpc.runner.local:episode_runner --tasks-dir DIR \
        --policy oracle --units 16                                # real episodes of other tasks
    python bench/bench_runner.py ... --append bench/RESULTS.md    # add a section with the table

The stand-in episode runs ``sleep`` in a child process, like an episode waits on apptainer, so
the numbers show the runner's own overhead and how well concurrency overlaps waiting. ``--demo``
runs real episodes (apptainer instance, oracle policy, final tests) on the 4 demo tasks of
``defs/demo``, ``units / 4`` samples each; their images must be built (``et-hpc build defs/demo``).
Through Slurm, concurrency c means ``max(1, c // 2)`` array tasks at once, ``min(c, 2)``
episodes at once in each, and chunks sized so each array slot runs about two array tasks.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from et_hpc.host import slurm as watch  # noqa: E402
from et_hpc.runner.config import RunConfig, SlurmConfig  # noqa: E402
from et_hpc.runner.local import run_local  # noqa: E402
from et_hpc.runner.plan import make_plan, open_store  # noqa: E402
from et_hpc.runner.slurm import submit, task_ids  # noqa: E402
from et_hpc.tasks.model import Recipe, Task  # noqa: E402


def sleep_runner(task: Task, sample: int, cfg: RunConfig, image, stop: threading.Event):
    """A stand-in episode: ``sleep metadata.sleep_s`` in a child process, reward 1."""
    proc = subprocess.Popen(["sleep", str(task.metadata.get("sleep_s", 2))])
    while proc.poll() is None:
        if stop.wait(0.05):
            proc.kill()
    from et_hpc.record import EpisodeRecord

    return EpisodeRecord(run_name=cfg.run_name(), task_id=task.id, sample=sample, status="ok", reward=1.0)


def synthetic_tasks(root: Path, n: int, sleep_s: float) -> list[Task]:
    sif = root / "img.sif"
    sif.write_text("stand-in")
    return [
        Task(id=f"b{i:04d}", prompt="-", recipe=Recipe(kind="sif", path=sif, context_dir=root), source=root, metadata={"sleep_s": sleep_s})
        for i in range(n)
    ]


def lookup(task: Task):
    return SimpleNamespace(status="ok", path=task.recipe.path, digest=None, reason=None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runner", default="bench_runner:sleep_runner", help="unit runner module:function")
    ap.add_argument("--tasks-dir", help="real tasks (their images must be built)")
    ap.add_argument("--demo", action="store_true", help="real oracle episodes on defs/demo (sets --runner, --tasks-dir, --policy)")
    ap.add_argument("--policy", default="oracle")
    ap.add_argument("--units", type=int, default=16)
    ap.add_argument("--sleep-s", type=float, default=2.0)
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--slurm", action="store_true", help="also run through Slurm arrays")
    ap.add_argument("--units-per-task", type=int, default=0, help="slurm chunk size (default: see above)")
    ap.add_argument("--append", type=Path, help="append a markdown section to this file")
    a = ap.parse_args()
    if a.demo:
        a.runner, a.tasks_dir, a.policy = "et_hpc.runner.local:episode_runner", str(HERE.parent / "defs" / "demo"), "oracle"
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    levels = [int(x) for x in a.concurrency.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="et-bench-") as tmp:
        root = Path(tmp)
        tasks = None if a.tasks_dir else synthetic_tasks(root, a.units, a.sleep_s)
        look = None if a.tasks_dir else lookup
        samples = 1
        base = dict(
            store=root / "store", unit_runner=a.runner, policy={"kind": a.policy}, tasks={"tasks_dir": a.tasks_dir} if a.tasks_dir else {}
        )
        if a.demo:
            samples = max(1, a.units // 4)
        elif a.tasks_dir:
            base["tasks"]["sample"] = a.units
        base["samples"] = samples
        for c in levels:
            cfg = RunConfig(name=f"local-c{c}", concurrency=c, **base)
            plan = make_plan(cfg, tasks=tasks, image_lookup=look)
            t0 = time.monotonic()
            res = run_local(plan, progress=False, handle_signals=False)
            dt = time.monotonic() - t0
            rows.append(("local", c, res.ok + res.errors, dt))
            print(f"local c={c}: {res.ok + res.errors} episodes ({res.errors} errors) in {dt:.1f} s", file=sys.stderr)
        for c in levels if a.slurm else []:
            par, per_task = max(1, c // 2), min(c, 2)
            cfg = RunConfig(
                name=f"slurm-c{c}",
                concurrency=per_task,
                executor="slurm",
                slurm=SlurmConfig(cpus_per_task=1, time_min=30, array_parallelism=par, units_per_task=a.units_per_task or 1),
                **base,
            )
            plan = make_plan(cfg, tasks=tasks, image_lookup=look)
            n_units = len(plan.units)
            upt = a.units_per_task or max(1, -(-n_units // (2 * par)))
            cfg.slurm.units_per_task = upt
            t0 = time.monotonic()
            states, _ = watch.wait_tasks(task_ids(submit(plan)), poll_s=1.0, timeout_s=1800)
            dt = time.monotonic() - t0
            done = open_store(plan.run_dir).units()
            n = sum(1 for u in plan.units if u in done)
            rows.append((f"slurm ({par} tasks x {per_task}, {upt}/task)", c, n, dt))
            print(f"slurm c={c}: {n} episodes in {dt:.1f} s, array tasks {watch.counts(states)}", file=sys.stderr)
    table = ["| executor | concurrency | episodes | seconds | episodes/min |", "|---|---|---|---|---|"]
    table += [f"| {e} | {c} | {n} | {dt:.1f} | {60 * n / dt:.1f} |" for e, c, n, dt in rows]
    text = "\n".join(table)
    print(text)
    if a.append:
        what = a.runner if a.runner != "bench_runner:sleep_runner" else f"stand-in episodes (sleep {a.sleep_s:g} s)"
        with open(a.append, "a") as f:
            f.write(
                f"\n## Runner throughput (bench/bench_runner.py)\n{what}, {a.units} units, "
                f"{os.cpu_count()} cores, shared machine.\n\n{text}\n"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
