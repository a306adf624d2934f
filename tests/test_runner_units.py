"""Unit runners and task builders for the runner tests, plus tests of the run config.

Slurm array tasks import this module by name (the tests put ``tests/`` on PYTHONPATH), so the
unit runners below run unchanged in the worker processes. They run a real subprocess per
episode, honour the shared *stop* event, and return simple records.
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from et_hpc.errors import UserError
from et_hpc.runner.config import RunConfig, load_config, parse_set
from et_hpc.runner.plan import store_records
from et_hpc.tasks.model import Recipe, Task

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
        if sample in meta.get("error_samples", []):
            return make_record(cfg, task, sample, "infra_error", error="stand-in failure")
        once = log_dir / f"failed-once-{task.id}-{sample}"
        if sample in meta.get("flaky_samples", []) and not once.exists():  # fails its first attempt only
            once.touch()
            return make_record(cfg, task, sample, "infra_error", error="stand-in passing failure")
        return make_record(cfg, task, sample, "ok", reward=1.0 if sample % 2 == 0 else 0.0,
                           image_path=str(getattr(image, "path", "")))
    finally:
        with _lock:
            INFLIGHT["now"] -= 1


def make_record(cfg: RunConfig, task: Task, sample: int, status: str, **kw):
    """A real EpisodeRecord (a dict when the record module is absent)."""
    extra = {"setup": os.environ.get("ET_HPC_TEST_SETUP") or "",
             "restart": os.environ.get("SLURM_RESTART_COUNT") or "0"}
    fields = dict(run_name=cfg.run_name(), task_id=task.id, sample=sample, status=status,
                  slurm_job_id=os.environ.get("SLURM_ARRAY_JOB_ID"), versions=extra, **kw)
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
        out.append(Task(id=f"t{i:03d}", prompt="do it", recipe=Recipe(kind="sif", path=sif, context_dir=d),
                        source=d, metadata=m))
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


# ------------------------------------------------------------------ run config
def test_config_yaml_and_overrides(tmp_path: Path) -> None:
    y = tmp_path / "run.yaml"
    y.write_text("name: smoke\nsamples: 3\nslurm:\n  partition: cpu\n  setup: [module load apptainer]\n")
    cfg = load_config(y, parse_set(["slurm.units_per_task=4", "executor=slurm", "policy.kind=null"]))
    assert cfg.samples == 3 and cfg.executor == "slurm"
    assert cfg.slurm.partition == "cpu" and cfg.slurm.units_per_task == 4
    assert cfg.slurm.setup == ["module load apptainer"]
    kind = cfg.policy["kind"] if isinstance(cfg.policy, dict) else cfg.policy.kind
    assert kind == "null"
    assert cfg.run_dir().name == "smoke"
    assert cfg.node_concurrency(cores=2, mem_gb=24) == 4
    assert cfg.node_concurrency(cores=16, mem_gb=8) == 4


def test_config_errors_are_one_line(tmp_path: Path) -> None:
    y = tmp_path / "run.yaml"
    y.write_text("samples: 2\nslurm:\n  partiton: cpu\n")
    with pytest.raises(UserError) as e:
        load_config(y)
    assert str(y) in str(e.value) and "slurm.partiton" in str(e.value) and "\n" not in str(e.value)
    y.write_text("samples: [1\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_config(y)
    with pytest.raises(UserError, match="KEY=VALUE"):
        parse_set(["samples"])
    with pytest.raises(UserError, match="samples"):
        load_config(None, parse_set(["samples=0"]))


def test_cli_bad_config_exits_2(tmp_path: Path, capsys) -> None:
    from et_hpc.cli import main

    y = tmp_path / "run.yaml"
    y.write_text("executor: cloud\n")
    assert main(["run", "--config", str(y)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("et-hpc: error:") and "executor" in err[0]
