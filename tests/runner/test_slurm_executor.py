"""The Slurm executor through the real Slurm: arrays, splitting, scancel, requeue, status."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

import helpers.units as U
from et_hpc.cli.run import status_info
from et_hpc.host import slurm as watch
from et_hpc.runner.config import RunConfig, SlurmConfig
from et_hpc.runner.plan import make_plan, open_store
from et_hpc.runner.slurm import load_jobs, submit, task_ids
from helpers import with_tests_on_path

pytestmark = pytest.mark.slurm


@pytest.fixture(autouse=True)
def _worker_env(monkeypatch):
    # array tasks inherit the environment: let them import helpers.units
    monkeypatch.setenv("PYTHONPATH", with_tests_on_path(os.environ)["PYTHONPATH"])


def _cfg(tmp_path: Path, **slurm) -> RunConfig:
    opts = dict(time_min=10, cpus_per_task=1, units_per_task=2, poll_s=1.0, setup=["export ET_HPC_TEST_SETUP=from-setup"])
    opts.update(slurm)
    return RunConfig(
        name="sl",
        store=tmp_path / "store",
        samples=1,
        concurrency=2,
        executor="slurm",
        unit_runner="helpers.units:work_runner",
        slurm=SlurmConfig(**opts),
    )


def _wait(ids: list[str], timeout_s: float = 240) -> dict[str, str]:
    states, ended = watch.wait_tasks(ids, poll_s=1.0, timeout_s=timeout_s)
    assert ended, f"array tasks did not end: {states}"
    return states


def _wait_for(cond, what: str, timeout_s: float = 180) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}")


def test_array_runs_and_results_come_back(tmp_path: Path) -> None:
    tasks = U.make_tasks(tmp_path, 6, sleep_s=0.5)
    plan = make_plan(_cfg(tmp_path), tasks=tasks, image_lookup=U.image_lookup)
    subs = submit(plan)
    assert len(subs) == 1 and subs[0]["tasks"] == 3 and subs[0]["units"] == 6
    states = _wait(task_ids(subs))
    assert set(states.values()) == {"COMPLETED"}, states
    store = open_store(plan.run_dir)
    counts = U.record_counts(store)
    assert len(counts) == 6 and set(counts.values()) == {1}
    recs = store.records()
    assert {r.versions["setup"] for r in recs} == {"from-setup"}  # slurm.setup lines ran
    assert {r.slurm_array_task_id for r in recs} == {0, 1, 2}
    info = status_info(plan.run_dir)
    assert info["ok"] == 6 and info["missing"] == 0 and info["array_tasks"]["done"] == 3
    assert make_plan(plan.cfg, tasks=tasks, image_lookup=U.image_lookup).units == []


def test_split_beyond_max_array_size(tmp_path: Path) -> None:
    tasks = U.make_tasks(tmp_path, 5)
    plan = make_plan(_cfg(tmp_path, units_per_task=1, max_array_size=2), tasks=tasks, image_lookup=U.image_lookup)
    subs = submit(plan)
    assert [s["tasks"] for s in subs] == [2, 2, 1] and len({s["array_id"] for s in subs}) == 3
    assert len(load_jobs(plan.run_dir)["submissions"]) == 3
    states = _wait(task_ids(subs))
    assert len(states) == 5 and set(states.values()) == {"COMPLETED"}
    counts = U.record_counts(open_store(plan.run_dir))
    assert len(counts) == 5 and set(counts.values()) == {1}


def test_scancel_is_seen_as_ended_and_rerun_completes_once(tmp_path: Path) -> None:
    quick = U.make_tasks(tmp_path / "q", 2, sleep_s=0)
    slow = U.make_tasks(tmp_path / "s", 2, sleep_s=600)
    for t in slow:
        t.id = "slow-" + t.id
    cfg = _cfg(tmp_path)
    plan = make_plan(cfg, tasks=quick + slow, image_lookup=U.image_lookup)
    subs = submit(plan)
    ids = task_ids(subs)
    assert len(ids) == 2
    _wait_for(lambda: len(U.starts(tmp_path / "s")) == 2, "slow units to start")
    subprocess.run(["scancel", ids[1]], check=True, timeout=30)
    states = _wait(ids, timeout_s=120)  # never hangs on the killed task
    assert states[ids[0]] == "COMPLETED" and watch.category(states[ids[1]]) == "failed", states
    store = open_store(plan.run_dir)
    assert set(U.record_counts(store)) == {(t.id, 0) for t in quick}
    info = status_info(plan.run_dir)
    assert info["missing"] == 2 and info["array_tasks"]["failed"] == 1

    (tmp_path / "s" / "log" / "fast").touch()
    plan2 = make_plan(cfg, tasks=quick + slow, image_lookup=U.image_lookup)
    assert sorted(plan2.units) == sorted((t.id, 0) for t in slow)
    subs2 = submit(plan2)
    _wait(task_ids(subs2))
    counts = U.record_counts(store)
    assert len(counts) == 4 and set(counts.values()) == {1}
    assert status_info(plan.run_dir)["array_tasks"] == {"queued": 0, "running": 0, "done": 1, "failed": 0, "unknown": 0}


def test_checkpoint_requeue_does_not_redo_finished_units(tmp_path: Path) -> None:
    tasks = U.make_tasks(tmp_path, 4, sleep_s=3)
    cfg = _cfg(tmp_path, units_per_task=4)
    cfg.concurrency = 1
    plan = make_plan(cfg, tasks=tasks, image_lookup=U.image_lookup)
    store = open_store(plan.run_dir)
    subs = submit(plan)
    (jid,) = task_ids(subs)
    _wait_for(lambda: len(store.units()) >= 2, "two units to finish")
    # what Slurm sends before preemption/timeout: submitit checkpoints and requeues the chunk
    subprocess.run(["scancel", "--signal=USR2", jid], check=True, timeout=30)
    states = _wait([jid], timeout_s=400)
    assert states[jid] == "COMPLETED", states
    counts = U.record_counts(store)
    assert len(counts) == 4 and set(counts.values()) == {1}, counts
    recs = store.records()
    assert max(int(r.versions["restart"]) for r in recs) >= 1  # some units ran after the requeue
    started = [(s[0], s[1]) for s in U.starts(tmp_path)]
    finished_first = [r.task_id for r in recs if r.versions["restart"] == "0"]
    assert finished_first and all(started.count((tid, "0")) == 1 for tid in finished_first)
