"""A minimal training loop on the stream of a continuous run (et_hpc.rollouts.RolloutStream).

    python slurm/train_loop.py RUN_DIR --batches 20 --groups 1 [--publish-every K --model-prefix P]

Each step takes the next batch of complete groups (each group once for this consumer, also across
restarts), computes group-normalised advantages (GRPO-style), applies a pure-Python stand-in for
the optimizer step, and commits the stream's cursor together with the trainer's state, so a
trainer killed at any point and started again with the same command goes on where it was: a batch
it got but did not commit is handed out again, a committed one never. With --publish-every K it
publishes a new policy version every K steps (the trainer owns the checkpoint switch; --model-prefix
names the served model of each version, e.g. LoRA adapters ckpt-1, ckpt-2, ...). With --stop-at-end
it asks the run to stop when it has its batches. Its stand-in step uses rewards only, so it also
takes groups without exact token ids (oracle or replay runs); --require-tokens takes only trainable
groups, as a trainer of token ids must. Exit 3 when no group came for --timeout seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from et_hpc.rollouts import RolloutStream


def advantages(rewards: list[float]) -> list[float]:
    mean = sum(rewards) / len(rewards)
    var = sum((r - mean) ** 2 for r in rewards) / len(rewards)
    return [(r - mean) / (var**0.5 + 1e-6) for r in rewards]


def optimizer_step(weights: list[float], groups: list, lr: float = 0.01) -> list[float]:
    """Stand-in for a policy-gradient step: move each weight by the mean advantage times a
    per-episode feature (its length in turns), so the weights depend on every group used."""
    grad = [0.0] * len(weights)
    for g in groups:
        rewards = [float(r.reward or 0.0) for r in g.records]
        for rec, adv in zip(g.records, advantages(rewards)):
            grad[rec.sample % len(weights)] += adv * (rec.turns or 1)
    return [w + lr * d for w, d in zip(weights, grad)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--consumer", default="trainer-0")
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--groups", type=int, default=1, help="groups per batch")
    ap.add_argument("--max-staleness", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--step-s", type=float, default=0.0, help="simulated compute time per step")
    ap.add_argument("--publish-every", type=int, default=0)
    ap.add_argument("--model-prefix", default=None)
    ap.add_argument("--record-seen", action="store_true", help="keep every group's seq and id in the state")
    ap.add_argument("--stop-at-end", action="store_true")
    ap.add_argument("--require-tokens", action="store_true", help="only groups with exact token ids (a token trainer)")
    args = ap.parse_args(argv)

    with RolloutStream(args.run_dir, args.consumer) as stream:
        state = stream.state or {"step": 0, "weights": [0.0] * 4, "seen": []}
        print(f"resuming at step {state['step']} (cursor {stream.next_seq})", flush=True)
        while state["step"] < args.batches:
            groups = stream.next_batch(
                args.groups, timeout_s=args.timeout, max_staleness=args.max_staleness, require_tokens=args.require_tokens
            )
            if len(groups) < args.groups:
                print(f"no batch within {args.timeout:.0f} s", file=sys.stderr)
                return 3
            step = state["step"] + 1
            print(f"step {step} got " + " ".join(f"{g.seq}:{g.group_id}:v{g.policy_version}" for g in groups), flush=True)
            weights = optimizer_step(state["weights"], groups)
            time.sleep(args.step_s)
            seen = state["seen"] + ([[g.seq, g.group_id] for g in groups] if args.record_seen else [])
            state = {"step": step, "weights": weights, "seen": seen}
            stream.commit(state)  # the cursor and the trainer's state move together
            if args.publish_every and step % args.publish_every == 0:
                v = stream.publish_version(model=f"{args.model_prefix}{step}" if args.model_prefix else None)
                print(f"published version {v.version}", flush=True)
        print(json.dumps({"steps": state["step"], **stream.stats()}), flush=True)
        if args.stop_at_end:
            stream.request_stop("trainer has its batches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
