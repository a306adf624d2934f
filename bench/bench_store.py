"""Benchmark of the run store: write N synthetic episodes as the runner would, compact, read back.

Usage:  python bench/bench_store.py [--records 100000] [--per-file 1,64] [--dir /tmp/x] [--markdown]

For each batch size B (records per shard) it writes the records with ``RunStore.write`` in
batches of B (each shard fsynced and renamed), then times ``read()`` (deduped, all columns),
``read(columns=...)`` without the transcript, ``units()``, ``summary()``, ``compact()`` and the
same reads after compaction. Messages are 2-8 KB of terminal-like JSON per episode.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from et_hpc.record import EpisodeRecord, TestResult, Timings
from et_hpc.runs.store import RunStore

WORDS = [
    "ls",
    "cd",
    "cat",
    "grep",
    "awk",
    "sed",
    "sort",
    "uniq",
    "wc",
    "echo",
    "mkdir",
    "chmod",
    "python3",
    "pytest",
    "config.yaml",
    "data.csv",
    "/home/user",
]


def synthetic(i: int, rng: random.Random, run: str) -> EpisodeRecord:
    target = rng.randint(2000, 8000)
    msgs = [
        {"role": "system", "content": "You are a highly capable Linux terminal agent."},
        {"role": "user", "content": "Task: " + " ".join(rng.choices(WORDS, k=60))},
    ]
    size = sum(len(m["content"]) for m in msgs)
    while size < target:
        cmd = " ".join(rng.choices(WORDS, k=rng.randint(3, 12)))
        out = "\n".join(" ".join(rng.choices(WORDS, k=8)) + f" {rng.randint(0, 10**6)}" for _ in range(rng.randint(2, 12)))
        msgs.append({"role": "assistant", "content": f"<command>{cmd}</command>"})
        msgs.append({"role": "user", "content": f"Command executed successfully. Output: {out}\n\n(exit_code=0)"})
        size += len(cmd) + len(out) + 80
    ok = rng.random() > 0.05
    reward = float(rng.random() > 0.5) if ok else None
    return EpisodeRecord(
        run_name=run,
        task_id=f"task_{i // 8:06d}",
        sample=i % 8,
        split="train",
        policy_kind="vllm",
        model="Qwen/Qwen3-8B",
        sampling_params={"temperature": 0.6, "max_tokens": 2048},
        messages=msgs,
        turns=(len(msgs) - 2) // 2,
        stop_reason="done",
        status="ok" if ok else "infra_error",
        reward=reward,
        passed=int(reward or 0),
        total=1,
        tests=[TestResult(name="test_final.py::test_ok", outcome="passed")],
        prompt_tokens=size // 4,
        completion_tokens=size // 16,
        timings=Timings(start_s=1.7e9 + i, stop_s=1.7e9 + i + 30, agent_s=25.0, score_s=3.0, total_s=30.0),
        image_digest="sha256:" + "ab" * 32,
        image_path="/cache/images/x.sif",
        host="node001",
        slurm_job_id="4242_1",
        slurm_array_task_id=i % 64,
        versions={"et-hpc": "0.1.0", "apptainer": "1.4.5"},
        created_at=datetime.now(timezone.utc),
    )


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def bench(n: int, per_file: int, base: Path) -> dict:
    rng = random.Random(per_file)
    rs = RunStore(base / f"run-b{per_file}")
    res: dict = {"records": n, "per_file": per_file}
    write_s = 0.0
    gen_s = 0.0
    for start in range(0, n, per_file):
        t = time.perf_counter()
        batch = [synthetic(i, rng, rs.name) for i in range(start, min(n, start + per_file))]
        gen_s += time.perf_counter() - t
        dt, _ = timed(lambda: rs.write(batch))  # noqa: B023  (called at once, inside the loop)
        write_s += dt
    res["shards"] = len(rs.shards())
    res["bytes"] = sum(p.stat().st_size for p in rs.shards())
    res["write_s"] = write_s
    res["gen_s"] = gen_s

    def reads(tag: str) -> None:
        res[f"{tag}_read_s"], t = timed(rs.read)
        assert t.num_rows == n, (t.num_rows, n)
        res[f"{tag}_read_nomsg_s"], _ = timed(lambda: rs.read(columns=["task_id", "sample", "status", "reward"]))
        res[f"{tag}_units_s"], u = timed(rs.units)
        assert len(u) == n
        res[f"{tag}_summary_s"], _ = timed(rs.summary)

    reads("before")
    res["compact_s"], c = timed(lambda: rs.compact())
    res["shards_after"] = c.shards_after
    reads("after")
    return res


def to_markdown(results: list[dict]) -> str:
    cols = [
        ("per_file", "records/shard"),
        ("shards", "shards"),
        ("bytes", "MB on disk"),
        ("write_s", "write s"),
        ("before_read_s", "read() s"),
        ("before_units_s", "units() s"),
        ("compact_s", "compact s"),
        ("shards_after", "shards after"),
        ("after_read_s", "read() s after"),
        ("after_read_nomsg_s", "read(4 cols) s after"),
        ("after_units_s", "units() s after"),
        ("after_summary_s", "summary() s after"),
    ]
    lines = ["| records | " + " | ".join(c[1] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for r in results:
        cells = []
        for k, _ in cols:
            v = r[k]
            cells.append(f"{v / 1e6:.0f}" if k == "bytes" else f"{v:.2f}" if isinstance(v, float) else str(v))
        lines.append(f"| {r['records']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--per-file", default="1,64", help="comma-separated records per shard")
    ap.add_argument("--records-single", type=int, default=None, help="records for the 1-record/shard case (default: --records)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir, removed at the end)")
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args()
    base = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="bench-store-"))
    base.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for b in [int(x) for x in a.per_file.split(",")]:
            n = a.records_single if (b == 1 and a.records_single) else a.records
            r = bench(n, b, base)
            print(json.dumps(r), flush=True)
            results.append(r)
    finally:
        if not a.dir:
            shutil.rmtree(base, ignore_errors=True)
    if a.markdown:
        print(f"\nmachine: {os.cpu_count()} cores, {platform.platform()}, python {platform.python_version()}\n")
        print(to_markdown(results))


if __name__ == "__main__":
    main()
