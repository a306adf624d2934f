"""CLI for the platform: ``et-hpc doctor`` and ``et-hpc base build|show``."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from et_hpc.cli.common import add_command, add_subcommands
from et_hpc.util import format_table


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="check apptainer, rootless support, Slurm, scratch and cache",
        description="Check that this machine can build images and run episodes. Prints OK/WARN/FAIL per "
        "check with the fix for each problem. Exit 0 when usable, 2 when not.",
        epilog="example: et-hpc doctor --json | jq '.[] | select(.status != \"OK\")'",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_doctor)

    b = subparsers.add_parser(
        "base",
        help="build or show the base image task defs start from",
        description="The base image is what task defs name as 'From: ./ubuntu_22.04.sif'.",
    )
    bsub = add_subcommands(b, "base_cmd", "ACTION")
    bb = add_command(
        bsub,
        "build",
        help="build the base image into the cache (a no-op when present)",
        description="Build the base SIF into the image cache. --source auto uses docker://ubuntu:22.04 when "
        "a registry is reachable, else builds offline from Debian's archive with mmdebstrap and a "
        "compatibility layer (defs/base/debian-compat.sh). A second run finds the cached image.",
        epilog="examples:\n  et-hpc base build\n  et-hpc base build --source debian\n"
        "  et-hpc base build --from-sif ~/ubuntu_22.04.sif   # pulled elsewhere",
    )
    bb.add_argument("--source", choices=["auto", "docker", "debian"], default="auto", help="where the base comes from (default: auto)")
    bb.add_argument("--from-sif", type=Path, help="import this SIF as the base image")
    bb.add_argument("--force", action="store_true", help="rebuild even when cached")
    bb.add_argument("--mirror", default=None, help="Debian mirror for --source debian")
    bb.add_argument("--suite", default=None, help="Debian suite for --source debian (default bookworm)")
    bb.add_argument("--json", action="store_true")
    bb.set_defaults(func=cmd_base_build)
    bs = bsub.add_parser("show", help="show the cached base image")
    bs.add_argument("--json", action="store_true")
    bs.set_defaults(func=cmd_base_show)


def cmd_doctor(args) -> int:
    from et_hpc.host.doctor import CHECKS, FAIL, check_mmdebstrap, run_checks
    from et_hpc.images.base import check_base

    at = CHECKS.index(check_mmdebstrap)  # the base image is reported just before mmdebstrap
    checks = run_checks([*CHECKS[:at], check_base, *CHECKS[at:]])
    if args.json:
        print(json.dumps([c.to_json() for c in checks], indent=1))
    else:
        print(format_table(["", "check", "detail"], [[c.status, c.name, c.detail] for c in checks]))
        fixes = [c for c in checks if c.status != "OK" and c.fix]
        if fixes:
            print()
            for c in fixes:
                print(f"{c.status} {c.name}: fix: {c.fix}")
    bad = [c for c in checks if c.status == FAIL]
    if bad and not args.json:
        print(f"\n{len(bad)} check(s) failed: et-hpc cannot run here until they are fixed.")
    return 2 if bad else 0


def cmd_base_build(args) -> int:
    from et_hpc.images import base

    kw = {}
    if args.mirror:
        kw["mirror"] = args.mirror
    if args.suite:
        kw["suite"] = args.suite
    t0 = time.monotonic()
    if not args.json and (base.cached_base() is None or args.force):
        print("building the base image (a few minutes the first time)...", flush=True)
    img = base.ensure_base(args.source, force=args.force, from_sif=args.from_sif, **kw)
    dt = time.monotonic() - t0
    if args.json:
        print(json.dumps(img.to_json() | {"seconds": round(dt, 3)}))
    elif img.cached:
        print(f"cached: {img.path} (source {img.source}, sha256 {img.digest[:12]}); nothing to do [{dt:.2f}s]")
    else:
        print(f"built: {img.path} (source {img.source}, sha256 {img.digest[:12]}) in {dt:.0f}s")
    return 0


def cmd_base_show(args) -> int:
    from et_hpc.errors import UserError
    from et_hpc.images import base

    img = base.cached_base()
    if img is None:
        raise UserError(f"no base image in {base.base_dir()}: run 'et-hpc base build'")
    print(json.dumps(img.to_json(), indent=1) if args.json else f"{img.path}  source={img.source}  sha256={img.digest}")
    return 0
