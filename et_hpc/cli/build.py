"""``et-hpc build``: build every selected task's image into the shared cache, here or as a Slurm array."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from et_hpc.cli.common import add_command, add_source_args, add_subcommands, check_base_once, load_source
from et_hpc.errors import TaskError, UserError
from et_hpc.host.slurm import SlurmConfig
from et_hpc.images import orchestrate, space, store_gc
from et_hpc.images.orchestrate import SlurmBuildRequest, Submit
from et_hpc.images.slurm_build import BuildChunk  # submitit pickles name this path too
from et_hpc.images.store import ImageResult, ImageStore, default_jobs
from et_hpc.runner.arrays import Array, ArraySpec
from et_hpc.runner.executors import get_executor
from et_hpc.util import format_table, one_line, progress_bar

if TYPE_CHECKING:
    from et_hpc.tasks.model import Task

_check_base = check_base_once  # its old name

DESCRIPTION = """\
Build the Apptainer image of every selected task, rootless (--fakeroot), into the content-addressed
image cache ($ET_HPC_CACHE, default ~/.cache/et-hpc; put it on the shared filesystem). An image
is built once per recipe content: tasks already built are 'cached' in milliseconds, a build that
failed before is reported again without rebuilding (until --retry-failed). Concurrent builders
(other shells, other nodes, Slurm array tasks) of the same image wait for one another.

Exit status: 0 when every image is built or cached, 1 when some failed (listed), 2 on bad input.
"""

EPILOG = """\
examples:
  et-hpc build ./tasks                                  build all tasks here, 1 build per 2 cores
  et-hpc build ./tasks --glob 'task_00*' --jobs 2 --json
  et-hpc build train.parquet --tasks-dir ./tasks --sample 50 --seed 1
  et-hpc build ./tasks --slurm --partition cpu --time 2:00:00 --cpus 4 --mem 16G
  et-hpc build ./tasks --dry-run                        only show what is cached, failed or missing
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers, "build", help="build task images into the shared cache (locally or on Slurm)", description=DESCRIPTION, epilog=EPILOG
    )
    add_source_args(p)
    p.add_argument(
        "--jobs", "-j", type=int, metavar="N", help=f"builds at once on this node (default: half the cores, here {default_jobs()})"
    )
    p.add_argument("--retry-failed", action="store_true", help="build again images whose build failed before")
    p.add_argument("--dry-run", action="store_true", help="build nothing; show each task's image status")
    p.add_argument("--cache", type=Path, metavar="DIR", help="image cache (default $ET_HPC_CACHE or ~/.cache/et-hpc)")
    p.add_argument("--build-timeout", type=float, metavar="S", help="seconds one build may take (default 1800)")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    s = p.add_argument_group("Slurm (--slurm builds as an array job; each array task builds a chunk)")
    s.add_argument("--slurm", action="store_true", help="submit the builds as a Slurm array and wait for it")
    s.add_argument("--partition", metavar="P", help="Slurm partition")
    s.add_argument("--time", default="60", metavar="T", help="walltime of one array task: minutes, or [D-]HH:MM[:SS] (default 60)")
    s.add_argument("--cpus", type=int, default=2, metavar="C", help="cpus per array task (default 2)")
    s.add_argument("--mem", metavar="M", help="memory per array task, e.g. 8G or 4000M")
    s.add_argument("--array-parallelism", type=int, default=32, metavar="K", help="array tasks running at once (default 32)")
    s.add_argument(
        "--per-task", type=int, metavar="N", help="tasks built by one array task (default: enough to stay within 1000 array tasks)"
    )
    s.add_argument("--deadline", type=float, metavar="MIN", help="stop waiting after this many minutes (default: walltime x waves + 10)")
    p.set_defaults(func=cmd_build)

    images = add_command(subparsers, "images", help="the image cache: remove images no task references (gc)")
    g = add_command(add_subcommands(images, "images_command"), "gc", help="remove images no kept task references", description=GC_HELP)
    add_source_args(g)
    g.add_argument("--cache", type=Path, metavar="DIR", help="image cache (default $ET_HPC_CACHE or ~/.cache/et-hpc)")
    g.add_argument("--min-age", type=float, default=24.0, metavar="H", help="keep images built or used within H hours (default 24)")
    g.add_argument("--dry-run", action="store_true", help="remove nothing; show what would go")
    g.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    g.set_defaults(func=cmd_gc)


GC_HELP = """\
Remove from the image cache every task image that no task of SOURCE references (the tasks you keep:
give the source your runs use), unless it was built or used within --min-age hours, or a build
holds its lock, or a running episode its lease (safe while runs read the cache). Base images are
never removed. Exit status 0; 2 on bad input, including a SOURCE with tasks that cannot be loaded.

example:
  et-hpc images gc ./tasks --min-age 0 --dry-run
"""


def cmd_gc(args: argparse.Namespace) -> int:
    if args.min_age < 0:
        raise UserError(f"--min-age {args.min_age}: must be 0 or more")
    res = load_source(args)
    if res.errors:
        raise UserError(f"{len(res.errors)} task(s) of the source cannot be loaded, so their images cannot be named: {res.errors[0]}")
    if not res.tasks:
        raise UserError("no tasks selected: gc keeps the images of the tasks you name; check SOURCE and the filters")
    store = ImageStore(args.cache)
    out = store_gc.gc(store, store_gc.keep_keys(store, list(res.tasks)), min_age_s=args.min_age * 3600, dry_run=args.dry_run)
    if args.json:
        print(json.dumps({**store_gc.as_dict(out), "dry_run": args.dry_run}, indent=2))
    else:
        verb = "would remove" if args.dry_run else "removed"
        print(
            f"{verb} {len(out.removed)} image(s) ({space.human(out.freed_bytes)}); kept {out.kept} referenced, "
            f"{len(out.recent)} recent, {len(out.in_use)} in use"
        )
    return 0


# -- argument parsing --------------------------------------------------------------------------
def parse_minutes(text: str) -> int:
    """Slurm-style time -> whole minutes: ``90``, ``1:30:00``, ``2-00:00:00``, ``45:00`` (MM:SS)."""
    t = str(text).strip()
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", t)
    if not m:
        raise UserError(f"--time {text!r}: use minutes or [D-]HH:MM[:SS], e.g. 90 or 1:30:00")
    d, b, c = (int(x) if x else None for x in m.group(1, 3, 4))
    a = int(m.group(2))  # the one group the pattern always matches
    if b is None:  # then c is None too: the pattern matches a third field only after a second
        mins = a if d is None else d * 1440 + a * 60
    elif c is None:  # A:B is MM:SS without days, HH:MM with days
        mins = a + math.ceil(b / 60) if d is None else d * 1440 + a * 60 + b
    else:
        mins = (d or 0) * 1440 + a * 60 + b + math.ceil(c / 60)
    if mins < 1:
        raise UserError(f"--time {text!r}: must be at least one minute")
    return mins


def parse_mem_gb(text: str | None) -> float | None:
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", str(text), re.I)
    if not m:
        raise UserError(f"--mem {text!r}: use a size like 8G or 4000M")
    scale = {"": 1 / 1024, "K": 1 / 1024**2, "M": 1 / 1024, "G": 1, "T": 1024}[m.group(2).upper()]
    return float(m.group(1)) * scale


# -- the command ---------------------------------------------------------------------------------
def cmd_build(args: argparse.Namespace) -> int:
    if args.jobs is not None and args.jobs < 1:
        raise UserError(f"--jobs {args.jobs}: must be 1 or more")
    if args.slurm:
        parse_minutes(args.time)  # bad input is reported before any work
    res = load_source(args)
    for e in res.errors:
        print(f"et-hpc: error: {e}", file=sys.stderr)
    tasks = res.tasks
    if not tasks:
        if res.errors:
            raise UserError(f"no task could be loaded ({len(res.errors)} errors above)")
        raise UserError("no tasks selected: check SOURCE and the --ids/--glob/--split filters ('et-hpc tasks list')")
    overrides = {"build_timeout_s": args.build_timeout} if args.build_timeout else {}
    store = ImageStore(args.cache, **overrides)
    check_base_once(store, tasks)

    plan_space(store, tasks, args)
    t0 = time.monotonic()
    if args.dry_run:
        results = [store.lookup(t) for t in tasks]
    elif args.slurm:
        results = build_on_slurm(store, tasks, args)
    else:
        results = build_here(store, tasks, args)
    return report(results, res.errors, time.monotonic() - t0, args)


def plan_space(store: ImageStore, tasks: list[Task], args: argparse.Namespace) -> None:
    """Refuse (exit 2, one line) a build whose images would not fit on the cache or on scratch."""
    _first, todo = orchestrate.todo_of(store, tasks, args.retry_failed)
    jobs = max(1, args.cpus // 2) if args.slurm else (args.jobs or default_jobs())
    scratch = None if args.slurm else store.scratch  # a Slurm build's scratch is on its nodes
    needs = space.build_needs(store.cache_dir, scratch, store.base_map.values(), len(todo), jobs)
    rooms, refused = space.check(needs)
    if refused:
        raise UserError(refused)
    if args.dry_run and todo:
        print(f"space for {len(todo)} image(s): {space.summary(rooms)}", file=sys.stderr)


def report(results: list[ImageResult], errors: list[TaskError], seconds: float, args: argparse.Namespace) -> int:
    counts: dict[str, int] = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    failed = [r for r in results if r.status == "failed"]
    missing = [r for r in results if r.status == "missing"]
    if args.json:
        print(
            json.dumps(
                {
                    "results": [json.loads(r.model_dump_json()) for r in results],
                    "counts": counts,
                    "load_errors": [str(e) for e in errors],
                    "seconds": round(seconds, 2),
                },
                indent=2,
            )
        )
    else:
        rows = [[r.task_id, r.status, f"{r.seconds:.1f}", _one_line(r.reason) if r.reason else "-"] for r in results]
        print(format_table(["task", "status", "seconds", "reason"], rows))
        print(", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + f" in {seconds:.0f} s", file=sys.stderr)
        if failed:
            logs = {str(r.log_path) for r in failed if r.log_path}
            print(
                f"failed: {', '.join(r.task_id for r in failed)}" + (f" (logs: {', '.join(sorted(logs))})" if logs else ""), file=sys.stderr
            )
        if missing and not args.dry_run:
            print(f"not built: {', '.join(r.task_id for r in missing)}", file=sys.stderr)
    if args.dry_run:
        return 0 if not errors else 2
    return 1 if failed or missing or errors else 0


def _one_line(s: str, width: int = 110) -> str:
    return one_line(s, width)


# -- wiring: the executors submit; et_hpc.images.orchestrate builds and collects -------------------
def _submit(executor: str) -> Submit:
    def submit(chunks: list[BuildChunk], folder: Path, name: str, slurm: SlurmConfig | None) -> Array:
        spec = ArraySpec(folder=folder, name=name, what="build array") if slurm else ArraySpec(folder=folder, name=name)
        if slurm is not None:
            spec.slurm = slurm
        return get_executor(executor).submit_array(chunks, spec)

    return submit


def build_on_slurm(store: ImageStore, tasks: list[Task], args: argparse.Namespace) -> list[ImageResult]:
    """The builds as a Slurm array (et_hpc.images.orchestrate), with a progress bar here."""
    req = SlurmBuildRequest(
        time_min=parse_minutes(args.time),
        cpus=args.cpus,
        mem_gb=parse_mem_gb(args.mem),
        partition=args.partition,
        array_parallelism=args.array_parallelism,
        per_task=args.per_task,
        deadline_min=args.deadline,
        retry_failed=args.retry_failed,
    )
    bars: list[Any] = []

    def on_progress(done: int, total: int, counts: dict[str, int]) -> None:
        if not bars:
            bars.append(progress_bar(total=total, desc="images", unit="task", show=True, dynamic_ncols=True))
        bars[0].n = done
        bars[0].set_postfix(counts, refresh=False)
        bars[0].refresh()

    try:
        return orchestrate.build_on_slurm(store, tasks, req, _submit("slurm"), notify=_say, on_progress=on_progress)
    finally:
        for bar in bars:
            bar.close()


def build_here(store: ImageStore, tasks: list[Task], args: argparse.Namespace) -> list[ImageResult]:
    """Every task's image built on this node (et_hpc.images.orchestrate.build_here)."""
    return orchestrate.build_here(store, tasks, _submit("local"), retry_failed=args.retry_failed, jobs=args.jobs)


def _say(line: str) -> None:
    print(f"et-hpc: {line}" if line.startswith(("stopped", "gave up")) else line, file=sys.stderr)
