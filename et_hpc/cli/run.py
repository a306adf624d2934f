"""``et-hpc run`` and ``et-hpc status``: the command-line face of the runner."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from et_hpc.cli.common import add_command
from et_hpc.errors import UserError
from et_hpc.host import slurm as host_slurm
from et_hpc.paths import find_run_dir
from et_hpc.runner.base import Outcome
from et_hpc.runner.config import RunConfig, config_keys_text, load_config, parse_set
from et_hpc.runner.executors import get_executor
from et_hpc.runner.plan import NO_IMAGE, OK, Plan, make_plan, open_store, read_run_json
from et_hpc.runs.store import RunStore
from et_hpc.util import format_table, pct, progress_bar

RUN_HELP_TEMPLATE = """\
Run agent episodes for every selected task, SAMPLES times each (a unit is one task and sample),
on this machine or as Slurm array jobs. Task images must be built first ('et-hpc build SOURCE').

Each finished episode is written to the run's store (<store>/<run name>/part-*.parquet) as soon
as it ends, so an interrupted run loses only the episodes that were running. Rerunning the same
command resumes: units already ok (and units with an error, unless --retry-errors) are skipped.
An episode that ends with a sandbox-side error (infra_error, shell_error, score_error: the host, not
the agent) is run again at once up to 'retries' times (default 1); only its last attempt is stored,
the earlier ones as events.
Tasks whose image build failed do not stop the run: the others run, the broken ones are listed
with their one-line reasons and recorded as status no_image (rerun once they build: they are
planned again without --retry-errors). Images never built, or none at all, refuse the run;
--strict refuses on any missing or failed image.
With --executor slurm the units go in chunks of slurm.units_per_task to array tasks that run
slurm.array_parallelism at a time; the command waits for them (or returns with --detach) and
reports array tasks that were cancelled or failed; rerun it to do what they left undone.
When no episode of the run is running any more, the store's small shards are merged into a few
large ones (skip with --no-compact; 'et-hpc store compact RUN_DIR' does it later).

Settings come from a YAML run config, then --set KEY=VALUE, then the dedicated flags.
{config_keys}

Exit status: 0 every unit is done, 1 units are still missing (rerun), 2 bad input,
3 stopped watching Slurm jobs that keep running (slurm.wait_timeout_min), 130 interrupted.
"""
RUN_HELP = RUN_HELP_TEMPLATE.replace("{config_keys}", config_keys_text())
RUN_EPILOG = """\
examples:
  # the 4 demo tasks, 2 oracle episodes each, 4 at a time on this machine
  et-hpc build defs/demo
  et-hpc run defs/demo --policy oracle --samples 2 --concurrency 4 --run-name demo
  # the same as Slurm arrays of 8 units per task, at most 16 tasks at once
  et-hpc run defs/demo --policy oracle --samples 50 --executor slurm \\
      --set slurm.units_per_task=8 --set slurm.array_parallelism=16 --set slurm.partition=cpu
  # everything from a run config; submit and return, then follow it
  et-hpc run --config run.yaml --executor slurm --detach
  et-hpc status demo
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(subparsers, "run", help="run episodes (locally or as Slurm arrays); resumable", description=RUN_HELP, epilog=RUN_EPILOG)
    p.add_argument("source", nargs="?", help="task source: a folder of tasks or a parquet file")
    p.add_argument("--config", type=Path, help="YAML run config")
    p.add_argument("--tasks-dir", type=Path, help="folder of task folders")
    p.add_argument("--samples", type=int, help="episodes per task (group size)")
    p.add_argument("--policy", help="policy kind: oracle, null, replay or openai")
    p.add_argument("--executor", choices=["local", "slurm"])
    p.add_argument("--concurrency", type=int, help="episodes at once per node")
    p.add_argument("--run-name", help="name of the run (its folder in the store)")
    p.add_argument("--store", type=Path, help="store root (default $ET_HPC_STORE or ./et-hpc-runs)")
    p.add_argument("--detach", action="store_true", help="slurm: return after submitting")
    p.add_argument("--retry-errors", action="store_true", help="run again units recorded with an error")
    p.add_argument("--strict", action="store_true", help="refuse to start when any task image is missing or failed to build")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set slurm.units_per_task=4 (repeatable)",
    )
    p.add_argument("--no-compact", action="store_true", help="do not merge the store's shards when the run ends")
    p.add_argument("--json", action="store_true", help="print the final summary as JSON")
    p.add_argument(
        "--continuous",
        action="store_true",
        help="keep producing groups from a work queue until stopped (et_hpc.rollouts; 'et-hpc rollouts --help')",
    )
    p.add_argument("--target-groups", type=int, help="--continuous: stop once the stream holds N groups")
    p.add_argument("--workers", type=int, help="--continuous with slurm: long-lived worker array tasks")
    p.set_defaults(func=cmd_run)

    s = add_command(
        subparsers, "status", help="progress of a run: units done, array tasks, pass rate", description=STATUS_HELP, epilog=STATUS_EPILOG
    )
    s.add_argument("run", help="run directory, or run name inside --store")
    s.add_argument("--store", type=Path, help="store root used to find a run by name")
    s.add_argument("--json", action="store_true", help="print as JSON")
    s.add_argument("--capacity", action="store_true", help="add throughput, time split, sandbox memory, a projection and trainer KPIs")
    s.add_argument("--cores", metavar="C", help="--capacity: cores per node for the projection (default: this machine's)")
    s.add_argument("--nodes", metavar="N", help="--capacity: project for N nodes (default 1, 4 and 16)")
    s.add_argument(
        "--per-node",
        metavar="K",
        help="--capacity: project for K concurrent episodes per node (default: the run's observed concurrency and twice it)",
    )
    s.add_argument(
        "--gpu-hours",
        metavar="X",
        help="--capacity: GPU-hours of the model server(s) for "
        "accepted episodes per GPU-hour (default: sacct of the endpoint files' jobs, if any)",
    )
    s.set_defaults(func=cmd_status)


STATUS_HELP = """\
Show a run's progress: planned units, units done ok or with an error, the state of its latest
Slurm array tasks, and the pass rate so far.

--capacity adds, from every episode recorded (retries included): episodes/hour overall, per node
and per worker (Slurm array task, or process), each counted over its busy time (the union of its
episodes' start-stop intervals); model time as a share of episode wall time; the median/p95 of
each part of an episode (queue, setup, model, exec, score, teardown, total) and of the infra
overhead per episode (setup + score + teardown + queue); the sandboxes' peak memory
(median/p95/max) and processes; accepted episodes (ok, in groups without an error member) per
GPU-hour when the GPU-hours are known; per stream consumer of a continuous run the fraction of its
time spent waiting in next_batch and the staleness (versions behind) of the groups it got.

The projection uses a simple model: an episode holds one of a node's K slots for its wall time T
and keeps one core busy for its CPU time c = setup + exec + score + teardown + warm (a warm
sandbox's start, done ahead, still costs the node; model time is spent on the GPU server). A node with C cores finishes min(K/T, C/c) episodes per second: bound by its
slots (the model) below K = C*T/c, by its CPUs above; N nodes finish N times that, as long as the
model server keeps its measured latency.
"""  # noqa: E501  (the help text as written)
STATUS_EPILOG = """\
examples:
  et-hpc status oracle-smoke
  et-hpc status et-hpc-runs/oracle-smoke --json
  et-hpc status oracle-smoke --capacity --nodes 8 --per-node 16 --cores 32
  et-hpc status et-hpc-runs/oracle-smoke --capacity --json --gpu-hours 2.5
"""


def config_from_args(args: argparse.Namespace) -> RunConfig:
    overrides = parse_set(args.set)
    flags = {
        ("tasks", "source"): args.source,
        ("tasks", "tasks_dir"): args.tasks_dir and str(args.tasks_dir),
        ("samples",): args.samples,
        ("policy", "kind"): args.policy,
        ("executor",): args.executor,
        ("concurrency",): args.concurrency,
        ("name",): args.run_name,
        ("store",): args.store and str(args.store),
        ("retry_errors",): args.retry_errors or None,
        ("strict",): args.strict or None,
    }
    overrides += [(list(k), v) for k, v in flags.items() if v is not None]
    return load_config(args.config, overrides)


def unit_counts(plan: Plan, store: RunStore) -> dict[str, Any]:
    done = store.units()
    ok = err = no_img = 0
    for tid in plan.tasks:
        for s in range(plan.cfg.samples):
            st = done.get((tid, s))
            ok += st == OK
            no_img += st == NO_IMAGE
            err += st is not None and st not in (OK, NO_IMAGE)
    passed, n_ok = pass_stats(store)
    return {
        "units": plan.total,
        "ok": ok,
        "error": err,
        "no_image": no_img,
        "missing": plan.total - ok - err - no_img,
        "passed": passed,
        "pass_rate": round(passed / n_ok, 4) if n_ok else None,
    }


def pass_stats(store: RunStore) -> tuple[int, int]:
    """(episodes with full reward, ok episodes) over the run, one record per unit."""
    s = store.summary()
    return int(s.solved), int(s.ok)


def _print_summary(title: str, info: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(info, indent=2))
        return
    rate = info.get("pass_rate")
    rows = [[k, v] for k, v in info.items() if k not in ("pass_rate", "array_tasks", "missing_units", "no_image_tasks")]
    rows.append(["pass_rate", pct(rate)])
    print(title)
    print(format_table(["", "value"], rows))


def cmd_run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if args.continuous or cfg.continuous.enabled:
        from et_hpc.cli.rollouts import cmd_continuous

        if args.workers:
            cfg = cfg.model_copy(update={"continuous": cfg.continuous.model_copy(update={"workers": args.workers})})
        return cmd_continuous(cfg, args)
    plan = make_plan(cfg)
    plan_space(plan)
    if plan.units:
        from et_hpc.runner.slurm import refuse_if_jobs_live

        refuse_if_jobs_live(plan)
    print(
        f"run {cfg.run_name()} in {plan.run_dir}: {plan.total} units, {plan.done_ok} ok and "
        f"{plan.done_error} with errors already, {len(plan.units)} to run"
        + (f", {plan.no_image_units()} without an image" if plan.no_image else ""),
        file=sys.stderr,
    )
    for e in plan.load_errors[:5]:
        print(f"et-hpc: warning: task skipped: {e}", file=sys.stderr)
    if plan.no_image:
        print(
            f"et-hpc: warning: {len(plan.no_image)} task(s) have no image and are recorded as no_image "
            f"({plan.no_image_units()} units); the others run. Fix them, 'et-hpc build "
            f"{cfg.tasks.source or cfg.tasks.tasks_dir}', and rerun:",
            file=sys.stderr,
        )
        print(no_image_table(plan.no_image), file=sys.stderr)
    store = open_store(plan.run_dir)
    rc = 0
    settled = True  # no episode of this run is running any more
    if not plan.units:
        print("nothing to do: every unit is in the store (use --retry-errors to redo errors)", file=sys.stderr)
    else:
        out = _execute(plan, store, args.detach)
        if out.detached:
            print(f"follow it with: et-hpc status {plan.run_dir}")
            return 0
        if out.rc == 130 and out.result is not None:
            print(f"stopped: {out.result.ok + out.result.errors} episodes kept, rerun the same command to resume", file=sys.stderr)
        rc, settled = out.rc, out.settled
    if settled and not args.no_compact:
        _compact(store)
    info = unit_counts(plan, store)
    info["run_dir"] = str(plan.run_dir)
    if info["missing"] and rc == 0:
        rc = 1
        print(f"{info['missing']} units are still missing: rerun the same 'et-hpc run' command to do them", file=sys.stderr)
    if plan.no_image:
        info["no_image_tasks"] = dict(sorted(plan.no_image.items()))
    _print_summary(f"run {cfg.run_name()}", info, args.json)
    return rc


def plan_space(plan: Plan) -> None:
    """Refuse (exit 2, one line) a local run whose overlays and node-local images would not fit on
    scratch; a Slurm run's scratch is on its nodes, not checked here."""
    if not plan.units or plan.cfg.executor != "local":
        return
    from et_hpc.images import space
    from et_hpc.paths import scratch_dir

    imgs = [plan.images[t] for t in sorted({t for t, _ in plan.units}) if t in plan.images]
    pairs = [(Path(i.path), i.digest) for i in imgs if i.path is not None]
    conc = min(plan.cfg.node_concurrency(), len(plan.units))
    _rooms, refused = space.check(space.run_needs(scratch_dir(), pairs, plan.cfg.sandbox, conc))
    if refused:
        raise UserError(refused)


def no_image_table(reasons: dict[str, str], limit: int = 20) -> str:
    """Tasks without an image and why, as a table (the first ``limit``; then a count)."""
    rows = [[t, r] for t, r in sorted(reasons.items())[:limit]]
    out = format_table(["task (no image)", "reason"], rows)
    if len(reasons) > limit:
        out += f"\n... and {len(reasons) - limit} more (et-hpc status RUN --json lists them all)"
    return out


def _compact(store: RunStore) -> None:
    """Merge the run's small shards (once, from this process: never from many array tasks)."""
    try:
        res = store.compact()
    except UserError as e:  # another compaction of this run is going on: it does the same work
        print(f"et-hpc: warning: store not compacted: {e}", file=sys.stderr)
        return
    if res.inputs:
        print(f"store compacted: {res.inputs} shards merged into {res.outputs}, {res.shards_after} shards now", file=sys.stderr)


def _execute(plan: Plan, store: RunStore, detach: bool) -> Outcome:
    """Run the plan with its executor; the Slurm wait shows a progress bar of stored units."""
    ex = get_executor(plan.cfg.executor)
    if ex.name != "slurm" or detach:
        return ex.run(plan, store, detach=detach, notify=_warn)
    bars: list[Any] = []  # made at the first poll, after the submission line

    def progress(done: int, c: dict[str, int]) -> None:
        if not bars:
            bars.append(
                progress_bar(total=len(set(plan.units)), desc=f"slurm {plan.cfg.run_name()}", unit="ep", show=True, dynamic_ncols=True)
            )
        bar = bars[0]
        bar.set_postfix_str(f"tasks q{c['queued']} r{c['running']} done{c['done']} fail{c['failed']}", refresh=False)
        bar.update(done - bar.n)

    try:
        return ex.run(plan, store, notify=_warn, progress=progress)
    finally:
        for bar in bars:
            bar.close()


def _warn(line: str) -> None:
    print(line, file=sys.stderr)


def status_info(run_dir: Path) -> dict[str, Any]:
    from et_hpc.runner.slurm import latest_submissions, task_ids

    meta = read_run_json(run_dir)
    store = open_store(run_dir)
    done = store.units()
    cfg = meta.get("config", {})
    total = int(meta.get("plan", {}).get("units_total", 0))
    ok = sum(1 for s in done.values() if s == OK)
    no_img = sum(1 for s in done.values() if s == NO_IMAGE)
    err = len(done) - ok - no_img
    from et_hpc.runs.passk import line

    summ = store.summary()
    passed, n_ok, ev = int(summ.solved), int(summ.ok), summ.evaluation
    info: dict[str, Any] = {
        "run": meta.get("name"),
        "run_dir": str(run_dir),
        "executor": cfg.get("executor"),
        "units": total,
        "ok": ok,
        "error": err,
        "no_image": no_img,
        "missing": max(0, total - ok - err - no_img),
        "passed": passed,
        "pass_rate": round(passed / n_ok, 4) if n_ok else None,
        "pass@k": line(ev.overall) if ev is not None and ev.overall.n else "-",
        "evaluation": ev.model_dump() if ev is not None else None,
    }
    sb = meta.get("plan", {}).get("sandbox") or {}
    # host directories the run's sandboxes see (sandbox.binds; nothing else of the host is bound)
    info["binds"] = sb.get("binds", (cfg.get("sandbox") or {}).get("binds") or [])
    if "warm" in sb:
        info["sandbox"] = f"warm {sb['warm']}, local_copy {sb['local_copy']}"
    if no_img:
        info["no_image_tasks"] = no_image_reasons(store)
    from et_hpc.cli.rollouts import queue_status

    queue = queue_status(run_dir)
    if queue is not None:
        info["queue"] = queue
    subs = latest_submissions(run_dir)
    if subs:
        states = host_slurm.task_states(task_ids(subs))
        info["array_jobs"] = ",".join(s["array_id"] for s in subs)
        info["array_tasks"] = host_slurm.counts(states)
    return info


def no_image_reasons(store: RunStore) -> dict[str, str]:
    """``{task_id: reason}`` of the run's units whose current record is no_image."""
    t = store.read(columns=["task_id", "status", "error"])
    out: dict[str, str] = {}
    for tid, st, e in zip(*(t.column(c).to_pylist() for c in ("task_id", "status", "error"))):
        if st == NO_IMAGE:
            out[tid] = (e or "").removeprefix("no image: ")
    return dict(sorted(out.items()))


def _number(value: str | None, flag: str, kind: type = int) -> Any:
    """A positive int/float option (None when not given), or one line on bad input."""
    if value is None:
        return None
    try:
        v = kind(value)
    except ValueError:
        v = None
    if v is None or not 0 < v < float("inf"):  # NaN fails too
        raise UserError(f"{flag} {value!r}: give a positive {'whole number' if kind is int else 'number'}")
    return v


def cmd_status(args: argparse.Namespace) -> int:
    opts = {
        "cores": _number(args.cores, "--cores"),
        "nodes": _number(args.nodes, "--nodes"),
        "per_node": _number(args.per_node, "--per-node"),
        "gpu_hours": _number(args.gpu_hours, "--gpu-hours", float),
    }
    run_dir = find_run_dir(args.run, args.store)
    info = status_info(run_dir)
    cap = None
    if args.capacity:
        import os

        from et_hpc.runs.capacity import run_capacity

        cap = run_capacity(
            open_store(run_dir),
            cores=opts["cores"] or os.cpu_count() or 1,
            nodes=[opts["nodes"]] if opts["nodes"] else None,
            per_node=[opts["per_node"]] if opts["per_node"] else None,
            gpu_hours=opts["gpu_hours"],
        )
    if args.json:
        print(json.dumps({**info, "capacity": cap} if cap is not None else info, indent=2))
        return 0
    if info.get("no_image_tasks"):
        print(no_image_table(info["no_image_tasks"]))
    tasks = info.get("array_tasks")
    if tasks:
        info = dict(info)
        info["array_tasks (q/r/done/failed)"] = f"{tasks['queued']}/{tasks['running']}/{tasks['done']}/{tasks['failed']}"
    info = dict(info)
    info["binds"] = ", ".join(info.get("binds") or []) or "none"
    queue = info.pop("queue", None)
    if queue:  # a continuous run: its work queue
        info = dict(info)
        for k, v in queue.items():
            info[f"queue.{k}"] = "-" if v is None else v
    ev = info.pop("evaluation", None)
    _print_summary(f"run {info['run']}", info, False)
    if ev and ev.get("per_task"):
        from et_hpc.runs.passk import Evaluation, table

        print(format_table(*table(Evaluation.model_validate(ev))))
    print(f"see the episodes: et-hpc view {run_dir}")
    if cap is not None:
        from et_hpc.runs.capacity import format_capacity

        print()
        print(format_capacity(cap))
    return 0
