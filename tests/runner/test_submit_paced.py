"""A run larger than the site's MaxSubmitJobs completes under it: the array goes in paced chunks.

The real test runs on the real slurmdbd: provisioning makes the QOS ``etlimit`` with
``MaxSubmitJobsPerUser=5`` (enforced: ``AccountingStorageEnforce=...limits,qos``) that etuser may
use. It first shows that Slurm refuses 20 array elements under that QOS outright (the positive
control), then runs 20 units at one unit per array task and samples ``squeue`` all along.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from et_hpc.host.slurm_limits import SUBMIT_LIMIT_RE, Pacer, submit_limits
from et_hpc.runner.config import SlurmConfig

ET_HPC = [sys.executable, "-m", "et_hpc.cli"]
QOS, LIMIT = "etlimit", 5


@settings(max_examples=200, deadline=None)
@given(
    per_min=st.integers(1, 50),
    steps=st.lists(st.tuples(st.floats(0, 90), st.integers(1, 60)), max_size=40),
)
def test_pacer_never_exceeds_its_cap_in_any_minute(per_min: int, steps: list[tuple[float, int]]) -> None:
    now = [0.0]
    p = Pacer(per_min, clock=lambda: now[0])
    sent: list[tuple[float, int]] = []
    for dt, want in steps:
        now[0] += dt
        n = min(want, p.room() or 0)
        if n:
            p.add(n)
            sent.append((now[0], n))
    for t0, _ in sent:  # every 60 s window that starts at a submission
        assert sum(n for t, n in sent if t0 <= t < t0 + 60) <= per_min
    assert Pacer(None).room() is None


def test_limit_refusals_are_told_apart() -> None:
    assert SUBMIT_LIMIT_RE.search("sbatch: error: QOSMaxSubmitJobPerUserLimit")
    assert SUBMIT_LIMIT_RE.search("sbatch: error: AssocMaxSubmitJobLimit")
    assert SUBMIT_LIMIT_RE.search("Batch job submission failed: Job violates accounting/QOS policy (job submit limit, user's ...)")
    assert not SUBMIT_LIMIT_RE.search("sbatch: error: invalid partition specified: nope")
    assert not SUBMIT_LIMIT_RE.search("sbatch: error: Invalid qos specification")


def _need_qos() -> None:
    r = subprocess.run(["sacctmgr", "-n", "-P", "show", "qos", QOS, "format=Name,MaxSubmitPU"], capture_output=True, text=True)
    enforce = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True).stdout
    why = ""
    if r.stdout.strip() != f"{QOS}|{LIMIT}":
        why = f"QOS {QOS} with MaxSubmitJobsPerUser={LIMIT} is missing (run scripts/provision-debian as root)"
    elif not re.search(r"^AccountingStorageEnforce\s*=.*limits", enforce, re.MULTILINE):
        why = "Slurm does not enforce QOS limits (AccountingStorageEnforce; run scripts/provision-debian as root)"
    if why:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"required in CI: {why}")
        pytest.skip(why)


def _mine() -> int:
    r = subprocess.run(["squeue", "-h", "-r", "--me", "-q", QOS, "-o", "%i"], capture_output=True, text=True, timeout=30)
    return len(r.stdout.split()) if r.returncode == 0 else -1


@pytest.mark.slurm
def test_run_larger_than_max_submit_jobs_completes_under_it(tmp_path: Path) -> None:
    from helpers.units import cli_env, record_counts, task_folders

    _need_qos()
    assert _mine() == 0, "jobs of an earlier run are still queued under the QOS"
    # positive control: Slurm itself refuses 20 elements under the QOS
    ctl = subprocess.run(
        ["sbatch", f"--qos={QOS}", "--array=0-19", "-o", "/dev/null", "--wrap", "true"], capture_output=True, text=True, timeout=60
    )
    assert ctl.returncode != 0 and "QOSMaxSubmitJobPerUserLimit" in ctl.stderr, ctl.stderr
    lim = submit_limits(SlurmConfig(qos=QOS))
    assert lim.free == LIMIT and lim.why == f"MaxSubmitJobsPerUser of QOS {QOS}={LIMIT}", lim

    src = task_folders(tmp_path, 10)
    env = cli_env(tmp_path, sleep_s=1)
    name = f"paced-{os.getpid()}"
    args = ["run", str(src), "--run-name", name, "--samples", "2", "--executor", "slurm", "--json"]
    for kv in ("unit_runner=helpers.units:work_runner", f"slurm.qos={QOS}", "slurm.units_per_task=1", "slurm.cpus_per_task=1"):
        args += ["--set", kv]
    args += ["--set", "slurm.time_min=10", "--set", "slurm.poll_s=1"]
    seen: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            seen.append(_mine())
            stop.wait(0.3)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        r = subprocess.run(ET_HPC + args, env=env, capture_output=True, text=True, timeout=900)
    finally:
        stop.set()
        sampler.join()
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["ok"] == 20
    assert "wait to be submitted" in r.stderr and f"MaxSubmitJobsPerUser of QOS {QOS}={LIMIT}" in r.stderr
    assert "QOSMaxSubmitJobPerUserLimit" not in r.stderr  # never refused: each chunk fitted
    from et_hpc.runner.plan import open_store

    counts = record_counts(open_store(tmp_path / "store" / name))
    assert len(counts) == 20 and set(counts.values()) == {1}, counts
    assert seen and -1 not in seen and max(seen) <= LIMIT, seen
    assert max(seen) >= 2  # the queue was really used (several tasks queued at once)
    subs = json.loads((tmp_path / "store" / name / "jobs.json").read_text())["submissions"]
    assert len(subs) >= 20 // LIMIT and sum(s["tasks"] for s in subs) == 20 and sum(s["units"] for s in subs) == 20
    assert len({s["attempt"] for s in subs}) == 1 and all(s["tasks"] <= LIMIT for s in subs)
