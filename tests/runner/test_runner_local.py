"""The local executor with real threads, real subprocesses, a real store and real signals."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

import helpers.units as U
from et_hpc.errors import UserError
from et_hpc.runner.config import RunConfig
from et_hpc.runner.local import run_local
from et_hpc.runner.plan import make_plan, open_store, read_run_json


def _cfg(tmp_path: Path, **kw) -> RunConfig:
    base = dict(name="loc", store=tmp_path / "store", samples=2, concurrency=4, unit_runner="helpers.units:work_runner")
    base.update(kw)
    return RunConfig(**base)


def test_local_runs_all_units_then_resumes(tmp_path: Path) -> None:
    tasks = U.make_tasks(tmp_path, 6, sleep_s=0.3, error_samples=[1])
    tasks[0].metadata["error_samples"] = []
    cfg = _cfg(tmp_path)
    U.INFLIGHT["max"] = 0
    plan = make_plan(cfg, tasks=tasks, image_lookup=U.image_lookup)
    assert len(plan.units) == 12 and plan.total == 12
    res = run_local(plan, progress=False)
    store = open_store(plan.run_dir)
    counts = U.record_counts(store)
    assert len(counts) == 12 and set(counts.values()) == {1}
    assert res.ok == 7 and res.errors == 5 and res.passed == 6  # sample 0 passes, sample 1 fails
    assert 1 < U.INFLIGHT["max"] <= 4
    meta = read_run_json(plan.run_dir)
    assert meta["plan"]["to_run"] == 12 and meta["config"]["samples"] == 2

    again = make_plan(cfg, tasks=tasks, image_lookup=U.image_lookup)
    assert again.units == [] and again.done_ok == 7 and again.done_error == 5
    assert run_local(again, progress=False).started == 0
    retry = make_plan(_cfg(tmp_path, retry_errors=True), tasks=tasks, image_lookup=U.image_lookup)
    assert sorted(retry.units) == [(t.id, 1) for t in tasks[1:]]


def test_an_error_is_retried_at_once_and_only_the_last_attempt_stored(tmp_path: Path) -> None:
    tasks = U.make_tasks(tmp_path, 3, sleep_s=0, flaky_samples=[0], error_samples=[1])
    plan = make_plan(_cfg(tmp_path, retries=2), tasks=tasks, image_lookup=U.image_lookup)
    res = run_local(plan, progress=False)
    starts = Counter((f[0], int(f[1])) for f in U.starts(tmp_path))
    assert all(starts[(t.id, 0)] == 2 for t in tasks)  # failed once, then ok
    assert all(starts[(t.id, 1)] == 3 for t in tasks)  # fails every time: 1 + 2 retries
    assert res.ok == 3 and res.errors == 3
    rows = open_store(plan.run_dir).read(dedupe=False).to_pylist()
    assert len(rows) == 6  # one record per unit, not one per attempt
    by_unit = {(r["task_id"], r["sample"]): r for r in rows}
    for t in tasks:
        ok, bad = by_unit[(t.id, 0)], by_unit[(t.id, 1)]
        assert ok["status"] == "ok" and ok["events"] == ["retried after infra_error: stand-in passing failure"]
        assert bad["status"] == "infra_error" and bad["events"] == ["retried after infra_error: stand-in failure"] * 2

    none = U.make_tasks(tmp_path / "n", 1, sleep_s=0, flaky_samples=[0])
    res0 = run_local(make_plan(_cfg(tmp_path / "n", retries=0, samples=1), tasks=none, image_lookup=U.image_lookup), progress=False)
    assert res0.errors == 1 and res0.ok == 0  # retries=0: the first attempt stands


def test_sigterm_stops_cleanly_and_keeps_finished(tmp_path: Path) -> None:
    quick = U.make_tasks(tmp_path / "q", 2, sleep_s=0)
    slow = U.make_tasks(tmp_path / "s", 4, sleep_s=60)
    for t in slow:
        t.id = "slow-" + t.id
    cfg = _cfg(tmp_path, samples=1, concurrency=2)
    plan = make_plan(cfg, tasks=quick + slow, image_lookup=U.image_lookup)

    def kill_when_slow_started() -> None:
        for _ in range(600):
            if len(U.starts(tmp_path / "s")) >= 2:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.05)

    before = signal.getsignal(signal.SIGTERM)  # another test's sandbox may have installed its own
    threading.Thread(target=kill_when_slow_started, daemon=True).start()
    res = run_local(plan, progress=False)
    assert res.interrupted and res.ok == 2 and res.dropped == 2 and res.not_started == 2
    store = open_store(plan.run_dir)
    assert set(U.record_counts(store)) == {(t.id, 0) for t in quick}
    assert signal.getsignal(signal.SIGTERM) is before  # handler restored

    (tmp_path / "s" / "log" / "fast").touch()
    plan2 = make_plan(cfg, tasks=quick + slow, image_lookup=U.image_lookup)
    assert sorted(plan2.units) == sorted((t.id, 0) for t in slow)
    res2 = run_local(plan2, progress=False)
    assert res2.ok == 4 and not res2.interrupted
    counts = U.record_counts(store)
    assert len(counts) == 6 and set(counts.values()) == {1}


def test_missing_images_fail_fast(tmp_path: Path) -> None:
    tasks = U.make_tasks(tmp_path, 3)
    from types import SimpleNamespace

    def lookup(t):
        if t.id == "t001":
            return SimpleNamespace(status="missing", path=None, digest=None, reason="not built")
        return U.image_lookup(t)

    cfg = _cfg(tmp_path, tasks={"tasks_dir": str(tmp_path / "tasks")})
    with pytest.raises(UserError) as e:
        make_plan(cfg, tasks=tasks, image_lookup=lookup)
    assert "t001" in str(e.value) and "et-hpc build" in str(e.value)
    assert not (cfg.run_dir() / "run.json").exists()
