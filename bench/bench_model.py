"""The embedded CPU model: prefill and decode tokens/s, server memory, real-model episodes per hour at
concurrency 1 and 2, the model's share of episode wall time, and the capacity projection for a 64-core node.

    python bench/bench_model.py [--samples 1] [--turns 4] [--max-tokens 192] [--modes text,tools]
                                [--tasks ID,ID] [--concurrency 1,2] [--store /tmp/et-bench-model]
                                [--model NAME|GGUF] [--token-in] [--seed N] [--prefix bm]

Per run: pass rate per task, s/episode, s/turn, tokens/s. Runs are named PREFIX-MODE-cN-HHMMSS:
two tiers scored into one store with one prefix are a series for `et-hpc report --glob 'PREFIX-*'`.

The load average is printed before and after: on a shared machine the episode rates are lower bounds.

Needs the model extra, apptainer and the demo images (et-hpc build defs/demo).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from et_hpc.model.catalog import prepare
from et_hpc.model.server import ServerConfig, serving

REPO = Path(__file__).resolve().parent.parent
ET = [sys.executable, "-m", "et_hpc.cli"]


def rss_mb(sid: int) -> float:
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(pid)) != sid:
                continue
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except (OSError, ValueError):
            pass
    return total / 1024


def speeds(srv, key: str, reps: int = 3) -> tuple[float, float, int]:
    prompt = "Summarise the following shell session.\n" + "\n".join(f"$ ls /srv/data/{i}\nfile_{i}.csv  notes_{i}.txt" for i in range(40))
    url = f"http://127.0.0.1:{srv.port}/completion"
    pre, dec, n = [], [], 0
    for _ in range(reps):
        r = httpx.post(
            url,
            headers={"Authorization": f"Bearer {key}"},
            timeout=300,
            json={"prompt": prompt, "n_predict": 128, "temperature": 0, "ignore_eos": True, "cache_prompt": False},
        )
        t = r.json()["timings"]
        pre.append(t["prompt_per_second"])
        dec.append(t["predicted_per_second"])
        n = t["prompt_n"]
    return statistics.median(pre), statistics.median(dec), n


def episodes(store: Path, name: str, ep: Path, mode: str, conc: int, a: argparse.Namespace) -> dict:
    t0 = time.monotonic()
    tasks = ["--set", f"tasks.ids=[{a.tasks}]"] if a.tasks else []
    r = subprocess.run(
        [
            *ET,
            "run",
            str(REPO / "defs" / "demo"),
            "--policy",
            "openai",
            "--samples",
            str(a.samples),
            "--concurrency",
            str(conc),
            "--store",
            str(store),
            "--run-name",
            name,
            "--json",
            *tasks,
            "--set",
            f"policy.endpoint_file={ep}",
            "--set",
            f"policy.mode={mode}",
            "--set",
            f"budgets.max_turns={a.turns}",
            "--set",
            f"budgets.max_tokens_per_turn={a.max_tokens}",
            "--set",
            f"policy.token_in={str(a.token_in).lower()}",
            *(["--set", f"policy.seed={a.seed}"] if a.seed is not None else []),
        ],
        capture_output=True,
        text=True,
    )
    wall = time.monotonic() - t0
    if r.returncode not in (0, 1):
        raise SystemExit(r.stderr[-2000:])
    from et_hpc.runs.store import open_run

    recs = open_run(store / name).records()
    model = sum(x.timings.model_s or 0 for x in recs)
    total = sum(x.timings.total_s or 0 for x in recs)
    toks = sum(x.completion_tokens or 0 for x in recs)
    turns = sum(x.turns or 0 for x in recs)
    per_task: dict[str, list[int]] = {}
    for x in recs:
        c = per_task.setdefault(x.task_id, [0, 0])
        c[0] += (x.reward or 0) >= 1
        c[1] += 1
    cap = subprocess.run(
        [*ET, "status", name, "--store", str(store), "--capacity", "--cores", "64", "--json"], capture_output=True, text=True
    )
    return {
        "mode": mode,
        "concurrency": conc,
        "episodes": len(recs),
        "wall_s": round(wall, 1),
        "per_hour": round(3600 * len(recs) / wall, 1),
        "model_share": round(model / total, 3) if total else None,
        "ok": sum(x.status == "ok" for x in recs),
        "solved": sum((x.reward or 0) >= 1 for x in recs),
        "tok_s": round(toks / model, 1) if model else None,
        "s_per_episode": round(total / len(recs), 1) if recs else None,
        "s_per_turn": round(model / turns, 1) if turns else None,
        "pass_per_task": {t: f"{c[0]}/{c[1]}" for t, c in sorted(per_task.items())},
        "tokens_source": sorted({str(x.tokens_source) for x in recs}),
        "capacity": cap.stdout if cap.returncode == 0 else cap.stderr,
    }


def main() -> None:
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the server on the way out
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--modes", default="text,tools")
    ap.add_argument("--tasks", default="", help="demo task ids, comma-separated (default: all)")
    ap.add_argument("--concurrency", default="1,2")
    ap.add_argument("--threads", type=int, default=None, help="llama-server threads (default: its choice)")
    ap.add_argument("--no-speeds", action="store_true", help="skip the prefill/decode measurement")
    ap.add_argument("--store", type=Path, default=Path(tempfile.mkdtemp(prefix="et-bench-model-")))
    ap.add_argument("--model", default=None, help="a model name or GGUF (default: the embedded smollm2-135m)")
    ap.add_argument("--token-in", action="store_true", help="policy.token_in=true (on llama-server: the protocol's grammar)")
    ap.add_argument("--seed", type=int, default=None, help="policy.seed (sample i sends seed + i)")
    ap.add_argument("--prefix", default="bm", help="run name prefix (a series for et-hpc report --glob 'PREFIX-*')")
    a = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="et-bench-ep-"))
    ep = d / "endpoint.json"
    m, digest = prepare(a.model)
    cfg = ServerConfig(model=m.path, digest=digest, alias=m.alias, endpoint_file=ep, log_file=d / "server.log", threads=a.threads)
    with serving(cfg) as srv:
        key = json.loads(ep.read_text())["api_key"]
        idle = rss_mb(srv.proc.pid)
        if not a.no_speeds:
            pre, dec, n = speeds(srv, key)
            print(
                f"model {srv.alias}: prefill {pre:.0f} tok/s ({n}-token prompt), decode {dec:.0f} tok/s; "
                f"server RSS {idle:.0f} MB idle, {rss_mb(srv.proc.pid):.0f} MB after use",
                flush=True,
            )
        stamp = time.strftime("%H%M%S")
        for mode in a.modes.split(","):
            for conc in map(int, a.concurrency.split(",")):
                load = os.getloadavg()[0]
                res = episodes(a.store, f"{a.prefix}-{mode}-c{conc}-{stamp}", ep, mode, conc, a)
                res["load_before_after"] = [round(load, 1), round(os.getloadavg()[0], 1)]
                print(json.dumps({k: v for k, v in res.items() if k != "capacity"}), flush=True)
                if conc == 2:
                    print(res["capacity"][-3000:], flush=True)
        print(f"server RSS at the end: {rss_mb(srv.proc.pid):.0f} MB")


if __name__ == "__main__":
    main()
