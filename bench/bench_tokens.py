"""Cost of token capture per turn: scripted HTTP server -> OpenAIPolicy -> host bash Shell.

Runs the same episodes with ``return_token_ids`` off, on, on with logprobs, and against a server
that behaves like vLLM < 0.10.2 (the ``/tokenize`` fallback), and reports the wall time per turn,
the policy's share, and the end-of-episode check (``capture_tokens``: one ``/tokenize`` of the
whole conversation plus the comparison). Each command prints ``--output-bytes`` bytes so the
context (and the ``prompt_token_ids`` every response carries) grows as in a real episode. The
scripted server renders and tokenizes the prompt in every variant (it reports usage), so the
differences are the client's: larger responses to parse, the extra requests, the check.

    python bench/bench_tokens.py --turns 30 --episodes 5 --output-bytes 400
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

VARIANTS = {
    "off": ({}, {"return_token_ids": False}),
    "return_token_ids": ({}, {}),
    "return_token_ids+logprobs": ({}, {"logprobs": True}),
    "old server (/tokenize)": ({"return_token_ids": False}, {}),
    "old server + logprobs": ({"return_token_ids": False}, {"logprobs": True}),
}


class _Timed:
    """Wraps a policy to time its ``capture_tokens`` call."""

    def __init__(self, policy: OpenAIPolicy):
        self.policy, self.mode, self.capture_s = policy, policy.mode, 0.0

    def act(self, messages):
        return self.policy.act(messages)

    def capture_tokens(self, turns, messages):
        t = time.perf_counter()
        try:
            return self.policy.capture_tokens(turns, messages)
        finally:
            self.capture_s = time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--episodes", type=int, default=5)
    ap.add_argument("--output-bytes", type=int, default=400)
    ap.add_argument("--mode", choices=("tools", "text"), default="tools")
    args = ap.parse_args()
    cmd = f"head -c {args.output_bytes} /dev/zero | tr '\\0' x"
    reply = {"command": cmd} if args.mode == "tools" else f"<command>{cmd}</command>"
    script = {"bench": [reply] * args.turns}
    print(f"{args.mode} mode, {args.episodes} episodes x {args.turns} turns, {args.output_bytes} B output per command")
    base = None
    for name, (srv_kw, pol_kw) in VARIANTS.items():
        per_turn, policy, capture, last_prompt, sources = [], [], [], 0, set()
        with (
            ScriptedServer(script, **srv_kw) as srv,
            tempfile.TemporaryDirectory() as home,
            Shell(["bash", "--noprofile", "--norc"], home=home) as sh,
        ):
            for _ in range(args.episodes):
                pol = _Timed(OpenAIPolicy(srv.base_url, "scripted", mode=args.mode, **pol_kw))
                t0 = time.perf_counter()
                r = run_agent("bench", sh, pol, BudgetConfig(max_turns=args.turns, context_tokens=10**9))
                wall = time.perf_counter() - t0
                assert r.stop_reason == "max_turns", (r.stop_reason, r.error)
                per_turn.append(wall / len(r.turns))
                policy.append(statistics.mean(t.policy_s for t in r.turns))
                capture.append(pol.capture_s)
                last_prompt = r.usage.last_prompt_tokens
                sources.add((r.tokens.tokens_source, r.tokens.token_drift))
                pol.policy.close()
        m = statistics.median(per_turn) * 1e3
        base = m if base is None else base
        print(
            f"  {name:28s} per turn {m:6.2f} ms ({m - base:+.2f}) | policy {statistics.median(policy) * 1e3:6.2f} ms"
            f" | end check {statistics.median(capture) * 1e3:6.2f} ms | last prompt {last_prompt} tokens"
            f" | {sorted(sources, key=str)}"
        )


if __name__ == "__main__":
    main()
