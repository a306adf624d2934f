"""Benchmark: what the token-in mode costs per turn against chat mode with exact tokens.

Usage:  python bench/bench_token_in.py [--turns 16] [--reps 5] [--markdown]

Both modes run the real agent loop on a host bash against the scripted server over HTTP, with the
same scripted replies (a ``<command>`` per turn, then done). Chat mode sends the messages to
``/v1/chat/completions`` with ``return_token_ids`` (the server's ids, prompt and completion);
token-in mode tokenizes each new observation with the template (``/tokenize``) and sends the whole
sequence as a token-id prompt to ``/v1/completions``. Reported per turn: the client's wall time in
the policy call (requests included) and the number of requests. The scripted server's model time is
near zero, so the difference is the mode's own overhead: on a real server it adds to model time.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import tempfile
from pathlib import Path

from et_hpc.agent.loop import BudgetConfig, run_agent
from et_hpc.agent.openai_policy import OpenAIPolicy
from et_hpc.sandbox.shell import Shell
from et_hpc.testing.scripted_server import ScriptedServer


def script(turns: int) -> dict:
    steps = [{"content": f"<command>echo step {i}; seq 1 20</command>", "reasoning": f"step {i}"} for i in range(turns)]
    return {"task": steps + [{"content": "<action>done</action>"}]}


def one(turns: int, token_in: bool, home: Path) -> tuple[float, int, int, str]:
    with ScriptedServer(script(turns)) as srv, Shell(["bash", "--noprofile", "--norc"], home=str(home)) as sh:
        p = OpenAIPolicy(
            srv.base_url, mode="text", token_in=token_in, return_token_ids=True, logprobs=True, backoff_base_s=0.01, rng=random.Random(0)
        )
        r = run_agent("Do the task.", sh, p, BudgetConfig(max_turns=turns + 1))
        assert r.status == "ok", r.error
        policy_s = sum(tr.policy_s for tr in r.turns)
        drift = r.tokens.token_drift
        tokens = f"{r.tokens.tokens_source}, " + (f"drift at {drift.split(':')[0]}" if drift else "no drift")
        return policy_s / len(r.turns), sum(srv.requests.values()), len(r.turns), tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--turns", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for mode in (False, True):
            per_turn, reqs, source = [], 0, ""
            for _ in range(a.reps):
                s, n, turns, source = one(a.turns, mode, Path(d))
                per_turn.append(s)
                reqs = n / turns
            rows.append(("token-in" if mode else "chat + server ids", statistics.median(per_turn) * 1000, reqs, source))
    print(f"# {platform.node()} python {platform.python_version()}: {a.turns} turns, median of {a.reps}")
    if a.markdown:
        print("| mode | policy call per turn (ms, median) | requests per turn | tokens |\n|---|---|---|---|")
    for name, ms, reqs, source in rows:
        if a.markdown:
            print(f"| {name} | {ms:.1f} | {reqs:.2f} | {source} |")
        else:
            print(f"{name:20s} {ms:7.1f} ms/turn  {reqs:.2f} req/turn  {source}")


if __name__ == "__main__":
    main()
