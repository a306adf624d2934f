"""``et-hpc tasks list|show``: see what tasks a source holds, and everything about one task.

``tasks check`` (build, start, run the tests) is registered from ``et_hpc.cli.check``.
"""

from __future__ import annotations

import argparse
import json
import sys

from et_hpc.cli.common import SOURCE_HELP, add_command, add_source_args, add_subcommands, load_source
from et_hpc.errors import TaskError, UserError
from et_hpc.util import format_table

_add_source_args, _load = add_source_args, load_source  # their old names


def _limits_str(t) -> str:
    parts = []
    L = t.limits
    if L.wall_time_s is not None:
        parts.append(f"agent {L.wall_time_s:g}s")
    if L.verifier_timeout_s is not None:
        parts.append(f"verify {L.verifier_timeout_s:g}s")
    if L.cpus is not None:
        parts.append(f"{L.cpus:g}cpu")
    if L.memory_mb is not None:
        parts.append(f"{L.memory_mb}MB")
    if L.max_turns is not None:
        parts.append(f"{L.max_turns} turns")
    return " ".join(parts) or "-"


def task_summary(t) -> dict:
    """A JSON-friendly view of a task without its truth."""
    d = json.loads(t.model_dump_json(exclude={"truth"}))
    d["has_truth"] = t.truth is not None
    return d


def _n_tests(t) -> int:
    return sum(1 for x in (t.initial_tests, t.final_tests) if x is not None)


def _print_errors(res) -> None:
    for e in res.errors:
        print(f"et-hpc: error: {e}", file=sys.stderr)


def cmd_list(args: argparse.Namespace) -> int:
    res = load_source(args, validate=args.validate)
    if args.json:
        print(
            json.dumps(
                {
                    "tasks": [task_summary(t) for t in res.tasks],
                    "errors": [str(e) for e in res.errors],
                    "skipped": res.skipped,
                },
                indent=2,
            )
        )
    else:
        rows = [
            [
                t.id,
                t.metadata.get("layout", t.source_kind) if t.source_kind == "parquet" else t.source_kind,
                t.recipe.kind,
                _n_tests(t),
                "yes" if t.solution else "no",
                len(t.recorded_runs),
                t.split or "-",
                _limits_str(t),
            ]
            for t in res.tasks
        ]
        if rows:
            print(format_table(["id", "kind", "recipe", "tests", "solution", "recorded", "split", "limits"], rows))
        tail = f"{len(res.tasks)} tasks"
        if res.skipped:
            tail += f", {res.skipped} parquet rows skipped (task folder not found; see --tasks-dir)"
        if res.errors:
            tail += f", {len(res.errors)} with errors (below)"
        print(tail, file=sys.stderr)
    _print_errors(res)
    return 2 if res.errors else 0


def cmd_show(args: argparse.Namespace) -> int:
    from et_hpc.tasks.loader import default_base_map
    from et_hpc.tasks.recipe import normalise

    args.ids = [args.id]
    args.glob = args.split = args.sample = None
    args.seed = 0
    res = load_source(args)
    task = res.by_id(args.id)
    if task is None:
        if res.errors:
            raise res.errors[0]
        raise UserError(f"no task {args.id!r} in {args.source or args.tasks_dir}; see 'et-hpc tasks list'")
    recipe_err = None
    try:
        norm = normalise(task, base_map=default_base_map())
    except TaskError as e:
        norm, recipe_err = None, str(e)
    if args.json:
        d = task_summary(task)
        if args.truth:
            d["truth"] = task.truth
        d["normalised"] = (
            None
            if norm is None
            else {
                "text": norm.text,
                "files": [[str(h), dest] for h, dest in norm.files],
                "base": str(norm.base) if norm.base else None,
                "rewrites": norm.rewrites,
                "workdir": norm.workdir,
                "user": norm.user,
                "env": norm.env,
            }
        )
        d["recipe_error"] = recipe_err
        print(json.dumps(d, indent=2))
    else:
        t = task
        rows = [
            ("id", t.id),
            ("kind", t.source_kind),
            ("source", t.source),
            ("split", t.split or "-"),
            ("recipe", f"{t.recipe.kind} {t.recipe.path}"),
            ("initial tests", t.initial_tests or "-"),
            ("final tests", t.final_tests or "-"),
            ("solution", t.solution or "-"),
            ("recorded runs", ", ".join(p.name for p in t.recorded_runs) or "-"),
            ("limits", _limits_str(t)),
        ]
        rows += [(f"meta.{k}", v) for k, v in sorted(t.metadata.items())]
        w = max(len(k) for k, _ in rows)
        for k, v in rows:
            print(f"{k.ljust(w)}  {v}")
        print("\n== prompt\n" + t.prompt.rstrip())
        if args.truth:
            print("\n== truth\n" + (t.truth or "(none)").rstrip())
        else:
            print("\n(truth hidden; --truth shows it)" if t.truth is not None else "\n(no truth)")
        if norm is not None:
            print("\n== recipe rewrites")
            for r in norm.rewrites or ["(none)"]:
                print(f"- {r}")
            if norm.workdir:
                print(f"runtime cwd: {norm.workdir}")
            if norm.text:
                print("\n== normalised recipe\n" + norm.text.rstrip())
    if recipe_err:
        print(f"et-hpc: error: {recipe_err}", file=sys.stderr)
        return 2
    return 0


LIST_EXAMPLES = """\
examples:
  et-hpc tasks list ./tasks                              every task folder under ./tasks
  et-hpc tasks list train.parquet --tasks-dir ./tasks    SkyRL rows, folders found by name
  et-hpc tasks list ./tasks --glob 'task_0000*' --sample 20 --seed 1 --json
"""

SHOW_EXAMPLES = """\
examples:
  et-hpc tasks show task_000000_9cc1e5be ./tasks
  et-hpc tasks show demo_csv_sum defs/demo --truth
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "tasks",
        help="list and inspect task sources",
        description="Find tasks in folders (native and Harbor layouts) and SkyRL parquet files.",
    )
    sub = add_subcommands(p, "tasks_command")

    pl = add_command(
        sub,
        "list",
        help="table of the tasks a source holds",
        description="List tasks: id, layout, recipe kind, number of test files, reference solution, "
        "recorded runs, split and limits. Per-task load errors go to stderr, one line each; the exit "
        "status is 2 when there was any.",
        epilog=LIST_EXAMPLES,
    )
    add_source_args(pl)
    pl.add_argument("--validate", action="store_true", help="also parse every recipe (def or Dockerfile) and report problems")
    pl.add_argument("--json", action="store_true", help="machine-readable output (no truth)")
    pl.set_defaults(func=cmd_list)

    ps = add_command(
        sub,
        "show",
        help="everything about one task, with its normalised recipe",
        description="Show one task: files, limits, metadata, prompt, and the recipe as it will be built "
        "(with the list of rewrites made to it). The privileged truth is hidden unless --truth.",
        epilog=SHOW_EXAMPLES,
    )
    ps.add_argument("id", metavar="ID", help="task id (the folder name)")
    ps.add_argument("source", nargs="?", metavar="SOURCE", help=SOURCE_HELP + " (default: --tasks-dir)")
    ps.add_argument("--tasks-dir", metavar="D", help="folder holding the task_* folders that parquet rows name")
    ps.add_argument("--truth", action="store_true", help="also print the privileged ground truth")
    ps.add_argument("--json", action="store_true", help="machine-readable output")
    ps.set_defaults(func=cmd_show)

    from et_hpc.cli import check

    check.register(sub)
