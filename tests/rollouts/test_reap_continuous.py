"""No sandbox outlives its worker: a continuous run's Slurm worker SIGKILLed in the middle of an
episode leaves an instance and an overlay behind (nothing of the worker is left to stop them);
the controller's and the other worker's reaper threads remove both within one lease period, and
the unit the killed worker held is done again exactly once."""

from __future__ import annotations

import getpass
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from et_hpc.host import apptainer
from et_hpc.rollouts.queue import WorkQueue
from et_hpc.runner.slurm import load_jobs
from helpers import REPO, until
from helpers.slurm import array_workers

ET_HPC = [sys.executable, "-m", "et_hpc.cli"]
DEMO = REPO / "defs" / "demo"
LEASE_S = 12


@pytest.mark.slurm
@pytest.mark.apptainer
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkilled_worker_leaves_no_sandbox(base_sif: Path, tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    env = dict(os.environ, ET_HPC_STORE=str(tmp_path / "store"), ET_HPC_SCRATCH=str(scratch))
    b = subprocess.run(ET_HPC + ["build", str(DEMO)], env=env, capture_output=True, text=True, timeout=600)
    assert b.returncode == 0, b.stderr[-2000:]
    run = "reap-kill"
    run_dir = tmp_path / "store" / run
    q = WorkQueue(run_dir)
    args = [
        "run",
        str(DEMO),
        "--policy",
        "oracle",
        "--samples",
        "2",
        "--run-name",
        run,
        "--continuous",
        "--executor",
        "slurm",
        "--workers",
        "2",
        "--concurrency",
        "1",
        "--json",
        "--set",
        "sandbox.warm=0",
        "--set",
        "slurm.cpus_per_task=1",
        "--set",
        "slurm.time_min=10",
        "--set",
        f"continuous.lease_s={LEASE_S}",
        "--set",
        "continuous.heartbeat_s=1",
        "--set",
        "continuous.poll_s=1",
        "--set",
        "continuous.stop_grace_s=60",
    ]
    ctl_err = open(tmp_path / "ctl.err", "w+")
    ctl = subprocess.Popen(ET_HPC + args, env=env, stdout=subprocess.DEVNULL, stderr=ctl_err)
    live = scratch / f"et-hpc-{getpass.getuser()}" / "live"
    try:
        subs = until("the worker array", lambda: load_jobs(run_dir)["submissions"], 120)
        array_id = subs[0]["array_id"]

        def victim():  # a worker whose sandbox is running, and the sandbox's registry record
            workers = array_workers(array_id)
            for reg in live.glob("*.json") if live.is_dir() else ():
                try:
                    rec = json.loads(reg.read_text())
                except (OSError, ValueError):
                    continue
                if rec["pid"] in workers.values() and rec["name"] in {i.name for i in apptainer.instance_list()}:
                    held = [n.split("~")[0] for n in os.listdir(q.leased) if f"-{rec['pid']}-" in n]
                    if held:
                        return rec, held
            return None

        rec, held = until("a worker in the middle of an episode", victim, 240, every_s=0.1)
        os.kill(rec["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        overlay = Path(rec["overlay"])
        # positive control: the killed worker stopped nothing; its instance and overlay are still there
        assert overlay.exists() and rec["name"] in {i.name for i in apptainer.instance_list()}

        def gone():
            return not overlay.exists() and rec["name"] not in {i.name for i in apptainer.instance_list()}

        until("the dead worker's sandbox to be reaped", gone, LEASE_S, every_s=0.5)
        reaped_s = time.monotonic() - killed_at
        assert not (live / f"{rec['name']}.json").exists()
        until(
            "the killed worker's unit to be done again",
            lambda: all(any(n.startswith(f"{u}~") for n in os.listdir(q.done)) for u in held),
            240,
        )
        subprocess.run(ET_HPC + ["rollouts", "stop", run], env=env, check=True, timeout=60)
        rc = ctl.wait(timeout=180)
    finally:
        if ctl.poll() is None:
            ctl.kill()
            ctl.wait(30)
        jobs = load_jobs(run_dir)["submissions"] if (run_dir / "jobs.json").exists() else []
        ids = [j for s in jobs for j in s["job_ids"]]
        if ids:
            subprocess.run(["scancel", *ids], timeout=30)
    ctl_err.seek(0)
    assert rc == 0, ctl_err.read()[-3000:]
    done = Counter(n.split("~")[0] for n in os.listdir(q.done) if n.endswith(".json"))
    assert done and set(done.values()) == {1}, done  # no unit committed twice
    for u in held:
        assert done[u] == 1
        attempts = [n for n in os.listdir(q.done) if n.startswith(f"{u}~")]
        assert f"-{rec['pid']}-" not in attempts[0]  # done by another attempt than the killed one
    assert not [i.name for i in apptainer.instance_list() if i.name.startswith(f"et-{run}")]
    print(
        f"\nSIGKILLed worker {rec['pid']}: its sandbox {rec['name']} reaped {reaped_s:.1f} s later "
        f"(lease {LEASE_S} s); unit(s) {held} done again once"
    )
