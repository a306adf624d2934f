"""200 real oracle episodes through Slurm while array tasks are cancelled and a worker is killed.

The first ``et-hpc run`` must return once every array task has ended (cancelled and killed ones
included); the same command run again must leave exactly one ok episode per unit in the store,
in readable shards, with nothing half-written where a reader could see it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from et_hpc.host import slurm as watch
from et_hpc.runner.slurm import load_jobs, task_ids
from et_hpc.runs.store import RunStore
from helpers import REPO, until
from helpers.slurm import array_workers

ET_HPC = [sys.executable, "-m", "et_hpc.cli"]
DEMO = REPO / "defs" / "demo"
TASKS, SAMPLES = 4, 50
UNITS = TASKS * SAMPLES
RUN = "fault"
# 20 array tasks of 10 units, 4 running at once (the partition oversubscribes cores), 2 episodes
# at once in each: 8 episodes in flight on 2 cores.
ARGS = [
    "run",
    str(DEMO),
    "--policy",
    "oracle",
    "--samples",
    str(SAMPLES),
    "--run-name",
    RUN,
    "--executor",
    "slurm",
    "--concurrency",
    "2",
    "--json",
    "--set",
    "slurm.units_per_task=10",
    "--set",
    "slurm.array_parallelism=4",
    "--set",
    "slurm.cpus_per_task=1",
    "--set",
    "slurm.time_min=15",
    "--set",
    "slurm.poll_s=1",
    "--set",
    "slurm.wait_timeout_min=8",
]


def _running(tids: list[str]) -> list[str]:
    states = watch.task_states(tids)
    return [t for t in tids if states.get(t) == "RUNNING"]


def _has_children(pid: int) -> bool:
    r = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, timeout=30)
    return bool(r.stdout.strip())


@pytest.mark.slurm
@pytest.mark.apptainer
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_200_episodes_survive_scancel_and_sigkill(base_sif: Path, tmp_path: Path) -> None:
    env = dict(os.environ, ET_HPC_STORE=str(tmp_path / "store"))
    b = subprocess.run(ET_HPC + ["build", str(DEMO)], env=env, capture_output=True, text=True, timeout=600)
    assert b.returncode == 0, b.stderr[-2000:]
    run_dir = tmp_path / "store" / RUN
    store = RunStore(run_dir)

    out1, err1 = open(tmp_path / "run1.out", "w+"), open(tmp_path / "run1.err", "w+")
    t0 = time.monotonic()
    p1 = subprocess.Popen(ET_HPC + ARGS, env=env, stdout=out1, stderr=err1)
    try:
        subs = until("the arrays to be submitted", lambda: load_jobs(run_dir)["submissions"], 120)
        tids = task_ids(subs)
        assert len(tids) == UNITS // 10
        # mid-run: a few episodes are in the store and several array tasks run at once
        until("10 episodes in the store", lambda: len(store.units()) >= 10, 300)
        running = until("3 array tasks running at once", lambda: (r := _running(tids)) and len(r) >= 3 and r, 120)
        cancelled = running[:2]
        subprocess.run(["scancel", *cancelled], check=True, timeout=30)

        def victim() -> tuple[str, int] | None:
            live = set(_running(tids)) - set(cancelled)
            for tid, pid in array_workers().items():
                if tid in live and _has_children(pid):  # an episode is running in it
                    return tid, pid
            return None

        killed, pid = until("a running worker to kill", victim, 120, every_s=0.2)
        os.kill(pid, signal.SIGKILL)

        rc1 = p1.wait(timeout=480)  # returns once every array task ended: it does not hang on them
    finally:
        if p1.poll() is None:
            p1.kill()
            p1.wait(timeout=30)
    first_s = time.monotonic() - t0
    err1.seek(0)
    stderr1 = err1.read()
    assert rc1 == 1, stderr1[-3000:]  # units left undone by the cancelled and the killed task
    assert "array task(s) ended without completing" in stderr1 and "stopped watching" not in stderr1
    states = watch.task_states(tids)
    assert all(watch.ended(s) for s in states.values()), states
    assert all(watch.category(states[t]) == "failed" for t in cancelled), states
    assert watch.category(states[killed]) == "failed", states
    out1.seek(0)
    info1 = json.loads(out1.read())
    assert 0 < info1["missing"] < UNITS and info1["ok"] + info1["missing"] == UNITS, info1

    t1 = time.monotonic()
    r2 = subprocess.run(ET_HPC + ARGS, env=env, capture_output=True, text=True, timeout=480)
    second_s = time.monotonic() - t1
    assert r2.returncode == 0, r2.stderr[-3000:]
    info2 = json.loads(r2.stdout)
    assert info2["units"] == UNITS and info2["ok"] == UNITS and info2["missing"] == 0 and info2["error"] == 0
    assert f"{info1['missing']} to run" in r2.stderr  # only the missing units were submitted again
    assert "store compacted" in r2.stderr

    # every unit exactly once, every record ok, nothing partial visible
    rows = store.read(columns=["task_id", "sample", "status", "episode_id", "reward"], dedupe=False).to_pylist()
    assert len(rows) == UNITS
    per_unit = Counter((r["task_id"], r["sample"]) for r in rows)
    assert len(per_unit) == UNITS and set(per_unit.values()) == {1}
    assert len({r["episode_id"] for r in rows}) == UNITS
    assert {r["status"] for r in rows} == {"ok"}
    assert {r["reward"] for r in rows} == {1.0}  # the oracle solves every task: no 0 from a killed shell
    parts = sorted(run_dir.glob("part-*.parquet"))
    assert parts and sum(pq.read_table(p).num_rows for p in parts) == UNITS  # each one readable
    assert len(parts) < 5  # compacted at the end of the run
    tmp_left = sorted(p.name for p in run_dir.glob(".tmp-*"))
    assert not any(p.name.startswith(".") for p in store.shards())
    assert ds.dataset([str(p) for p in parts], format="parquet").count_rows() == UNITS
    print(
        f"\nfault run: first run {first_s:.0f} s (rc {rc1}, {info1['ok']} ok, {info1['missing']} missing; "
        f"cancelled {cancelled}, SIGKILLed worker of {killed}), rerun {second_s:.0f} s, "
        f"{len(parts)} shard(s), {len(tmp_left)} .tmp file(s) left by the killed writer: {tmp_left}"
    )


@pytest.mark.slurm
def test_rerun_while_arrays_live_is_refused(tmp_path: Path) -> None:
    """A second 'et-hpc run' while the first one's array tasks still run would do their units twice."""
    from helpers.units import RUNNER, cli_env, et_hpc, task_folders

    src = task_folders(tmp_path, 2)
    env = cli_env(tmp_path, sleep_s=30)
    sl = [
        "--executor",
        "slurm",
        "--set",
        "slurm.cpus_per_task=1",
        "--set",
        "slurm.time_min=5",
        "--set",
        "slurm.units_per_task=2",
        "--run-name",
        "live",
        *RUNNER,
        "--samples",
        "2",
    ]
    d = et_hpc(["run", str(src), "--detach", *sl], env, timeout=120)
    assert d.returncode == 0, d.stderr
    subs = load_jobs(tmp_path / "store" / "live")["submissions"]
    try:
        again = et_hpc(["run", str(src), *sl], env, timeout=120)
        assert again.returncode == 2, again.stderr
        assert again.stderr.startswith("et-hpc: error:") and len(again.stderr.strip().splitlines()) == 1
        assert "still queued or running" in again.stderr and subs[0]["array_id"] in again.stderr
    finally:
        subprocess.run(["scancel", *(s["array_id"] for s in subs)], timeout=30)
    states, ended = watch.wait_tasks(task_ids(subs), poll_s=1, timeout_s=120)
    assert ended, states
