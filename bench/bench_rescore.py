"""Kept final states and rescoring: archive size and teardown cost per episode, rescoring against live.

    python bench/bench_rescore.py                      # 4 demo tasks x 2 samples, concurrency 1
    python bench/bench_rescore.py --samples 4 --append bench/RESULTS.md

Real oracle episodes of ``defs/demo`` through the local runner, once without and once with
``sandbox.keep_final_state`` (same concurrency), then ``et-hpc rescore`` of the kept run with the
tasks' own tests (so every reward must stay 1.0). Per episode: the kept archive's size, the
teardown (which includes archiving), the live episode's ``total_s`` and its ``score_s``, and the
rescore's per-episode total (unpack, check, start, tests, stop: its ``events`` line). Episodes/min
is each run's episodes over its wall time. The images must be built (``et-hpc build defs/demo``).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEMO = HERE.parent / "defs" / "demo"


def _cli(args: list[str], env_store: Path) -> float:
    t = time.monotonic()
    cp = subprocess.run([sys.executable, "-m", "et_hpc.cli", *args, "--store", str(env_store)], capture_output=True, text=True)
    if cp.returncode != 0:
        sys.exit(f"{' '.join(args[:2])} failed: {cp.stderr[-1500:]}")
    return time.monotonic() - t


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f}" if xs else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--append", type=Path)
    a = ap.parse_args()
    from et_hpc.record import records_from_table
    from et_hpc.runs import final_state as fs
    from et_hpc.runs.store import RunStore

    root = Path(tempfile.mkdtemp(prefix="bench-rescore-"))
    run = ["run", str(DEMO), "--policy", "oracle", "--samples", str(a.samples), "--concurrency", str(a.concurrency)]
    wall = {
        "live": _cli([*run, "--run-name", "plain"], root),
        "kept": _cli([*run, "--run-name", "kept", "--set", "sandbox.keep_final_state=true"], root),
        "rescore": _cli(["rescore", "kept", "--task-source", str(DEMO), "--run-name", "again", "--concurrency", str(a.concurrency)], root),
    }
    plain = records_from_table(RunStore(root / "plain").read())
    kept = records_from_table(RunStore(root / "kept").read())
    again = records_from_table(RunStore(root / "again").read())
    assert all(r.reward == 1.0 for r in again), [(r.task_id, r.reward, r.error) for r in again]
    n = len(kept)
    rows = []
    for tid in sorted({r.task_id for r in kept}):
        sizes = [fs.size_of(root / "kept", r.final_state) or 0 for r in kept if r.task_id == tid]
        rows.append(
            f"| {tid} | {statistics.median(sizes) / 1024:.1f} KiB | "
            f"{_med([r.timings.teardown_s for r in plain if r.task_id == tid])} | "
            f"{_med([r.timings.teardown_s for r in kept if r.task_id == tid])} |"
        )
    resc = [float(m.group(1)) for r in again for e in r.events if (m := re.search(r"rescore: .* total ([0-9.]+) s", e))]
    lines = [
        "## Kept final states and rescoring (bench/bench_rescore.py)\n",
        f"{n} oracle episodes of the 4 demo tasks ({a.samples} samples each), concurrency {a.concurrency}, local runner, 2-core VM.\n",
        "| task | kept archive (median) | teardown without keeping, s | teardown with keeping, s |",
        "|---|---|---|---|",
        *rows,
        "",
        "| per episode (median) | live, without keeping | live, keeping | rescore (same tests) |",
        "|---|---|---|---|",
        f"| episode total_s / rescore total, s | {_med([r.timings.total_s for r in plain])} | "
        f"{_med([r.timings.total_s for r in kept])} | {_med(resc)} |",
        f"| score_s, s | {_med([r.timings.score_s for r in plain])} | {_med([r.timings.score_s for r in kept])} | "
        f"{_med([r.timings.score_s for r in again])} |",
        f"| episodes/min (run wall time, CLI start included) | {60 * n / wall['live']:.1f} | "
        f"{60 * n / wall['kept']:.1f} | {60 * n / wall['rescore']:.1f} |",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if a.append:
        with open(a.append, "a") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
