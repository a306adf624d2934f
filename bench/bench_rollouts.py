"""Continuous rollouts: stream latency, queue claim throughput, poll cost, episodes/min vs a fixed plan.

    python bench/bench_rollouts.py [--quick] [--no-episodes]

1. claim throughput: P processes race to claim (rename) U pending units; claims/s overall.
2. poll cost: a run whose stream holds 12,500 groups of 8 (100k episodes; slots hard-linked from
   one real shard): time of an empty poll and of reading 10 new groups, with the cursor at the end,
   against the same on a stream of 10 groups.
3. latency, commit -> consumer: a producer process commits groups at random intervals; a consumer
   (RolloutStream, default poll 0.2 s) measures from the commit's start to receipt; p50/p95.
4. real episodes (oracle, demo tasks, local executor, concurrency 2): a fixed-plan run of
   4 tasks x 4 samples against a continuous run of 4 groups of 4 (the same 16 episodes), and the
   latency from a group's last episode ending to the trainer getting it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from et_hpc.record import EpisodeRecord, records_to_table  # noqa: E402
from et_hpc.rollouts import RolloutStream  # noqa: E402
from et_hpc.rollouts.queue import WorkQueue, slot_name  # noqa: E402


def _table(task: str, epoch: int, g: int = 8):
    return records_to_table(
        [
            EpisodeRecord(
                run_name="b",
                task_id=task,
                sample=epoch * g + i,
                group_id=f"{task}@e{epoch}",
                status="ok",
                reward=float(i % 2),
                messages=[{"role": "user", "content": "x" * 400}],
            )
            for i in range(g)
        ]
    )


def _claim_all(run_dir: str, out: str, start: float) -> None:
    q = WorkQueue(run_dir)
    while time.time() < start:
        time.sleep(0.001)
    n = 0
    while q.claim(f"w{os.getpid()}") is not None:
        n += 1
    Path(out).write_text(json.dumps({"n": n, "end": time.time()}))


def bench_claims(tmp: Path, procs: int, units: int) -> dict:
    q = WorkQueue(tmp / "claims").init()
    tasks = [f"t{i}" for i in range(units // 4)]
    for _ in range(4):
        q.enqueue_epoch(tasks, 8)
    ctx = mp.get_context("spawn")
    start = time.time() + 2.0
    ps = [ctx.Process(target=_claim_all, args=(str(q.run_dir), str(tmp / f"c{i}.json"), start)) for i in range(procs)]
    for p in ps:
        p.start()
    for p in ps:
        p.join()
    res = [json.loads((tmp / f"c{i}.json").read_text()) for i in range(procs)]
    total = sum(r["n"] for r in res)
    assert total == len(tasks) * 4, total
    span = max(r["end"] for r in res) - start
    return {"procs": procs, "units": total, "seconds": round(span, 2), "claims_per_s": round(total / span)}


def bench_poll(tmp: Path, groups: int) -> dict:
    run = tmp / f"poll-{groups}"
    q = WorkQueue(run).init()
    src = run / ".one.parquet"
    import pyarrow.parquet as pq

    pq.write_table(_table("t", 0), src)
    for s in range(groups):
        os.link(src, run / slot_name(s))
    q.write_head(groups)
    s = RolloutStream(run, "b", poll_s=0.01)
    s.next_seq = groups  # the cursor at the end
    t = time.perf_counter()
    for _ in range(200):
        assert s.next_batch(1, timeout_s=0) == []
    empty_ms = (time.perf_counter() - t) / 200 * 1000
    for k in range(10):
        os.link(src, run / slot_name(groups + k))
    t = time.perf_counter()
    got = s.next_batch(10, timeout_s=0)
    new_ms = (time.perf_counter() - t) * 1000
    assert len(got) == 10
    s.close()
    return {"groups": groups, "episodes": groups * 8, "empty_poll_ms": round(empty_ms, 3), "read_10_new_ms": round(new_ms, 1)}


def _producer(run_dir: str, n: int) -> None:
    q = WorkQueue(run_dir)
    rng = random.Random(1)
    for _ in range(n):
        lease = q.claim("p")
        t0 = time.time()
        q.commit(lease, _table(lease.unit.task_id, lease.unit.epoch).replace_schema_metadata({b"t0": str(t0).encode()}))
        time.sleep(rng.uniform(0.05, 0.4))


def bench_latency(tmp: Path, n: int) -> dict:
    q = WorkQueue(tmp / "lat").init()
    q.enqueue_epoch([f"t{i}" for i in range(n)], 8)
    s = RolloutStream(q.run_dir, "b")
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_producer, args=(str(q.run_dir), n))
    p.start()
    import pyarrow.parquet as pq

    lats = []
    while len(lats) < n:
        for g in s.next_batch(1, timeout_s=30):
            t0 = float(pq.read_schema(q.run_dir / slot_name(g.seq)).metadata[b"t0"])
            lats.append(g.received_at - t0)
    p.join()
    lats.sort()
    return {
        "groups": n,
        "p50_ms": round(1000 * statistics.median(lats), 1),
        "p95_ms": round(1000 * lats[int(0.95 * (n - 1))], 1),
        "poll_s": s.poll_s,
    }


def bench_episodes(tmp: Path) -> dict:
    et = [sys.executable, "-m", "et_hpc.cli"]
    env = dict(os.environ)
    common = ["--policy", "oracle", "--concurrency", "2", "--store", str(tmp / "store"), "--no-compact"]
    t = time.monotonic()
    r = subprocess.run(
        et + ["run", str(REPO / "defs" / "demo"), "--samples", "4", "--run-name", "fixed", "--json", *common],
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    fixed_s = time.monotonic() - t
    run_dir = tmp / "store" / "cont"
    lats: list[float] = []
    stop = threading.Event()

    def consume() -> None:
        while not (run_dir / "queue").is_dir() and not stop.is_set():
            time.sleep(0.05)
        with RolloutStream(run_dir, "bench") as s:
            while len(lats) < 4 and not stop.is_set():
                for g in s.next_batch(1, timeout_s=1):
                    lats.append(g.received_at - max(rec.timings.stop_s or 0 for rec in g.records))

    th = threading.Thread(target=consume, daemon=True)
    th.start()
    t = time.monotonic()
    r = subprocess.run(
        et
        + [
            "run",
            str(REPO / "defs" / "demo"),
            "--samples",
            "4",
            "--run-name",
            "cont",
            "--continuous",
            "--target-groups",
            "4",
            "--set",
            "continuous.poll_s=0.5",
            "--json",
            *common[:-1],
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    cont_s = time.monotonic() - t
    assert r.returncode == 0, r.stderr[-2000:]
    th.join(30)
    stop.set()
    return {
        "episodes": 16,
        "fixed_s": round(fixed_s, 1),
        "fixed_eps_per_min": round(16 * 60 / fixed_s, 1),
        "continuous_s": round(cont_s, 1),
        "continuous_eps_per_min": round(16 * 60 / cont_s, 1),
        "last_episode_to_trainer_s": [round(x, 2) for x in sorted(lats)],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-episodes", action="store_true")
    args = ap.parse_args()
    out = {}
    with tempfile.TemporaryDirectory(prefix="bench-rollouts-") as d:
        tmp = Path(d)
        out["claims"] = [bench_claims(tmp / f"c{p}", p, 2000 if args.quick else 4000) for p in (1, 8)]
        out["poll"] = [bench_poll(tmp, 10), bench_poll(tmp, 12_500)]
        out["latency"] = bench_latency(tmp, 30 if args.quick else 60)
        if not args.no_episodes:
            out["episodes"] = bench_episodes(tmp)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
