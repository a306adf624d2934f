"""Many policy servers (``policy.endpoint_dir``): how evenly episodes spread, and what a server
killed mid-run costs.

    python bench/bench_replicas.py [--replicas 3] [--episodes 60] [--concurrency 6] [--turns 4]
                                   [--think-s 0.3] [--markdown]

Real processes: ``--replicas`` scripted servers (``python -m et_hpc.testing.scripted_server --endpoint-dir``)
on 127.0.0.1, each writing its endpoint file into one directory; ``--episodes`` episodes,
``--concurrency`` at a time in threads of this process, each an ``OpenAIPolicy`` on the process's
replica set doing ``--turns`` chat requests with ``--think-s`` of sleep between them (a stand-in
for the sandbox command; no apptainer). The policy's own defaults apply (``failover_after`` 2,
``backoff_base_s`` 1.0).

- spread: no faults; each server's share of the episodes (from its own request log: the
  first turns it served) and the largest deviation from an even share.
- failover: the same run again with fresh servers; once a third of the episodes have started,
  one server is SIGKILLed. Episodes lost (ended in ``PolicyError``), failovers, and the latency
  of the turns that failed over next to the median turn.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from et_hpc.agent.openai_policy import OpenAIPolicy
from et_hpc.agent.policies import PolicyError
from et_hpc.agent.replicas import ReplicaSet


def start_servers(root: Path, n: int, turns: int) -> tuple[Path, list[tuple[subprocess.Popen, Path]]]:
    script = root / "script.json"
    script.write_text(json.dumps({"": [{"command": "true"}] * (turns - 1) + ["All done."]}))
    d = root / "replicas"
    procs = []
    for i in range(n):
        log = root / f"server{i}.log"
        with open(log, "w") as out:
            procs.append(
                (
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "et_hpc.testing.scripted_server",
                            "--script",
                            str(script),
                            "--port",
                            "0",
                            "--endpoint-dir",
                            str(d),
                            "--log-requests",
                        ],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    ),
                    log,
                )
            )
    end = time.monotonic() + 30
    while len(list(d.glob("*.json"))) < n:
        if time.monotonic() > end:
            sys.exit("bench_replicas: the servers did not start")
        time.sleep(0.05)
    return d, procs


def first_turns(log: Path) -> int:
    return log.read_text().count("served chat turn=0\n")


def port_of(log: Path) -> str:
    m = re.search(r"127\.0\.0\.1:(\d+)", log.read_text())
    return m.group(1) if m else "?"


def episode(rs: ReplicaSet, turns: int, think_s: float, out: list) -> None:
    conv: list[dict] = [{"role": "user", "content": "bench"}]
    lats: list[tuple[float, bool]] = []
    try:
        p = OpenAIPolicy(None, replicas=rs)
    except PolicyError:
        out.append({"lost": True, "lats": lats, "events": []})
        return
    try:
        for _ in range(turns):
            n = len(p.events)
            t = time.perf_counter()
            a = p.act(conv)
            lats.append((time.perf_counter() - t, len(p.events) > n))
            conv.append(a.message)
            if a.kind != "command":
                break
            conv.append({"role": "tool", "tool_call_id": a.tool_call_id, "content": "ok"})
            time.sleep(think_s)
        out.append({"lost": False, "lats": lats, "events": list(p.events)})
    except PolicyError as e:
        out.append({"lost": True, "lats": lats, "events": list(p.events), "error": str(e)})
    finally:
        p.close()


def run(args: argparse.Namespace, kill: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        d, procs = start_servers(Path(tmp), args.replicas, args.turns)
        rs = ReplicaSet(d)
        out: list[dict] = []
        started = threading.Semaphore(0)

        def one(_: int) -> None:
            started.release()
            episode(rs, args.turns, args.think_s, out)

        t0 = time.perf_counter()
        try:
            with ThreadPoolExecutor(args.concurrency) as pool:
                futs = [pool.submit(one, i) for i in range(args.episodes)]
                if kill:
                    for _ in range(args.episodes // 3):
                        started.acquire()
                    procs[0][0].send_signal(signal.SIGKILL)
                for f in futs:
                    f.result()
            wall = time.perf_counter() - t0
            shares = {port_of(log): first_turns(log) for _, log in procs}
        finally:
            for p, _ in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
                p.wait(timeout=30)
    normal = [t for e in out for t, moved in e["lats"] if not moved]
    moved = [t for e in out for t, m in e["lats"] if m]
    return {
        "episodes": len(out),
        "lost": sum(e["lost"] for e in out),
        "wall_s": wall,
        "shares": shares,
        "failovers": sum(len(e["events"]) for e in out),
        "found_dead": sum("found dead" in ev for e in out for ev in e["events"]),
        "turn_median_s": statistics.median(normal) if normal else None,
        "failover_turns_s": sorted(moved),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--episodes", type=int, default=60)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--think-s", type=float, default=0.3)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    spread, fo = run(args, kill=False), run(args, kill=True)
    even = args.episodes / args.replicas
    dev = max(abs(n - even) / even for n in spread["shares"].values())
    if not args.markdown:
        print(json.dumps({"spread": spread, "failover": fo, "max_deviation": dev}, indent=2))
        return
    med = fo["turn_median_s"]
    ft = fo["failover_turns_s"]
    print("| run | episodes | lost | failovers (of which found dead) | per-replica episodes | wall s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in (("no faults", spread), ("one server SIGKILLed", fo)):
        shares = " / ".join(str(v) for v in r["shares"].values())
        print(f"| {name} | {r['episodes']} | {r['lost']} | {r['failovers']} ({r['found_dead']}) | {shares} | {r['wall_s']:.1f} |")
    print(f"\nNo faults: largest deviation from an even share {dev * 100:.0f}%. Median turn {spread['turn_median_s'] * 1000:.1f} ms.")
    if ft:
        print(
            f"Failed-over turns: {len(ft)}, latency median {statistics.median(ft) * 1000:.0f} ms, max "
            f"{max(ft) * 1000:.0f} ms (median turn {med * 1000:.1f} ms): extra "
            f"**{(statistics.median(ft) - med) * 1000:.0f} ms** per failed-over turn."
        )


if __name__ == "__main__":
    main()
