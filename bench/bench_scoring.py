"""Scoring duration: the host entry path (et_hpc.sandbox.enter) against the old apptainer-exec path.

    python bench/bench_scoring.py [--rounds 10] [--task defs/demo/demo_csv_sum]

Starts one sandbox on the task's cached image, then alternates ``scoring.score`` (the real path)
and the old entry (``apptainer exec instance://`` + the pristine python, the driver kept in
tests/test_redteam_entry.py for positive controls) and prints the median of each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--task", type=Path, default=ROOT / "defs/demo/demo_csv_sum")
    a = ap.parse_args()
    import test_redteam_entry as rt
    from et_hpc import scoring
    from et_hpc.images.store import ImageStore
    from et_hpc.sandbox.sandbox import Sandbox
    from et_hpc.tasks.loader import load_task_folder

    task = load_task_folder(a.task)
    img = ImageStore().ensure(task)
    new, old = [], []
    with Sandbox(img.path, run_prefix="bench-score") as sb:
        sb.shell().run("true")
        for _ in range(a.rounds):
            t = time.monotonic()
            r = scoring.score(sb, task.final_tests)
            new.append(time.monotonic() - t)
            assert r.status == "ok", r.error
            t = time.monotonic()
            rt.legacy_score(sb, task.final_tests)
            old.append(time.monotonic() - t)
    for name, xs in (("host entry (now)", new), ("apptainer exec (before)", old)):
        print(f"{name:24s} median {statistics.median(xs):.3f} s  min {min(xs):.3f}  max {max(xs):.3f}")


if __name__ == "__main__":
    main()
