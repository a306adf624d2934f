"""Argument helpers the command modules share: subcommands, the task-source options and loading them."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from et_hpc.errors import UserError

if TYPE_CHECKING:
    from et_hpc.images.store import ImageStore
    from et_hpc.tasks.model import Task

SOURCE_HELP = (
    "a task folder, a folder of task folders (native and Harbor mixed), a .parquet file or a folder "
    "of them (SkyRL format), or a hub data set org/name"
)


def add_command(subparsers: argparse._SubParsersAction, name: str, **kw: Any) -> argparse.ArgumentParser:
    """A subcommand whose description and epilog print as written (line breaks kept); ``kw``: help,
    description, epilog, ... as for ``add_parser``."""
    return subparsers.add_parser(name, formatter_class=argparse.RawDescriptionHelpFormatter, **kw)


def add_subcommands(parser: argparse.ArgumentParser, dest: str, metavar: str = "SUBCOMMAND") -> argparse._SubParsersAction:
    """The subcommands of ``parser``; given none, the command prints its help and exits 2."""

    def print_help(args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=print_help)
    return parser.add_subparsers(dest=dest, metavar=metavar)


def add_source_args(p: argparse.ArgumentParser, positional: bool = True) -> None:
    if positional:
        p.add_argument("source", nargs="?", metavar="SOURCE", help=SOURCE_HELP + " (default: --tasks-dir)")
    p.add_argument("--tasks-dir", metavar="D", help="folder holding the task_* folders that parquet rows name")
    p.add_argument("--ids", nargs="+", metavar="ID", help="only these task ids (exact)")
    p.add_argument("--glob", metavar="PAT", help="only ids matching this fnmatch pattern (comma-separated for several)")
    p.add_argument("--split", help="only this split (train, validation, ...); for a hub data set, the split to load")
    p.add_argument("--sample", type=int, metavar="N", help="a random sample of N tasks (deterministic for a seed)")
    p.add_argument("--seed", type=int, default=0, help="seed for --sample (default 0)")


def load_source(args: argparse.Namespace, validate: bool = False):
    from et_hpc.tasks.loader import load_tasks

    source = args.source or args.tasks_dir
    if not source:
        raise UserError("no task source given; pass SOURCE (a task folder, folder of tasks or .parquet) or --tasks-dir")
    if args.sample is not None and args.sample < 0:
        raise UserError(f"--sample {args.sample}: must be 0 or more")
    return load_tasks(
        source,
        tasks_dir=args.tasks_dir if args.source else None,
        ids=args.ids,
        glob=args.glob,
        split=args.split,
        sample=args.sample,
        seed=args.seed,
        validate=validate,
    )


def check_base_once(store: ImageStore, tasks: list[Task]) -> None:
    """A missing base image is one problem for the whole run, not one per task: say it once."""
    for t in tasks[:50]:
        r = store.lookup(t)
        if r.status == "failed" and r.reason and r.reason.startswith("base image "):
            raise UserError(r.reason)
