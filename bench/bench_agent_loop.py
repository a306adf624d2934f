"""Per-turn overhead of the agent loop: scripted HTTP server -> OpenAIPolicy -> host bash Shell.

Measures what et-hpc adds around a model (HTTP round trip, parsing, shell round trip), with a
server that answers instantly. Run as an unprivileged user:

    python bench/bench_agent_loop.py --turns 200 --episodes 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from et_hpc.agent.loop import BudgetConfig, run_agent
from et_hpc.agent.openai_policy import OpenAIPolicy
from et_hpc.sandbox.shell import Shell
from et_hpc.testing.scripted_server import ScriptedServer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--episodes", type=int, default=5)
    args = ap.parse_args()
    for mode in ("tools", "text"):
        reply = {"command": "echo hi"} if mode == "tools" else "<command>echo hi</command>"
        script = {"bench": [reply] * args.turns}
        pol_s: list[float] = []
        exec_s: list[float] = []
        per_turn: list[float] = []
        with (
            ScriptedServer(script) as srv,
            tempfile.TemporaryDirectory() as home,
            Shell(["bash", "--noprofile", "--norc"], home=home) as sh,
        ):
            for _ in range(args.episodes):
                pol = OpenAIPolicy(srv.base_url, "scripted", mode=mode)
                t0 = time.perf_counter()
                r = run_agent("bench", sh, pol, BudgetConfig(max_turns=args.turns, context_tokens=10**9))
                per_turn.append((time.perf_counter() - t0) / len(r.turns))
                assert r.stop_reason == "max_turns", r.stop_reason
                pol_s += [t.policy_s for t in r.turns]
                exec_s += [t.exec_s for t in r.turns]
        q = statistics.quantiles
        print(
            f"{mode}: {args.episodes}x{args.turns} turns | per turn mean {statistics.mean(per_turn) * 1e3:.2f} ms | "
            f"policy p50 {q(pol_s, n=100)[49] * 1e3:.2f} ms p95 {q(pol_s, n=100)[94] * 1e3:.2f} ms | "
            f"exec p50 {q(exec_s, n=100)[49] * 1e3:.2f} ms p95 {q(exec_s, n=100)[94] * 1e3:.2f} ms"
        )


if __name__ == "__main__":
    main()
