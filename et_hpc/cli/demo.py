"""``et-hpc demo``: the whole pipeline on the bundled demo tasks, end to end, on this machine.

Checks the machine, builds the base image and the demo tasks' images (cached after the first time),
runs oracle and null episodes through the local executor and, when Slurm answers, through Slurm
array jobs, writes everything into a parquet store, and prints a summary table. Each demo run gets
a fresh run name, so the episodes really run every time.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import time
from pathlib import Path

from et_hpc import paths
from et_hpc.cli import app as et_cli
from et_hpc.errors import UserError
from et_hpc.util import format_table

DEMO_TASKS = paths.repo_root() / "defs" / "demo"
MODEL_TASKS = ("demo_hello_file", "demo_csv_sum")  # the real-model part's text-mode and Slurm runs (2 cores)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run the whole pipeline on the bundled demo tasks",
        description="Build the base image and the demo task images, run oracle and null episodes locally "
        "and through Slurm (when available) into a parquet store, and print a summary. "
        "Oracle episodes should all pass and null episodes should all fail.",
        epilog="example: et-hpc demo --store ~/et-hpc-demo --samples 3",
    )
    p.add_argument(
        "--store", type=Path, default=Path.home() / "et-hpc-demo", help="where the demo runs are stored (default: ~/et-hpc-demo)"
    )
    p.add_argument("--samples", type=int, default=2, help="episodes per task and policy (default 2)")
    p.add_argument("--no-slurm", action="store_true", help="skip the Slurm part even when Slurm is up")
    p.add_argument("--no-model", action="store_true", help="skip the real-model episodes (the embedded CPU model)")
    p.add_argument("--model-turns", type=int, default=4, help="turns per real-model episode (default 4)")
    p.add_argument(
        "--model",
        default=None,
        help="the real-model part's model (a name or a GGUF; default: qwen2.5-coder-1.5b, the tier that solves "
        "tasks, when installed, else the embedded smollm2-135m)",
    )
    p.add_argument(
        "--base-source",
        choices=["auto", "docker", "debian"],
        default="auto",
        help="how to make the base image if it is not cached (default auto)",
    )
    p.set_defaults(func=cmd_demo)


def _step(msg: str) -> None:
    print(f"\n==> {msg}", flush=True)


def _slurm_up() -> bool:
    if not shutil.which("sinfo"):
        return False
    r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    return r.returncode == 0 and bool(r.stdout.strip())


def cmd_demo(args) -> int:
    from et_hpc.runs.store import RunStore

    if not DEMO_TASKS.is_dir():
        raise UserError(f"demo tasks not found at {DEMO_TASKS}: run et-hpc from its source checkout")
    t_all = time.monotonic()
    _step("checking the machine (et-hpc doctor)")
    rc = et_cli.main(["doctor"])
    if rc != 0:
        raise UserError("the machine is not ready (see the FAIL lines above and their fixes)")
    _step("base image (et-hpc base build)")
    et_cli.main(["base", "build", "--source", args.base_source])
    _step(f"demo task images (et-hpc build {DEMO_TASKS})")
    if et_cli.main(["build", str(DEMO_TASKS)]) != 0:
        raise UserError("building the demo images failed (see the table above)")

    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs = [("local", "oracle"), ("local", "null")]
    if not args.no_slurm and _slurm_up():
        runs.append(("slurm", "oracle"))
    else:
        print("\n(Slurm is not available here: skipping the Slurm part of the demo)")
    rows = []
    failed = False
    for executor, policy in runs:
        name = f"demo-{policy}-{executor}-{stamp}"
        _step(f"{policy} episodes through the {executor} executor (et-hpc run ... --run-name {name})")
        t0 = time.monotonic()
        argv = [
            "run",
            str(DEMO_TASKS),
            "--policy",
            policy,
            "--samples",
            str(args.samples),
            "--executor",
            executor,
            "--store",
            str(args.store),
            "--run-name",
            name,
        ]
        if executor == "slurm":
            argv += ["--set", "slurm.units_per_task=2", "--set", "slurm.time_min=20"]
        rc = et_cli.main(argv)
        s = RunStore(args.store / name).summary()
        expect = 1.0 if policy == "oracle" else 0.0
        errors = s.units - s.ok
        good = rc == 0 and errors == 0 and s.ok > 0 and abs((s.solved / s.ok) - expect) < 1e-9
        failed |= not good
        rows.append(
            [
                name,
                executor,
                policy,
                s.units,
                s.ok,
                errors,
                f"{100 * s.solved / s.ok:.0f}%" if s.ok else "-",
                f"{time.monotonic() - t0:.0f}s",
                "as expected" if good else "UNEXPECTED",
            ]
        )
    model_rows: list[list[object]] = []
    if not args.no_model:
        failed |= _model_runs(args, stamp, slurm=not args.no_slurm and _slurm_up(), rows=model_rows)
    _step("summary")
    print(format_table(["run", "executor", "policy", "episodes", "ok", "errors", "pass rate", "time", "check"], rows))
    if model_rows:
        print()
        print(
            format_table(
                [
                    "real-model run",
                    "model",
                    "mode",
                    "executor",
                    "episodes",
                    "ok",
                    "errors",
                    "pass rate",
                    "tokens/s",
                    "model s/ep",
                    "infra s/ep",
                    "check",
                ],
                model_rows,
            )
        )
    print(f"\nstore: {args.store}  (read it with: et-hpc store summary {args.store}/<run>)")
    from et_hpc.runs.view import build_site

    shown = [args.store / str(r[0]) for r in [*rows, *model_rows]]  # the real-model runs: the model's commands and outputs
    site = build_site(shown, args.store / "_view" / f"demo-{stamp}")
    print(f"viewer: {site.index}  (open it in a browser, or: et-hpc view {' '.join(str(p) for p in shown)} --serve)")
    print(f"demo finished in {time.monotonic() - t_all:.0f}s")
    return 1 if failed else 0


def _model_runs(args, stamp: str, *, slurm: bool, rows: list[list[object]]) -> bool:
    """Real-model episodes on a CPU model (default: the solving tier, qwen2.5-coder-1.5b), token-in with
    the protocol's grammar: tools mode on every demo task, text mode and Slurm on two of them.

    The pass rate is whatever the model makes of it. What must hold is that every episode ends
    ``ok`` (the model's mistakes are its own; no policy_error). Returns failed.
    """
    import tempfile

    from et_hpc.model.catalog import SOLVING, prepare
    from et_hpc.model.server import ServerConfig, server_command, serving
    from et_hpc.runs.store import RunStore

    try:
        model, digest = prepare(args.model or SOLVING)
    except UserError as e:
        if args.model:
            raise
        print(f"\n(the solving tier is not installed: {e}; using the embedded model, which does not act)")
        try:
            model, digest = prepare(None)
        except UserError:
            model = None
    if server_command() is None or model is None:
        print("\n(the model extra is not installed: skipping the real-model part; see README, 'A real model on CPU')")
        return False
    _step(f"real-model episodes: starting the CPU model server on {model.alias} (et-hpc model serve)")
    failed = False
    with tempfile.TemporaryDirectory(prefix="et-demo-model-") as d:
        ep = Path(d) / "endpoint.json"
        cfg = ServerConfig(model=model.path, digest=digest, alias=model.alias, endpoint_file=ep, log_file=Path(d) / "server.log")
        with serving(cfg) as srv:
            print(f"serving {srv.alias} at {srv.base_url} (model_version {srv.version})")
            runs = [("local", "tools"), ("local", "text")] + ([("slurm", "tools")] if slurm else [])
            for executor, mode in runs:
                ids = ",".join(MODEL_TASKS) if (executor, mode) != ("local", "tools") else "*"
                name = f"demo-model-{mode}-{executor}-{stamp}"
                _step(f"real-model episodes ({mode} mode) through the {executor} executor (--run-name {name})")
                t0 = time.monotonic()
                argv = [
                    "run",
                    str(DEMO_TASKS),
                    "--policy",
                    "openai",
                    "--samples",
                    "1",
                    "--executor",
                    executor,
                    *(["--set", f"tasks.ids=[{ids}]"] if ids != "*" else []),
                    "--concurrency",
                    "2",
                    "--store",
                    str(args.store),
                    "--run-name",
                    name,
                    "--set",
                    f"policy.endpoint_file={ep}",
                    "--set",
                    f"policy.mode={mode}",
                    "--set",
                    "policy.token_in=true",
                    "--set",
                    "policy.temperature=0.7",
                    "--set",
                    "policy.max_retries=2",
                    "--set",
                    f"budgets.max_turns={args.model_turns}",
                    "--set",
                    "budgets.max_tokens_per_turn=128",
                    "--set",
                    "budgets.context_tokens=3500",
                    "--set",
                    "budgets.wall_time_s=900",
                ]
                if executor == "slurm":
                    argv += ["--set", "slurm.units_per_task=4", "--set", "slurm.time_min=20"]
                rc = et_cli.main(argv)
                store = RunStore(args.store / name)
                s = store.summary()
                recs = store.records()
                tokens = sum(r.completion_tokens or 0 for r in recs)
                model_s = sum(((r.timings.model_s or 0.0) for r in recs if r.timings), 0.0)
                total_s = sum(((r.timings.total_s or 0.0) for r in recs if r.timings), 0.0)
                n = max(len(recs), 1)
                errors = s.units - s.ok
                good = rc in (0, 1) and errors == 0 and s.ok > 0
                failed |= not good
                rows.append(
                    [
                        name,
                        srv.alias,
                        mode,
                        executor,
                        s.units,
                        s.ok,
                        errors,
                        f"{100 * s.solved / s.ok:.0f}%" if s.ok else "-",
                        f"{tokens / model_s:.0f}" if model_s > 0 else "-",
                        f"{model_s / n:.1f}",
                        f"{(total_s - model_s) / n:.1f}",
                        f"ok ({time.monotonic() - t0:.0f}s)" if good else "UNEXPECTED",
                    ]
                )
    return failed
