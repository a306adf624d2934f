"""Benchmark of the trajectory viewer at scale: writing the site, and the page in headless Chromium.

Usage:  python bench/bench_view.py [--episodes 1000 10000 100000] [--dir /tmp/x] [--markdown]

For each size, writes a run of synthetic episodes through the store API (tasks of 8 samples, 6
turns each, ~300-character outputs, one episode in 10 with token ids and logprobs, one in 50 with an
error), compacts it, then times ``et-hpc view`` in a child process (its peak RSS) and opens the page
in Chromium (Debian's ``chromium``, through the DevTools protocol as the browser tests do):

- first render: from navigation start to the run page's table and plots drawn (the page's own
  ``performance.now()`` when it finished, so script loading and parsing the run's data are in);
- JS heap used after it (``Runtime.getHeapUsage``) and the renderer process's RSS;
- a search typed into the filter box, and a sort by reward (both redraw the table page);
- opening an episode (its chunk of details loaded on demand) until its transcript is drawn.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from et_hpc.record import EpisodeRecord
from et_hpc.runs.store import RunStore


def synthetic(i: int, rng: random.Random) -> EpisodeRecord:
    task, sample = f"task_{i // 8:06d}", i % 8
    err = i % 50 == 7
    msgs = [{"role": "system", "content": "You are a Linux terminal agent." * 20}, {"role": "user", "content": f"Do task {task}."}]
    for t in range(6):
        msgs.append({"role": "assistant", "content": f"Step {t}.\n<command>ls -la /home/user/{t}</command>"})
        msgs.append(
            {"role": "user", "content": "Command executed successfully. Output: " + "x" * rng.randint(100, 500) + "\n\n(exit_code=0)"}
        )
    kw = {}
    if i % 10 == 0:
        comp = [[rng.randrange(150_000) for _ in range(60)] for _ in range(6)]
        kw = {
            "prompt_token_ids": [[rng.randrange(150_000) for _ in range(600 if t == 0 else 120)] for t in range(6)],
            "token_ids": comp,
            "logprobs": [[-rng.random() for _ in c] for c in comp],
            "tokens_source": "server-exact",
        }
    start = 1.7e9 + i
    return EpisodeRecord(
        run_name="bench",
        task_id=task,
        sample=sample,
        status="infra_error" if err else "ok",
        reward=None if err else float(rng.random() > 0.6),
        passed=None if err else rng.randint(0, 3),
        total=None if err else 3,
        turns=6,
        stop_reason="done",
        messages=msgs,
        policy_kind="openai-tools",
        model="m",
        policy_version=f"ckpt@step-{i // 20000}",
        tests=[{"name": f"test_final::t{k}", "outcome": "passed" if k else "failed"} for k in range(3)],
        timings={
            "start_s": start,
            "stop_s": start + 30,
            "queue_s": 2.0,
            "setup_s": 0.4,
            "agent_s": 25.0,
            "model_s": 20.0,
            "exec_s": 4.0,
            "score_s": 0.6,
            "teardown_s": 0.05,
            "total_s": 30.0,
        },
        peak_mem_mb=50 + rng.random() * 100,
        error="stand-in failure" if err else None,
        **kw,
    )


def make_run(root: Path, n: int) -> Path:
    rs = RunStore(root / f"bench-{n}")
    rng = random.Random(n)
    for s in range(0, n, 5000):
        rs.write([synthetic(i, rng) for i in range(s, min(n, s + 5000))])
    rs.compact()
    return rs.path


def renderer_rss_mb(browser_pid: int) -> float:
    best = 0.0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"--type=renderer" not in cmd:
                continue
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    best = max(best, int(line.split()[1]) / 1024)
        except OSError:
            pass
    return best


def measure(run: Path, root: Path) -> dict:
    out = root / f"site-{run.name}"
    t = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "et_hpc.cli", "view", str(run), "-o", str(out)],
        check=True,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    write_s = time.perf_counter() - t
    write_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) / 2**20
    index_mb = (out / "data" / "r0.js").stat().st_size / 2**20
    from view.browser import Browser

    b = Browser(Path(tempfile.mkdtemp(prefix="bench-view-chromium-")))
    try:
        b.goto(
            (out / "index.html").as_uri() + "#run=r0",
            "ETV.renderedAt !== undefined && document.querySelectorAll('tr.ep').length > 0",
            timeout_s=600,
        )
        first = b.eval("ETV.renderedAt")
        heap = b.call("Runtime.getHeapUsage")["usedSize"] / 2**20
        rss = renderer_rss_mb(b.proc.pid)
        search = b.eval(
            "(() => { const q = document.querySelector('input[name=q]'); const t = performance.now();"
            "q.value = 'task_00001'; q.dispatchEvent(new Event('input')); return performance.now() - t; })()"
        )
        b.eval("(() => { const q = document.querySelector('input[name=q]'); q.value = ''; q.dispatchEvent(new Event('input')); })()")
        sort = b.eval(
            "(() => { const t = performance.now(); document.querySelector('th[data-col=reward]').click();return performance.now() - t; })()"
        )
        eid = b.eval("document.querySelector('tr.ep').dataset.episode")
        t = time.perf_counter()
        b.eval(f"location.hash = 'run=r0&ep={eid}'")
        b.wait("document.getElementById('transcript') !== null", 120)
        episode = (time.perf_counter() - t) * 1000
    finally:
        b.close()
    return {
        "write_s": write_s,
        "write_rss": write_rss,
        "size": size,
        "index_mb": index_mb,
        "first": first,
        "heap": heap,
        "rss": rss,
        "search": search,
        "sort": sort,
        "episode": episode,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, nargs="+", default=[1000, 10_000, 100_000])
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args()
    root = Path(a.dir or tempfile.mkdtemp(prefix="bench-view-"))
    rows = []
    try:
        for n in a.episodes:
            t = time.perf_counter()
            run = make_run(root, n)
            gen = time.perf_counter() - t
            m = measure(run, root)
            rows.append((n, gen, m))
            print(f"{n}: {m} (made in {gen:.0f} s)", file=sys.stderr, flush=True)
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(
        f"{platform.node()}, {os.cpu_count()} cores, python {platform.python_version()}, "
        f"{subprocess.run(['chromium', '--version'], capture_output=True, text=True).stdout.strip()}\n"
    )
    print(
        "| episodes | et-hpc view s | its peak RSS MiB | site MiB (run page data) | first render ms | JS heap MiB | "
        "renderer RSS MiB | search ms | sort ms | open an episode ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n, _, m in rows:
        print(
            f"| {n:,} | {m['write_s']:.1f} | {m['write_rss']:.0f} | {m['size']:.0f} ({m['index_mb']:.1f}) | {m['first']:.0f} | "
            f"{m['heap']:.0f} | {m['rss']:.0f} | {m['search']:.0f} | {m['sort']:.0f} | {m['episode']:.0f} |"
        )


if __name__ == "__main__":
    main()
