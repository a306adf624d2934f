"""``et-hpc report``: the pass-rate trend over runs as a table, JSON or an HTML page."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from et_hpc.cli.common import add_command
from et_hpc.errors import UserError
from et_hpc.runs.report import build_report, format_html, format_text
from et_hpc.util import atomic_write_text

DESCRIPTION = """\
Trend of pass rate over the runs of a store, e.g. one run per nightly checkpoint. Runs matching
--glob are ordered by time (run.json planned_at, else their earliest episode). Per run: episodes,
ok, errors (never counted as failures), pass rate with a 95% Wilson interval, mean reward, mean
passed/total, and the change in pass rate against the previous run with a 95% interval: a change
marked * has an interval that excludes 0, anything else may be noise. Between the last two runs
the tasks newly solved and newly failed are listed (a task is solved when any sample passed).
A capacity section gives per run, over every episode it recorded (retries included):
episodes/hour over its busy time, model time as a share of episode wall time, infra overhead per
episode (setup + scoring + teardown + queue) median/p95, sandbox peak memory median/p95/max, and
accepted episodes per GPU-hour when sacct knows the endpoint files' jobs ('et-hpc status RUN
--capacity' has the details and a projection).
"""
EPILOG = """\
examples:
  et-hpc report $ET_HPC_STORE --glob 'nightly-*'
  et-hpc report $ET_HPC_STORE --glob 'nightly-*' --split validation -o $ET_HPC_STORE/nightly.html
  et-hpc report $ET_HPC_STORE --json | jq '.runs[-1].pass_rate'
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers, "report", help="pass-rate trend over runs (table, JSON or an HTML page)", description=DESCRIPTION, epilog=EPILOG
    )
    p.add_argument("store", type=Path, help="store folder holding one folder per run")
    p.add_argument("--glob", default="*", help="run names to include (shell pattern, default '*')")
    p.add_argument("--split", help="count only episodes of this task split, e.g. validation")
    p.add_argument("-o", "--output", type=Path, help="also write a self-contained HTML report here")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    rep = build_report(args.store, args.glob, args.split)
    if args.output:
        out = Path(args.output).expanduser()
        if out.is_dir():
            raise UserError(f"-o {out} is a directory; give a file name, e.g. {out / 'report.html'}")
        try:
            atomic_write_text(out, format_html(rep))
        except OSError as e:
            raise UserError(f"cannot write {out} ({e.strerror}); choose a writable path for -o") from e
        print(f"wrote {out}", file=sys.stderr)
    if args.json:
        print(json.dumps(rep.model_dump(mode="json"), indent=2))
    else:
        print(format_text(rep))
    return 0
