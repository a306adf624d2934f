"""``et-hpc rescore``: regrade a run's kept final states with new tests, locally or as Slurm arrays."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from et_hpc.cli.common import add_command
from et_hpc.errors import UserError

HELP = """\
Regrade the episodes of RUN with new final tests, without running the agent again. RUN must have
kept its episodes' final states ('et-hpc run ... --set sandbox.keep_final_state=true'). Each
kept state is started on the task's pristine image as a read-only layer and scored through the
same entry path as live scoring; the records go to a new run (default name
<RUN>-rescore-<tests digest>), keeping each episode's messages, tokens and versions, with the new
reward, verdicts, tests_digest and rescored_from (<source run>/<episode id>). RUN is only read.

The new tests: --tests DIR (DIR/<task_id>/test_final_state.py; tasks without one are not
rescored) or --task-source SRC (the final tests of the tasks SRC holds, e.g. a fixed copy of the
task folders). Tests that are not valid Python are refused.

Like 'et-hpc run', the rescore resumes (rerun the same command: done episodes are skipped) and
runs on Slurm arrays with --executor slurm. At the end, and with --diff RESCORED_RUN later, it
lists per task the episodes whose reward flipped, the tests' diff against the tests that scored
RUN, and the episodes it could not rescore (no kept state, an error status, no new tests), with why.

Exit status: 0 done, 1 episodes still missing (rerun), 2 bad input, 130 interrupted.
"""
EPILOG = """\
examples:
  et-hpc run defs/demo --policy oracle --samples 2 --run-name demo --set sandbox.keep_final_state=true
  et-hpc rescore demo --tests fixed-tests/                  # fixed-tests/<task_id>/test_final_state.py
  et-hpc rescore demo --task-source fixed-tasks/ --executor slurm --run-name demo-fixed
  et-hpc rescore demo-fixed --diff                          # what flipped, per task, with the tests' diff
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers, "rescore", help="regrade a run's kept final states with new tests (no agent)", description=HELP, epilog=EPILOG
    )
    p.add_argument("run", help="run directory, or run name inside --store (with --diff: the rescored run)")
    p.add_argument("--tests", type=Path, metavar="DIR", help="new tests: DIR/<task_id>/test_final_state.py")
    p.add_argument("--task-source", metavar="SRC", help="new tests: the final tests of the tasks SRC holds")
    p.add_argument("--run-name", help="name of the new run (default <RUN>-rescore-<tests digest>)")
    p.add_argument("--store", type=Path, help="store root (finds RUN by name; the new run goes there too)")
    p.add_argument("--executor", choices=["local", "slurm"], help="default: RUN's executor")
    p.add_argument("--concurrency", type=int, help="episodes scored at once per node")
    p.add_argument("--retry-errors", action="store_true", help="rescore again episodes recorded with an error")
    p.add_argument("--detach", action="store_true", help="slurm: return after submitting")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a run config key (slurm.*, sandbox limits, scoring_timeout_s)",
    )
    p.add_argument("--diff", action="store_true", help="show what changed in the rescored run RUN, and stop")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_rescore)


def _report(run_dir: Path, as_json: bool) -> None:
    from et_hpc.runner.rescore import diff_report, format_diff

    rep = diff_report(run_dir)
    print(json.dumps(rep, indent=2) if as_json else format_diff(rep))


def cmd_rescore(args: argparse.Namespace) -> int:
    from et_hpc.paths import find_run_dir
    from et_hpc.runner.config import parse_set

    if args.diff:
        if args.tests or args.task_source:
            raise UserError("--diff shows a rescored run: give it alone (et-hpc rescore RESCORED_RUN --diff)")
        _report(find_run_dir(args.run, args.store), args.json)
        return 0
    if args.concurrency is not None and args.concurrency < 1:
        raise UserError(f"--concurrency {args.concurrency}: must be 1 or more")
    from et_hpc.runner.executors import get_executor
    from et_hpc.runner.plan import open_store
    from et_hpc.runner.rescore import plan_rescore

    overrides = parse_set(args.set)
    for key, val in (("executor", args.executor), ("concurrency", args.concurrency)):
        if val is not None:
            overrides.append(([key], val))
    if args.retry_errors:
        overrides.append((["retry_errors"], True))
    plan = plan_rescore(
        args.run, tests=args.tests, task_source=args.task_source, run_name=args.run_name, store=args.store, overrides=overrides
    )
    store = open_store(plan.run_dir)
    print(f"rescore {plan.cfg.run_name()}: {len(plan.units)} episode(s) to score, {plan.done_ok} done ({plan.run_dir})", file=sys.stderr)
    rc = 0
    if plan.units:
        if plan.cfg.executor == "slurm":
            from et_hpc.runner.slurm import refuse_if_jobs_live

            refuse_if_jobs_live(plan)
        out = get_executor(plan.cfg.executor).run(plan, store, detach=args.detach, notify=lambda m: print(f"et-hpc: {m}", file=sys.stderr))
        if out.detached:
            return 0
        rc = out.rc
    if rc == 0:
        done = store.units()
        rc = 1 if any(done.get(u) is None for u in plan.units) else 0
    _report(plan.run_dir, args.json)
    return rc
