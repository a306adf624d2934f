"""A rescore through Slurm resumes after a scancel: the array is cancelled once it has stored an
episode, the same command then finishes the rest, and every episode is rescored exactly once."""

from __future__ import annotations

import os
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from et_hpc.host import slurm as watch
from et_hpc.record import records_from_table
from et_hpc.runner.slurm import load_jobs, task_ids
from et_hpc.runs.store import RunStore
from helpers import REPO, until, with_tests_on_path
from helpers.inverted import inverted_dir
from helpers.units import ET_HPC, et_hpc

DEMO = REPO / "defs" / "demo"
SLURM = [
    "--executor",
    "slurm",
    "--concurrency",
    "1",
    "--set",
    "slurm.units_per_task=8",
    "--set",
    "slurm.cpus_per_task=1",
    "--set",
    "slurm.time_min=10",
    "--set",
    "slurm.poll_s=1",
    "--set",
    "slurm.wait_timeout_min=8",
]


@pytest.mark.slurm
@pytest.mark.apptainer
def test_rescore_on_slurm_resumes_after_scancel(base_sif: Path, tmp_path: Path) -> None:
    env = dict(with_tests_on_path(os.environ), ET_HPC_STORE=str(tmp_path / "store"))
    assert et_hpc(["build", str(DEMO)], env, timeout=900).returncode == 0
    r = et_hpc(
        [
            "run",
            str(DEMO),
            "--policy",
            "oracle",
            "--samples",
            "2",
            "--run-name",
            "src",
            "--concurrency",
            "2",
            "--set",
            "sandbox.keep_final_state=true",
        ],
        env,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    inv = inverted_dir(DEMO, tmp_path / "inverted")
    args = ["rescore", "src", "--tests", str(inv), "--run-name", "rs", *SLURM]
    run_dir = tmp_path / "store" / "rs"
    store = RunStore(run_dir)
    p = subprocess.Popen(ET_HPC + args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        subs = until("the array to be submitted", lambda: load_jobs(run_dir)["submissions"], 120)
        until("a rescored episode in the store", lambda: len(store.units()) >= 1, 300, every_s=0.2)
        ids = task_ids(subs)
        subprocess.run(["scancel", *{t.split("_")[0] for t in ids}], check=True, timeout=30)
        _, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    until("the array to end", lambda: all(watch.category(s) not in ("queued", "running") for s in watch.task_states(ids).values()), 120)
    first = len(store.units())
    assert 1 <= first < 8, f"the cancel came too late to test resuming ({first} of 8 done): {err[-500:]}"
    t0 = time.monotonic()
    r2 = et_hpc(["rescore", "src", "--tests", str(inv), "--run-name", "rs", "--json", *SLURM], env, timeout=600)
    assert r2.returncode == 0, (r2.stderr[-2000:], time.monotonic() - t0)
    recs = records_from_table(store.read(dedupe=False))
    ok = Counter((r.task_id, r.sample) for r in recs if r.status == "ok")
    assert len(ok) == 8 and set(ok.values()) == {1}, ok  # every episode rescored, exactly once
    assert all(r.reward == 0.0 for r in recs if r.status == "ok")
    assert len(load_jobs(run_dir)["submissions"]) == 2
