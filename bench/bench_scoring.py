"""Scoring duration: the host entry path (et_hpc.scoring.enter), where its time goes, and the old path.

    python bench/bench_scoring.py [--rounds 10] [--task defs/demo/demo_csv_sum] [--no-legacy]
                                  [--fresh [--agent-s 3]]

With ``--fresh`` every round scores a new sandbox once, as an episode does (the first scoring of
an instance reads the pristine tree through a fresh squashfuse mount: cold), ``--agent-s``
seconds after its first shell started (the agent's turns; the scoring warm-up started with the
instance runs meanwhile, where the code has one). Without it, one
sandbox on the task's cached image is scored ``--rounds`` times (warm), and the rounds
alternate ``scoring.score`` (the real path) and the old entry (``apptainer exec instance://`` +
the pristine python, the driver kept in tests/helpers/legacy_scoring.py for the red team's positive controls) and
prints the median of each, then the median time of each stage of the real path (the stage
marks in ``ScoreResult.stages``: host, entry helper, driver in the instance, pytest) with the
median time spent since the stage before.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

# The stage marks in the order they happen, and what the time up to each one is spent on.
STAGES = [
    ("shells_closed_first", "close the agent's shells (the code before: first)"),
    ("instance_found", "prepare (no-op) + init pid (cached)"),
    ("swept", "stop and kill the agent's processes from the host, then close its shells"),
    ("config", "scoring config, helper argv"),
    ("helper_spawned", "fork+exec of the host helper"),
    ("helper_start", "host python start-up"),
    ("imported", "helper imports (ctypes, json, subprocess)"),
    ("config_read", "config over stdin"),
    ("entered", "setns user/mnt/pid/net/ipc, root checks"),
    ("private_mounts", "unshare(CLONE_NEWNS), / rprivate"),
    ("killed", "fork into the pid ns, check nothing outlived the sweep"),
    ("view", "the tests' root: the agent's state, the image's runtime files"),
    ("tmpfs", "tmpfs on the pristine tree, test file, ini"),
    ("pytest_spawned", "fork, rlimits, caps dropped, exec of the pristine loader"),
    ("py_start", "pristine python start-up (loader, -I -S)"),
    ("py_pytest_imported", "site dirs, import pytest"),
    ("py_session_start", "pytest config, plugins, options"),
    ("py_collected", "collect (assertion rewrite) the test file"),
    ("py_tests_done", "run the tests"),
    ("py_fenced", "fence: kill every other process"),
    ("py_end", "report written, pytest shutdown"),
    ("pytest_eof", "pytest exit seen by the driver"),
    ("report_read", "wait, last sweep, read the report"),
    ("driver_done", "driver result to the helper"),
    ("helper_done", "helper exit, result to the host"),
    ("result", "parse the report, build the result"),
]


def stage_table(runs: list[dict[str, float]], total: list[float]) -> str:
    lines = ["| stage (mark) | spent on | median ms since the previous mark | median ms from start |", "|---|---|---|---|"]
    prev: list[float] = [0.0] * len(runs)
    for key, what in STAGES:
        have = [(i, r[key]) for i, r in enumerate(runs) if key in r]
        if not have:
            continue
        delta = [v - prev[i] for i, v in have]
        for i, v in have:
            prev[i] = v
        lines.append(f"| `{key}` | {what} | {statistics.median(delta) * 1000:.1f} | {statistics.median(v for _, v in have) * 1000:.1f} |")
    lines.append(f"| total | `scoring.score` | | {statistics.median(total) * 1000:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--task", type=Path, default=ROOT / "defs/demo/demo_csv_sum")
    ap.add_argument("--no-legacy", action="store_true", help="skip the old apptainer-exec path")
    ap.add_argument("--fresh", action="store_true", help="a new sandbox for every round (implies --no-legacy)")
    ap.add_argument("--agent-s", type=float, default=3.0, help="with --fresh: seconds between shell and scoring")
    a = ap.parse_args()
    from et_hpc.images.store import ImageStore
    from et_hpc.sandbox.sandbox import Sandbox
    from et_hpc.scoring import live as scoring
    from et_hpc.tasks.loader import load_task_folder
    from helpers.legacy_scoring import legacy_score

    task = load_task_folder(a.task)
    img = ImageStore().ensure(task)
    new, old, stages = [], [], []

    warmed = []

    def one(sb: Sandbox, agent_s: float = 0.0) -> None:
        sb.shell().run("sleep 300 & true")  # an agent's shell with a background job, as scoring finds it
        time.sleep(agent_s)
        w = getattr(sb, "_warmer", None)
        warmed.append(w is not None and w.poll() is not None)
        t = time.monotonic()
        r = scoring.score(sb, task.final_tests)
        new.append(time.monotonic() - t)
        assert r.status == "ok", r.error
        stages.append(getattr(r, "stages", {}))

    if a.fresh:
        with Sandbox(img.path, run_prefix="bench-score"):  # overlay template and host page cache warm
            pass
        for _ in range(a.rounds):
            with Sandbox(img.path, run_prefix="bench-score") as sb:
                one(sb, a.agent_s)
    else:
        with Sandbox(img.path, run_prefix="bench-score") as sb:
            for _ in range(a.rounds):
                one(sb)
                if not a.no_legacy:
                    t = time.monotonic()
                    legacy_score(sb, task.final_tests)
                    old.append(time.monotonic() - t)
    print(f"load average: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    for name, xs in (("host entry (now)", new), ("apptainer exec (before)", old)):
        if xs:
            print(f"{name:24s} median {statistics.median(xs):.3f} s  min {min(xs):.3f}  max {max(xs):.3f}")
    if a.fresh:
        print(f"scoring warm-up over before scoring began in {sum(warmed)} of {len(warmed)} rounds")
    print()
    print(stage_table(stages, new))


if __name__ == "__main__":
    main()
