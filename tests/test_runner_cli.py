"""``et-hpc run`` and ``et-hpc status`` as a user types them: real task folders, real Slurm."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import need

TESTS = Path(__file__).resolve().parent
ET_HPC = [sys.executable, "-m", "et_hpc.cli"]


def _tasks(root: Path, n: int) -> Path:
    """Native task folders with a prebuilt container.sif (a stand-in file: the unit runner never opens it)."""
    for i in range(n):
        d = root / "tasks" / f"task_{i:03d}"
        d.mkdir(parents=True)
        (d / "task.json").write_text(json.dumps({"description": f"task {i}", "truth": "t"}))
        (d / "container.sif").write_text("stand-in")
    (root / "log").mkdir()
    return root / "tasks"


def _env(root: Path, sleep_s: float = 0.2) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
                ET_RUNNER_TEST_LOG=str(root / "log"), ET_RUNNER_TEST_SLEEP=str(sleep_s), ET_HPC_STORE=str(root / "store"))


def _run(args: list[str], env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(ET_HPC + args, env=env, capture_output=True, text=True, timeout=timeout)


COMMON = ["--set", "unit_runner=test_runner_units:work_runner", "--samples", "2"]


def test_cli_local_run_resume_status(tmp_path: Path) -> None:
    src = _tasks(tmp_path, 3)
    env = _env(tmp_path)
    r = _run(["run", str(src), "--run-name", "loc", "--concurrency", "3", "--json", *COMMON], env)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["units"] == 6 and info["ok"] == 6 and info["missing"] == 0 and info["pass_rate"] == 0.5
    r2 = _run(["run", str(src), "--run-name", "loc", *COMMON], env)
    assert r2.returncode == 0 and "nothing to do" in r2.stderr
    assert len((tmp_path / "log" / "starts.log").read_text().splitlines()) == 6  # nothing ran again
    st = _run(["status", "loc", "--json"], env)
    assert st.returncode == 0 and json.loads(st.stdout)["ok"] == 6
    table = _run(["status", str(tmp_path / "store" / "loc")], env).stdout
    assert "pass_rate" in table and "50.0%" in table
    bad = _run(["status", "nope"], env)
    assert bad.returncode == 2 and bad.stderr.startswith("et-hpc: error:") and len(bad.stderr.splitlines()) == 1


def test_cli_ctrl_c_keeps_finished_and_resumes(tmp_path: Path) -> None:
    src = _tasks(tmp_path, 4)
    env = _env(tmp_path, sleep_s=60)
    p = subprocess.Popen(ET_HPC + ["run", str(src), "--run-name", "int", "--concurrency", "2", *COMMON], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
    r = _run(["run", str(src), "--run-name", "int", "--json", *COMMON], env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"] == 8


@pytest.mark.slurm
def test_cli_slurm_run_and_detach(tmp_path: Path) -> None:
    need("slurm")
    src = _tasks(tmp_path, 3)
    env = _env(tmp_path)
    sl = ["--executor", "slurm", "--set", "slurm.cpus_per_task=1", "--set", "slurm.time_min=10",
          "--set", "slurm.units_per_task=2", "--set", "slurm.poll_s=1"]
    r = _run(["run", str(src), "--run-name", "sl", "--json", *COMMON, *sl], env)
    assert r.returncode == 0, r.stderr
    assert "submitted array job" in r.stderr
    info = json.loads(r.stdout)
    assert info["ok"] == 6 and info["missing"] == 0

    d = _run(["run", str(src), "--run-name", "det", "--detach", *COMMON, *sl], env, timeout=120)
    assert d.returncode == 0, d.stderr
    assert "et-hpc status" in d.stdout and "submitted array job" in d.stderr
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        st = json.loads(_run(["status", "det", "--json"], env).stdout)
        if st["ok"] == 6 and st["array_tasks"]["done"] == 3:
            break
        time.sleep(1)
    assert st["ok"] == 6 and st["array_tasks"] == {"queued": 0, "running": 0, "done": 3, "failed": 0, "unknown": 0}
