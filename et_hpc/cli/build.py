"""``et-hpc build``: build every selected task's image into the shared cache, here or as a Slurm array."""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from et_hpc.cli.common import add_command, add_source_args, check_base_once, load_source
from et_hpc.errors import TaskError, UserError
from et_hpc.host.slurm import SlurmConfig
from et_hpc.images.slurm_build import BuildChunk  # submitit pickles name this path too
from et_hpc.images.store import ImageResult, ImageStore, default_jobs
from et_hpc.runner.arrays import Array, ArraySpec
from et_hpc.runner.executors import get_executor
from et_hpc.util import format_table, one_line, progress_bar

if TYPE_CHECKING:
    from et_hpc.tasks.model import Task

_check_base = check_base_once  # its old name

log = logging.getLogger(__name__)

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

    t0 = time.monotonic()
    if args.dry_run:
        results = [store.lookup(t) for t in tasks]
    elif args.slurm:
        results = build_on_slurm(store, tasks, args)
    else:
        results = build_here(store, tasks, args)
    return report(results, res.errors, time.monotonic() - t0, args)


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


# -- Slurm -----------------------------------------------------------------------------------------
def build_on_slurm(store: ImageStore, tasks: list[Task], args: argparse.Namespace) -> list[ImageResult]:
    from et_hpc.host import slurm as host_slurm

    time_min = parse_minutes(args.time)
    mem_gb = parse_mem_gb(args.mem)
    if args.cpus < 1 or args.array_parallelism < 1:
        raise UserError("--cpus and --array-parallelism must be 1 or more")
    # Only tasks that need work go to Slurm; the rest are answered from the cache now.
    first = {t.id: store.lookup(t) for t in tasks}
    todo = [t for t in tasks if first[t.id].status == "missing" or (args.retry_failed and first[t.id].status == "failed")]
    if not todo:
        return [first[t.id] for t in tasks]
    per = args.per_task or max(1, math.ceil(len(todo) / 1000))
    chunks = [todo[i : i + per] for i in range(0, len(todo), per)]
    jobs_per_node = max(1, args.cpus // 2)
    slurm_cfg = SlurmConfig(
        partition=args.partition, time_min=time_min, cpus_per_task=args.cpus, mem_gb=mem_gb, array_parallelism=args.array_parallelism
    )
    arr = get_executor("slurm").submit_array(
        [BuildChunk(store.cache_dir, store.settings, store.base_map, c, args.retry_failed, jobs_per_node) for c in chunks],
        ArraySpec(folder=store.cache_dir / "slurm", name="et-hpc-build", slurm=slurm_cfg, what="build array"),
    )
    ids = arr.ids  # updated in place as the rest is submitted (within the site's submit limits)
    waiting = getattr(arr, "waiting", "")
    print(
        f"submitted Slurm array {', '.join(getattr(arr, 'array_ids', [])) or '(none yet)'}: {len(chunks)} array tasks for "
        f"{len(todo)} images (logs in {store.cache_dir / 'slurm'})" + (f"; {waiting}" if waiting else ""),
        file=sys.stderr,
    )

    waves = math.ceil(len(chunks) / args.array_parallelism)
    deadline_s = 60 * (args.deadline if args.deadline else time_min * waves + 10)
    bar = progress_bar(total=len(todo), desc="images", unit="task", show=True, dynamic_ncols=True)
    state = {"last": 0.0}

    def on_poll(states: dict[str, str]) -> None:
        now = time.monotonic()
        if now - state["last"] < 10 and not all(host_slurm.ended(s) for s in states.values()):
            return
        state["last"] = now
        done = sum(1 for t in todo if store.lookup(t).status in ("cached", "failed"))
        bar.n = done
        bar.set_postfix(host_slurm.counts(states), refresh=False)
        bar.refresh()

    try:
        states, all_ended = arr.wait(poll_s=3.0, timeout_s=deadline_s, on_poll=on_poll)
    except KeyboardInterrupt:
        bar.close()
        print(
            f"et-hpc: stopped waiting; the array keeps running (scancel {' '.join(getattr(arr, 'array_ids', []))} to stop it)",
            file=sys.stderr,
        )
        raise
    bar.close()

    by_id: dict[str, ImageResult] = {}
    for i, chunk in enumerate(chunks):
        by_id.update(_collect(store, arr, i, chunk, states.get(ids[i], host_slurm.UNKNOWN)))
    if not all_ended:
        print(f"et-hpc: gave up waiting after {deadline_s / 60:.0f} min (--deadline); the array keeps running", file=sys.stderr)
    return [by_id.get(t.id) or first[t.id] for t in tasks]


def _collect(store: ImageStore, arr: Array, i: int, chunk: list[Task], st: str) -> dict[str, ImageResult]:
    """The results of array task ``i`` (in state ``st``): what it returned, else what the cache says."""
    from et_hpc.host import slurm as host_slurm

    tid = arr.ids[i]
    got: list[dict] | None = None
    if host_slurm.ended(st):
        try:
            got = arr.result(i)
        except Exception as e:  # killed, timed out, or crashed: the cache tells what got built
            log.info("array task %s: %s", tid, str(e).strip().splitlines()[-1:] or e)
    out: dict[str, ImageResult] = {}
    if got:
        for d in got:
            r = ImageResult(**d)
            if r.status == "failed" and st not in host_slurm.DONE:
                r.reason = f"{r.reason} (Slurm array task {tid} ended {st})"
            out[r.task_id] = r
        return out
    for t in chunk:
        r = store.lookup(t)
        if r.status == "missing":
            r = r.model_copy(
                update={
                    "status": "failed",
                    "reason": (
                        f"Slurm array task {tid} ended {st} before building it (log: {arr.log_path(i)})"
                        if host_slurm.ended(st)
                        else f"still building in Slurm array task {tid} ({st}) when the wait ended; rerun to collect"
                    ),
                }
            )
        out[t.id] = r
    return out


def build_here(store: ImageStore, tasks: list[Task], args: argparse.Namespace) -> list[ImageResult]:
    """Every task's image built on this node, as one in-process task of the local executor."""
    chunk = BuildChunk(store.cache_dir, store.settings, store.base_map, tasks, args.retry_failed, args.jobs or default_jobs())
    chunk.progress, chunk.store = True, store
    arr = get_executor("local").submit_array([chunk], ArraySpec(folder=store.cache_dir / "slurm", name="build"))
    try:
        arr.wait(poll_s=1.0)
    except KeyboardInterrupt:  # the builds got the signal too: let them end and the index be saved
        arr.stop(60.0)
        raise
    return [ImageResult(**d) for d in arr.result(0)]
