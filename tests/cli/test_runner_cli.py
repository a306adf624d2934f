"""``et-hpc run`` and ``et-hpc status`` as a user types them: real task folders, real Slurm."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers.units import ET_HPC, RUNNER, cli_env, et_hpc, task_folders

COMMON = [*RUNNER, "--samples", "2"]


def test_cli_local_run_resume_status(tmp_path: Path) -> None:
    src = task_folders(tmp_path, 3)
    env = cli_env(tmp_path)
    r = et_hpc(["run", str(src), "--run-name", "loc", "--concurrency", "3", "--json", *COMMON], env)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["units"] == 6 and info["ok"] == 6 and info["missing"] == 0 and info["pass_rate"] == 0.5
    r2 = et_hpc(["run", str(src), "--run-name", "loc", *COMMON], env)
    assert r2.returncode == 0 and "nothing to do" in r2.stderr
    assert len((tmp_path / "log" / "starts.log").read_text().splitlines()) == 6  # nothing ran again
    st = et_hpc(["status", "loc", "--json"], env)
    assert st.returncode == 0 and json.loads(st.stdout)["ok"] == 6
    table = et_hpc(["status", str(tmp_path / "store" / "loc")], env).stdout
    assert "pass_rate" in table and "50.0%" in table
    bad = et_hpc(["status", "nope"], env)
    assert bad.returncode == 2 and bad.stderr.startswith("et-hpc: error:") and len(bad.stderr.splitlines()) == 1


def test_cli_ctrl_c_keeps_finished_and_resumes(tmp_path: Path) -> None:
    src = task_folders(tmp_path, 4)
    env = cli_env(tmp_path, sleep_s=60)
    p = subprocess.Popen(
        ET_HPC + ["run", str(src), "--run-name", "int", "--concurrency", "2", *COMMON],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    log = tmp_path / "log" / "starts.log"
    for _ in range(600):
        if log.exists() and len(log.read_text().splitlines()) >= 2:
            break
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "resume" in err
    env["ET_RUNNER_TEST_SLEEP"] = "0"
    r = et_hpc(["run", str(src), "--run-name", "int", "--json", *COMMON], env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"] == 8


@pytest.mark.slurm
def test_cli_slurm_run_and_detach(tmp_path: Path) -> None:
    src = task_folders(tmp_path, 3)
    env = cli_env(tmp_path)
    sl = [
        "--executor",
        "slurm",
        "--set",
        "slurm.cpus_per_task=1",
        "--set",
        "slurm.time_min=10",
        "--set",
        "slurm.units_per_task=2",
        "--set",
        "slurm.poll_s=1",
    ]
    r = et_hpc(["run", str(src), "--run-name", "sl", "--json", *COMMON, *sl], env)
    assert r.returncode == 0, r.stderr
    assert "submitted array job" in r.stderr
    info = json.loads(r.stdout)
    assert info["ok"] == 6 and info["missing"] == 0

    d = et_hpc(["run", str(src), "--run-name", "det", "--detach", *COMMON, *sl], env, timeout=120)
    assert d.returncode == 0, d.stderr
    assert "et-hpc status" in d.stdout and "submitted array job" in d.stderr
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        st = json.loads(et_hpc(["status", "det", "--json"], env).stdout)
        if st["ok"] == 6 and st["array_tasks"]["done"] == 3:
            break
        time.sleep(1)
    assert st["ok"] == 6 and st["array_tasks"] == {"queued": 0, "running": 0, "done": 3, "failed": 0, "unknown": 0}
