"""Task loading speed: how long load_tasks and recipe normalisation take for many task folders.

Makes N task folders (symlinked copies of the real native and Harbor fixtures) in a temporary
directory, then times: loading the folder, loading with validate=True (every def parsed and every
Dockerfile converted), filtering by glob and sampling, and the SkyRL parquet with remapping.

    python bench/bench_tasks.py --n 2000
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from et_hpc.tasks.loader import load_tasks

FIX = Path(os.environ.get("ET_HPC_FIXTURES", Path(__file__).resolve().parents[1] / "tests/fixtures/endless-terminals"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000, help="number of task folders to make")
    a = ap.parse_args()
    srcs = sorted((FIX / "native").iterdir()) + sorted((FIX / "harbor").iterdir())
    bm = {"ubuntu_22.04.sif": Path("/nonexistent/base.sif")}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "tasks"
        root.mkdir()
        for i in range(a.n):
            s = srcs[i % len(srcs)]
            shutil.copytree(s, root / f"{s.name}_{i:05d}", copy_function=os.symlink)
        rows = []

        def timed(label, fn):
            t = time.perf_counter()
            res = fn()
            dt = time.perf_counter() - t
            rows.append((label, len(res.tasks), dt))
            print(f"{label:45s} {len(res.tasks):6d} tasks  {dt:7.2f} s  {1000 * dt / max(1, len(res.tasks)):6.2f} ms/task")

        timed(f"load folder of {a.n}", lambda: load_tasks(root, progress=False))
        timed(f"load + validate (parse/convert) {a.n}", lambda: load_tasks(root, validate=True, base_map=bm, progress=False))
        timed("glob task_000000_3* then sample 50", lambda: load_tasks(root, glob="task_000000_3*", sample=50, progress=False))
        timed("skyrl parquet x2, remapped", lambda: load_tasks(FIX / "skyrl", tasks_dir=FIX, progress=False))


if __name__ == "__main__":
    main()
