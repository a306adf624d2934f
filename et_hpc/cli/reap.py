"""The ``et-hpc reap`` command: stop sandboxes left behind by dead workers on this node."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from et_hpc.cli.common import add_command

DESCRIPTION = """\
Stop apptainer instances and delete overlays left on this node by et-hpc workers that died
without cleaning up (killed by Slurm, SIGKILL, node trouble). Sandboxes whose worker process is
still alive are never touched. Workers run this at start, so it is rarely needed by hand. With --images it also removes the
node-local image copies and unpacked trees (sandbox.local_copy) that no running sandbox uses,
e.g. in a job's epilog or after a run.
"""

EPILOG = """\
examples:
  et-hpc reap --dry-run          show what would be stopped and deleted
  et-hpc reap                    do it
  et-hpc reap --all --json       also instances named like ours outside this scratch dir
  et-hpc reap --images           also free node-local image copies and unpacked trees not in use
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers,
        "reap",
        help="stop sandboxes left by dead workers on this node",
        description=DESCRIPTION,
        epilog=EPILOG,
    )
    p.add_argument("--dry-run", action="store_true", help="only report what would be done")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--all", dest="all_runs", action="store_true", help="also stop instances named like et-hpc's whose owner process is dead"
    )
    p.add_argument("--images", action="store_true", help="also remove node-local image copies and unpacked trees no sandbox uses")
    p.add_argument(
        "--scratch", type=Path, default=None, help="node-local scratch dir (default: $ET_HPC_SCRATCH, $SLURM_TMPDIR, $TMPDIR or /tmp)"
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from et_hpc.sandbox.reaper import reap

    rep = reap(scratch=args.scratch, all_runs=args.all_runs, dry_run=args.dry_run)
    out = rep.model_dump()
    if args.images:
        from et_hpc.images.local_copy import clear_unused

        removed, kept = clear_unused(args.scratch, dry_run=args.dry_run)
        out["images_removed"] = [{"path": str(c.path), "bytes": c.size} for c in removed]
        out["images_in_use"] = [{"path": str(c.path), "bytes": c.size} for c in kept]
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        verb = "would stop" if rep.dry_run else "stopped"
        print(
            f"{verb} {len(rep.stopped)} instance(s); "
            f"{'would delete' if rep.dry_run else 'deleted'} {len(rep.deleted)} file(s); "
            f"kept {len(rep.kept)} live sandbox(es)"
        )
        for n in rep.stopped:
            print(f"  instance {n}")
        for f in rep.deleted:
            print(f"  file {f}")
        if args.images:
            print(
                f"{'would remove' if rep.dry_run else 'removed'} {len(removed)} node-local image(s) "
                f"({sum(c.size for c in removed) / 1e9:.2f} GB); {len(kept)} in use kept"
            )
            for c in removed:
                print(f"  image {c.path}")
        for e in rep.errors:
            print(f"  error: {e}")
    return 1 if rep.errors else 0
