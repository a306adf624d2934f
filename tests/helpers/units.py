"""Unit runners and task builders for the runner tests.

Runs name ``unit_runner=helpers.units:work_runner``; Slurm array tasks import this module by name
(the tests put ``tests/`` on their PYTHONPATH), so the unit runners below run unchanged in the
worker processes. They run a real subprocess per episode, honour the shared *stop* event, and return
simple records.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

from et_hpc.runner.config import RunConfig
from et_hpc.runner.plan import store_records
from et_hpc.tasks.model import Recipe, Task
from helpers import with_tests_on_path

ET_HPC = [sys.executable, "-m", "et_hpc.cli"]
RUNNER = ["--set", "unit_runner=helpers.units:work_runner"]
_lock = threading.Lock()
INFLIGHT = {"now": 0, "max": 0}


def work_runner(task: Task, sample: int, cfg: RunConfig, image, stop: threading.Event) -> dict:
    """Sleep ``metadata.sleep_s`` in a child process (0 once ``<log_dir>/fast`` exists).

    Tasks loaded from folders have no such metadata: then ``$ET_RUNNER_TEST_LOG`` and
    ``$ET_RUNNER_TEST_SLEEP`` give the log folder and the sleep.
    """
    meta = task.metadata
    log_dir = Path(meta.get("log_dir") or os.environ["ET_RUNNER_TEST_LOG"])
    job = os.environ.get("SLURM_ARRAY_JOB_ID", "") + "_" + os.environ.get("SLURM_ARRAY_TASK_ID", "")
    with open(log_dir / "starts.log", "a") as f:
        f.write(f"{task.id} {sample} {os.getpid()} {job}\n")
    with _lock:
        INFLIGHT["now"] += 1
        INFLIGHT["max"] = max(INFLIGHT["max"], INFLIGHT["now"])
    try:
        sleep_s = 0 if (log_dir / "fast").exists() else float(meta.get("sleep_s", os.environ.get("ET_RUNNER_TEST_SLEEP", 0)))
        proc = subprocess.Popen(["sleep", str(sleep_s)])
        while proc.poll() is None:
            if stop.wait(0.05):
                proc.kill()
                proc.wait()
                return make_record(cfg, task, sample, "infra_error", error="interrupted")
        if proc.returncode != 0:  # killed from outside (a scancel signals the whole job) before stop was set
            return make_record(cfg, task, sample, "infra_error", error=f"the work was killed ({proc.returncode})")
        if sample in meta.get("error_samples", []):
            return make_record(cfg, task, sample, "infra_error", error="stand-in failure")
        once = log_dir / f"failed-once-{task.id}-{sample}"
        if sample in meta.get("flaky_samples", []) and not once.exists():  # fails its first attempt only
            once.touch()
            return make_record(cfg, task, sample, "infra_error", error="stand-in passing failure")
        return make_record(cfg, task, sample, "ok", reward=1.0 if sample % 2 == 0 else 0.0, image_path=str(getattr(image, "path", "")))
    finally:
        with _lock:
            INFLIGHT["now"] -= 1


def make_record(cfg: RunConfig, task: Task, sample: int, status: str, **kw):
    """A real EpisodeRecord (a dict when the record module is absent)."""
    extra = {"setup": os.environ.get("ET_HPC_TEST_SETUP") or "", "restart": os.environ.get("SLURM_RESTART_COUNT") or "0"}
    fields = dict(
        run_name=cfg.run_name(),
        task_id=task.id,
        sample=sample,
        status=status,
        slurm_job_id=os.environ.get("SLURM_ARRAY_JOB_ID"),
        versions=extra,
        **kw,
    )
    task_no = os.environ.get("SLURM_ARRAY_TASK_ID")
    if task_no:
        fields["slurm_array_task_id"] = int(task_no)
    try:
        from et_hpc.record import EpisodeRecord
    except ImportError:
        return fields
    return EpisodeRecord(**fields)


def make_tasks(root: Path, n: int, **meta) -> list[Task]:
    """``n`` tasks whose episodes run ``work_runner`` with ``meta``; logs go to ``root/log``."""
    (root / "log").mkdir(parents=True, exist_ok=True)
    sif = root / "img.sif"
    sif.write_text("stand-in image file")
    out = []
    for i in range(n):
        d = root / "tasks" / f"t{i:03d}"
        d.mkdir(parents=True, exist_ok=True)
        m = {"log_dir": str(root / "log"), **meta}
        out.append(Task(id=f"t{i:03d}", prompt="do it", recipe=Recipe(kind="sif", path=sif, context_dir=d), source=d, metadata=m))
    return out


def image_lookup(task: Task) -> SimpleNamespace:
    return SimpleNamespace(status="ok", path=task.recipe.path, digest="d0", reason=None)


def record_counts(store) -> Counter:
    """How many records each unit has (duplicates included)."""
    if hasattr(store, "read"):
        rows = store.read(columns=["task_id", "sample"], dedupe=False).to_pylist()
    else:
        rows = store_records(store)
    return Counter((r["task_id"], int(r["sample"])) for r in rows)


def starts(root: Path) -> list[list[str]]:
    p = root / "log" / "starts.log"
    return [line.split() for line in p.read_text().splitlines()] if p.exists() else []


def task_folders(root: Path, n: int) -> Path:
    """Native task folders with a prebuilt container.sif (a stand-in file: the unit runner never opens it)."""
    for i in range(n):
        d = root / "tasks" / f"task_{i:03d}"
        d.mkdir(parents=True)
        (d / "task.json").write_text(json.dumps({"description": f"task {i}", "truth": "t"}))
        (d / "container.sif").write_text("stand-in")
    (root / "log").mkdir()
    return root / "tasks"


def cli_env(root: Path, sleep_s: float = 0.2, **extra: str) -> dict[str, str]:
    """The environment for ``et-hpc`` runs of ``work_runner`` on folders under ``root``."""
    return dict(
        with_tests_on_path(os.environ),
        ET_RUNNER_TEST_LOG=str(root / "log"),
        ET_RUNNER_TEST_SLEEP=str(sleep_s),
        ET_HPC_STORE=str(root / "store"),
        **extra,
    )


def et_hpc(args: list[str], env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(ET_HPC + args, env=env, capture_output=True, text=True, timeout=timeout)
