"""``et-hpc tasks check``: build, start and test each task (the checks are ``et_hpc.episode.check``)."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from et_hpc.cli.common import add_command, add_source_args, check_base_once, load_source
from et_hpc.episode.check import CheckConfig, CheckResult, check_tasks, default_jobs, load_failure
from et_hpc.errors import UserError
from et_hpc.util import format_table, one_line, progress_bar

DESCRIPTION = """\
Check that tasks are sound: for each task, stages run in order and stop at the first failure:
  load       the task loads and its recipe (def or Dockerfile) parses and normalises
  build      its image is built into the cache, or found there
  start      a sandbox starts from the image
  initial    test_initial_state.py passes in a fresh sandbox (skipped when the task has none)
  untouched  test_final_state.py FAILS on the untouched state; if it passes, the task is
             flagged as trivially solved
  solution   solution/solve.sh (run through the shell as the oracle policy does) makes
             test_final_state.py pass in a fresh sandbox (skipped when there is no solve.sh)
Each task prints OK or its failing stage with the last lines of output; a table follows.

Exit status: 0 when every task is OK, 1 when some task failed a check, 2 on bad input.
"""

EPILOG = """\
examples:
  et-hpc tasks check defs/demo                        check the demo tasks
  et-hpc tasks check ./tasks --glob 'task_00*' --jobs 4 --json > check.json
  et-hpc tasks check ./tasks --no-build               only tasks whose images are already cached
  et-hpc tasks check ./tasks --retry-failed           build again images that failed before
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers,
        "check",
        help="build, start and test each task: initial tests, trivially solved, reference solution",
        description=DESCRIPTION,
        epilog=EPILOG,
    )
    add_source_args(p)
    p.add_argument(
        "--jobs",
        "-j",
        type=int,
        metavar="N",
        help=f"tasks checked at once (default: one per core, here {default_jobs()}); image builds are limited to half the cores",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list of {task_id, ok, stage, detail, stages, tail, seconds} on stdout")
    p.add_argument("--retry-failed", action="store_true", help="build again images whose build failed before")
    p.add_argument("--no-build", action="store_true", help="build nothing; a task without a cached image fails at 'build'")
    p.add_argument("--cache", type=Path, metavar="DIR", help="image cache (default $ET_HPC_CACHE or ~/.cache/et-hpc)")
    p.add_argument(
        "--test-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="seconds one pytest file may take (default 120; a task's own verifier timeout wins when larger)",
    )
    p.add_argument("--solution-timeout", type=float, default=600.0, metavar="S", help="seconds solution/solve.sh may take (default 600)")
    p.set_defaults(func=cmd_check)


def _print_one(r: CheckResult, write: Callable[[str], None]) -> None:
    if r.ok:
        skipped = [s for s, v in r.stages.items() if v == "skipped"]
        write(f"{r.task_id}: OK" + (f" ({', '.join(skipped)} skipped)" if skipped else ""))
        return
    write(f"{r.task_id}: FAILED at {r.stage}: {r.detail}")
    for ln in r.tail:
        write(f"    | {ln}")


def _one_line(s: str, width: int = 100) -> str:
    return one_line(s, width)


def cmd_check(args: argparse.Namespace) -> int:
    from et_hpc.images.store import ImageStore
    from et_hpc.images.store import default_jobs as build_jobs

    if args.jobs is not None and args.jobs < 1:
        raise UserError(f"--jobs {args.jobs}: must be 1 or more")
    for name in ("test_timeout", "solution_timeout"):
        if getattr(args, name) <= 0:
            raise UserError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be more than 0 seconds")
    res = load_source(args)
    broken = [e for e in res.errors if e.task_id]
    bad_input = [e for e in res.errors if not e.task_id]
    if bad_input:
        raise UserError(str(bad_input[0]))
    if not res.tasks and not broken:
        raise UserError("no tasks selected: check SOURCE and the --ids/--glob/--split filters ('et-hpc tasks list')")
    store = ImageStore(args.cache)
    check_base_once(store, res.tasks)
    settings = CheckConfig(
        build=not args.no_build,
        retry_failed=args.retry_failed,
        test_timeout_s=args.test_timeout,
        solution_timeout_s=args.solution_timeout,
        build_slots=build_jobs(),
    )
    t0 = time.monotonic()
    results = [load_failure(e.task_id, str(e)) for e in broken]
    bar = progress_bar(total=len(res.tasks) + len(results), desc="checking", unit="task", dynamic_ncols=True)
    lock = threading.Lock()
    counts = {"ok": 0, "failed": 0}

    def write(line: str) -> None:
        if not args.json:
            bar.write(line, file=sys.stderr)

    def done(r: CheckResult) -> None:
        with lock:
            counts["ok" if r.ok else "failed"] += 1
            _print_one(r, write)
            bar.set_postfix(counts, refresh=False)
            bar.update(1)

    for r in results:
        done(r)
    try:
        results += check_tasks(res.tasks, store, settings, jobs=args.jobs or default_jobs(), on_result=done)
    finally:
        bar.close()
        store.index.save()
    results.sort(key=lambda r: r.task_id)
    failed = [r for r in results if not r.ok]
    if args.json:
        print(json.dumps([r.model_dump() for r in results], indent=2))
    else:
        rows = [
            [
                r.task_id,
                "OK" if r.ok else ("TRIVIAL" if r.trivially_solved else "FAILED"),
                r.stage or "-",
                _one_line(r.detail) if r.detail else "-",
            ]
            for r in results
        ]
        print(format_table(["task", "result", "stage", "detail"], rows))
        trivial = sum(r.trivially_solved for r in failed)
        line = f"{len(results) - len(failed)} OK, {len(failed)} failed"
        if trivial:
            line += f" ({trivial} trivially solved)"
        print(f"{line} of {len(results)} tasks in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return 1 if failed else 0
