"""``et-hpc rollouts ...`` (tail, publish, stop) and the ``et-hpc run --continuous`` entry."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from et_hpc.cli.common import add_command, add_subcommands
from et_hpc.errors import UserError

if TYPE_CHECKING:
    from et_hpc.rollouts.stream import RolloutGroup
    from et_hpc.runner.config import RunConfig

HELP = """\
The stream of a continuous run ('et-hpc run --continuous'): groups as workers commit them.

  tail RUN       print groups as they arrive (from now; --from-start for all; --consumer NAME
                 reads and commits a persistent cursor, as a trainer would)
  publish RUN    tell the producers about a new checkpoint (the trainer owns the switch)
  stop RUN       ask the run to stop: workers give their units back, the controller ends
"""
EPILOG = """\
examples:
  et-hpc run defs/demo --policy oracle --samples 4 --continuous --run-name live
  et-hpc rollouts tail live --from-start --count 10
  et-hpc rollouts publish live --version 2 --model ckpt-200
  et-hpc rollouts stop live
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers, "rollouts", help="the group stream of a continuous run: tail, publish, stop", description=HELP, epilog=EPILOG
    )
    rs = add_subcommands(p, "rollouts_cmd")

    t = rs.add_parser(
        "tail",
        help="print groups as they arrive",
        description="Print one line per group as workers commit them (seq, group, version, "
        "rewards, latency from the group's commit to now). Ctrl-C ends it.",
    )
    _run_args(t)
    t.add_argument("--from-start", action="store_true", help="start at the first group, not at the end")
    t.add_argument("--consumer", help="read through this consumer's persistent cursor (committed per line)")
    t.add_argument("--count", type=int, help="stop after this many groups")
    t.add_argument("--timeout", type=float, help="stop after this many seconds without a new group")
    t.add_argument("--max-staleness", type=int, help="skip groups older than the current version minus K")
    t.add_argument("--json", action="store_true", help="one JSON object per group")
    t.set_defaults(func=cmd_tail)

    pb = rs.add_parser(
        "publish",
        help="publish a new policy version (trainer-owned switch)",
        description="Write the run's version file: groups started from now on carry this "
        "version (and use --model as the served model name, when given).",
    )
    _run_args(pb)
    pb.add_argument("--version", type=int, help="the new version (default: current + 1)")
    pb.add_argument("--model", help="served model name for the new version (e.g. a LoRA adapter)")
    pb.add_argument("--checkpoint", help="where the checkpoint is (recorded only)")
    pb.set_defaults(func=cmd_publish)

    st = rs.add_parser(
        "stop",
        help="ask a continuous run to stop",
        description="Write the run's stop file: workers claim nothing more and give back "
        "what they hold; the controller ends the run. The queue stays for a later run.",
    )
    _run_args(st)
    st.add_argument("--reason", default="stopped by hand")
    st.set_defaults(func=cmd_stop)


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run directory, or run name inside --store")
    p.add_argument("--store", type=Path, help="store root used to find a run by name")


def _run_dir(args: argparse.Namespace) -> Path:
    from et_hpc.paths import find_run_dir

    return find_run_dir(args.run, args.store)


def cmd_tail(args: argparse.Namespace) -> int:
    from et_hpc.rollouts.queue import WorkQueue
    from et_hpc.rollouts.stream import RolloutStream

    run_dir = _run_dir(args)
    if not WorkQueue(run_dir).exists():
        raise UserError(f"{run_dir} is not a continuous run (no queue/): start one with 'et-hpc run --continuous'")
    stream: RolloutStream | _EphemeralStream
    if args.consumer:
        stream = RolloutStream(run_dir, args.consumer)
    else:  # a cursor of its own that is never written
        stream = _EphemeralStream(run_dir, args.from_start)
    n = 0
    try:
        while args.count is None or n < args.count:
            groups = stream.next_batch(
                1, timeout_s=args.timeout if args.timeout is not None else 3600.0, max_staleness=args.max_staleness, on_error="keep-ok"
            )
            if not groups:
                if args.timeout is not None:
                    break
                continue
            g = groups[0]
            n += 1
            _print_group(g, args.json)
            if isinstance(stream, RolloutStream):  # args.consumer: its cursor is kept
                stream.commit()
    except KeyboardInterrupt:
        pass
    finally:
        close = getattr(stream, "close", None)
        if close:
            close()
    return 0


class _EphemeralStream:
    """A RolloutStream without a cursor file (tail without --consumer)."""

    def __init__(self, run_dir: Path, from_start: bool):
        from et_hpc.rollouts.queue import WorkQueue
        from et_hpc.rollouts.stream import RolloutStream, fresh_telemetry, run_endpoint
        from et_hpc.rollouts.versions import VersionReader

        self._s = RolloutStream.__new__(RolloutStream)
        s = self._s
        s.run_dir, s.consumer, s.auto_commit, s.poll_s = Path(run_dir), "(tail)", False, 0.2
        ef, ed = run_endpoint(s.run_dir)  # what the stream's own __init__ reads for versions
        s._versions = VersionReader(s.run_dir, endpoint_file=ef, endpoint_dir=ed)
        s.queue = WorkQueue(run_dir)
        s.next_seq = 0 if from_start else s.queue.published()
        s.counts = {"delivered": 0, "discarded_stale": 0, "discarded_masked": 0}
        s.state, s._dirty = None, False
        s.telemetry = fresh_telemetry()

    def next_batch(self, *a: Any, **kw: Any) -> list[RolloutGroup]:
        return self._s.next_batch(*a, **kw)


def _print_group(g: RolloutGroup, as_json: bool) -> None:
    lat = max(0.0, g.received_at - g.committed_at)
    if as_json:
        print(
            json.dumps(
                {
                    "seq": g.seq,
                    "group_id": g.group_id,
                    "task_id": g.task_id,
                    "policy_version": g.policy_version,
                    "rewards": g.rewards,
                    "statuses": [r.status for r in g.records],
                    "samples": [r.sample for r in g.records],
                    "latency_s": round(lat, 3),
                }
            ),
            flush=True,
        )
        return
    rewards = " ".join("-" if r is None else f"{r:g}" for r in g.rewards)
    print(f"{g.seq:>6}  {g.group_id:<32}  v={g.policy_version or '-':<4} rewards [{rewards}]  {lat:5.1f}s", flush=True)


def cmd_publish(args: argparse.Namespace) -> int:
    from et_hpc.rollouts.versions import publish_version

    pv = publish_version(_run_dir(args), args.version, model=args.model, checkpoint=args.checkpoint)
    print(f"published version {pv.version}" + (f" (model {pv.model})" if pv.model else "") + f", place {pv.position} in the version log")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from et_hpc.rollouts.queue import WorkQueue

    run_dir = _run_dir(args)
    q = WorkQueue(run_dir)
    if not q.exists():
        raise UserError(f"{run_dir} is not a continuous run (no queue/)")
    q.request_stop(args.reason)
    print(f"stop requested for {run_dir}")
    return 0


def cmd_continuous(cfg: RunConfig, args: argparse.Namespace) -> int:
    """``et-hpc run --continuous``: runs until stopped; prints the final queue status."""
    from et_hpc.rollouts.controller import run_continuous
    from et_hpc.util import format_table

    if getattr(args, "detach", False):
        raise UserError(
            "--detach does not apply to --continuous: the command is the run's controller; "
            "run it in a batch job (sbatch slurm/run.sbatch CONFIG --continuous)"
        )
    target = getattr(args, "target_groups", None)
    info = run_continuous(cfg, target_groups=target)
    if getattr(args, "json", False):
        print(json.dumps(info, indent=2))
    else:
        print(f"continuous run {cfg.run_name()}")
        print(format_table(["", "value"], [[k, v] for k, v in info.items()]))
    if info.get("stop_reason") == "signal":
        return 130
    return 1 if info.get("stop_reason") == "every worker ended" else 0


def queue_status(run_dir: Path) -> dict[str, Any] | None:
    """The queue section of ``et-hpc status`` (None for a fixed-plan run)."""
    from et_hpc.rollouts.queue import WorkQueue

    q = WorkQueue(run_dir)
    if not q.exists():
        return None
    return q.status()
