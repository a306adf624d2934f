"""The ``et-hpc`` command line.

Each area registers its own subcommands through a ``register(subparsers)`` function in a
module of this package listed in ``_AREAS``; this file only wires them up and turns ``UserError``,
and an ``OSError`` naming a path (a store or scratch this user cannot write), into one line on
stderr with exit status 2. Everything a command prints (stdout, stderr, log lines) goes through
``et_hpc.text.visible``: agent-chosen text in a record never reaches the terminal raw.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import os
import sys

from et_hpc import __version__
from et_hpc.errors import UserError
from et_hpc.text import VisibleStream, configure_logging

# Modules that provide ``register(subparsers)``; each adds one or more subcommands.
_AREAS = [
    "et_hpc.cli.host",
    "et_hpc.cli.tasks",
    "et_hpc.cli.build",
    "et_hpc.cli.reap",
    "et_hpc.cli.run",
    "et_hpc.cli.rollouts",
    "et_hpc.cli.store",
    "et_hpc.cli.demo",
    "et_hpc.cli.model",
    "et_hpc.cli.report",
    "et_hpc.cli.view",
    "et_hpc.cli.rescore",
]

EPILOG = """\
typical session on a cluster:
  et-hpc doctor                          check apptainer, rootless support, Slurm, disks
  et-hpc base build                      build the base image tasks start from (once)
  et-hpc tasks list --tasks-dir DIR      see what tasks were found
  et-hpc build --tasks-dir DIR --slurm   build every task image into the shared cache
  et-hpc run --config run.yaml           run episodes (locally or as Slurm arrays)
  et-hpc status RUN                      progress of a run
Run 'et-hpc COMMAND --help' for each command's options.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="et-hpc",
        description="Run Endless Terminals agent episodes on HPC clusters: rootless Apptainer, "
        "Slurm arrays, a parquet store on the shared filesystem.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"et-hpc {__version__}")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for mod in _AREAS:
        importlib.import_module(mod).register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    out, err = sys.stdout, sys.stderr
    # once: a command run from another (the demo runs `run` in-process) keeps the one wrapper, so
    # `unescaped` still reaches the terminal for the progress bars' carriage returns
    sys.stdout, sys.stderr = (s if isinstance(s, VisibleStream) else VisibleStream(s) for s in (out, err))
    try:
        return _main(argv)
    finally:
        sys.stdout, sys.stderr = out, err


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(logging.WARNING - 10 * min(args.verbose, 2))
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc = args.func(args)
    except UserError as e:
        print(f"et-hpc: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("et-hpc: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `et-hpc tasks list | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:  # a path we were given or told to use that cannot be used: one line
        if e.filename is None:
            raise
        logging.getLogger("et_hpc").debug("%s", e, exc_info=True)
        hint = ""
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            hint = " (use a place this user can write: --store or ET_HPC_STORE, ET_HPC_SCRATCH, ET_HPC_CACHE)"
        print(f"et-hpc: error: {e.filename}: {e.strerror or e}{hint}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
