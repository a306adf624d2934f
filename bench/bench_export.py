"""Benchmark of the trainer exports on episodes with token ids: Atropos JSONL and SkyRL parquet.

Usage:  python bench/bench_export.py [--episodes 10000] [--group 8] [--turns 8] [--dir /tmp/x] [--markdown]

Writes ``--episodes`` synthetic episodes in groups of ``--group`` (one in 40 groups has an
infrastructure error, so masking has work to do) with per-turn prompt deltas (first prompt ~600
tokens, tool output ~150 tokens per turn), completions (~60 tokens) and logprobs, compacts the run,
then times ``export_atropos`` (default: mask, drop zero-variance), ``export_skyrl`` (mask, keep
all), and the share of each spent reading the store (``RunStore.select`` + records). Each step
reports wall seconds and this process's CPU seconds (user + system, ``time.process_time``), which
stay comparable when other jobs load the machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import tempfile
import time
from pathlib import Path

from et_hpc.record import EpisodeRecord
from et_hpc.runs.export import export_atropos, export_skyrl, selected_groups
from et_hpc.runs.store import RunStore


def synthetic(i: int, group: int, turns: int, rng: random.Random) -> EpisodeRecord:
    g = i // group
    error = g % 40 == 7 and i % group == 0
    prompts = [[rng.randrange(150_000) for _ in range(rng.randint(500, 700))]]
    prompts += [[rng.randrange(150_000) for _ in range(rng.randint(50, 250))] for _ in range(turns - 1)]
    completions = [[rng.randrange(150_000) for _ in range(rng.randint(30, 90))] for _ in range(turns)]
    lps = [[-rng.random() for _ in c] for c in completions]
    msgs = [{"role": "system", "content": "You are a Linux terminal agent."}, {"role": "user", "content": f"task {g}"}]
    for t in range(turns):
        msgs.append({"role": "assistant", "content": f"<command>ls {t}</command>"})
        msgs.append({"role": "user", "content": "Command executed successfully. Output: a b c\n\n(exit_code=0)"})
    return EpisodeRecord(
        run_name="bench",
        task_id=f"task_{g:06d}",
        sample=i % group,
        status="infra_error" if error else "ok",
        reward=None if error else float(rng.random() > 0.5),
        messages=msgs,
        turns=turns,
        stop_reason="done",
        prompt_token_ids=prompts,
        token_ids=completions,
        logprobs=lps,
        tokens_source="server-exact",
        sampling_params={"temperature": 0.6},
        policy_kind="openai-tools",
        model="m",
    )


CPU: dict[str, float] = {}


def timed(fn, name: str | None = None):
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    if name:
        CPU[name] = time.process_time() - c
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=10_000)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args()
    root = Path(a.dir or tempfile.mkdtemp(prefix="bench-export-"))
    try:
        rng = random.Random(0)
        rs = RunStore(root / "bench")
        batch = 1000
        t_write = 0.0
        for start in range(0, a.episodes, batch):
            recs = [synthetic(i, a.group, a.turns, rng) for i in range(start, min(a.episodes, start + batch))]
            t, _ = timed(lambda: rs.write(recs))  # noqa: B023  (called at once, inside the loop)
            t_write += t
        rs.compact()
        tokens = sum(r.num_rows for r in [rs.read(["episode_id"])])
        t_load, (groups, counts) = timed(lambda: selected_groups(rs), "load")
        t_at, res_a = timed(lambda: export_atropos(rs, root / "groups.jsonl"), "atropos")
        t_sk, res_s = timed(lambda: export_skyrl(rs, root / "episodes.parquet"), "skyrl")
        size_a = os.path.getsize(root / "groups.jsonl") / 2**20
        size_s = os.path.getsize(root / "episodes.parquet") / 2**20
        n_tok = sum(len(r.token_sequence()[0]) for g in groups[:50] for r in g) / max(1, sum(len(g) for g in groups[:50]))
        rows = [
            ("read + select + records (mask)", t_load, CPU["load"], f"{counts.episodes} episodes in {counts.selected} groups"),
            (
                "export atropos (mask, drop zero-variance)",
                t_at,
                CPU["atropos"],
                f"{res_a.groups} groups, {res_a.episodes} episodes, {size_a:.0f} MiB",
            ),
            ("export skyrl (mask)", t_sk, CPU["skyrl"], f"{res_s.rows} rows, {size_s:.0f} MiB"),
        ]
        print(
            f"{tokens} episodes, {a.group} per group, {a.turns} turns, ~{n_tok:.0f} tokens per episode; "
            f"write {t_write:.1f} s; {counts.masked} groups masked; {platform.node()}, {os.cpu_count()} cores"
        )
        if a.markdown:
            print("| step | wall s | CPU s | episodes/s (wall) | what |\n|---|---|---|---|---|")
            for name, t, c, what in rows:
                print(f"| {name} | {t:.2f} | {c:.2f} | {a.episodes / t:,.0f} | {what} |")
        else:
            for name, t, c, what in rows:
                print(f"{name:45s} {t:7.2f} s  {c:7.2f} CPU s  {a.episodes / t:9,.0f} ep/s  {what}")
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
