"""Slurm's submit limits, read before sbatch: a run needing more array tasks than Slurm accepts now
is paced (tests/runner/test_submit_paced.py); with --detach it is refused, naming the
units_per_task that fits."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from et_hpc.errors import UserError
from et_hpc.host.slurm import parse_scontrol_config
from et_hpc.runner.config import RunConfig, SlurmConfig
from et_hpc.runner.slurm import SubmitLimits, check_fits, parse_sacctmgr, submit_limits

ET_HPC = [sys.executable, "-m", "et_hpc.cli"]

# `sacctmgr -n -P show qos format=Name,MaxSubmitPU,MaxSubmitPA,GrpSubmit` on a cluster with limits
QOS_TEXT = "normal|500|2000|\nlong|20||100\n"


def test_check_fits_names_a_units_per_task_that_fits() -> None:
    lim = SubmitLimits(max_array_size=1001)
    rows = parse_sacctmgr(QOS_TEXT, ["name", "max_submit_pu", "max_submit_pa", "grp_submit"])
    assert rows[1] == {"name": "long", "max_submit_pu": "20", "max_submit_pa": "", "grp_submit": "100"}
    lim.add(int(rows[0]["max_submit_pu"]), 120, "MaxSubmitPU of QOS normal")
    lim.add(10000, 3000, "MaxJobCount")
    assert lim.free == 380 and lim.why == "MaxSubmitPU of QOS normal=500, 120 jobs queued"
    assert check_fits(380, 1, lim) == 380  # exactly what fits is accepted
    with pytest.raises(UserError) as e:
        check_fits(5000, 1, lim)
    msg = str(e.value)
    assert "\n" not in msg and "5000 units" in msg and "380 more" in msg and "MaxSubmitPU of QOS normal=500" in msg
    assert "--set slurm.units_per_task=14" in msg and math.ceil(5000 / 14) <= 380
    for units in (1, 7, 381, 999, 5000, 123457):  # the named value always fits
        for free in (1, 2, 3, 380, 1000):
            small = SubmitLimits(max_array_size=1001)
            small.add(free, 0, "x")
            try:
                check_fits(units, 1, small)
            except UserError as err:
                fit = int(str(err).rsplit("=", 1)[1])
                assert check_fits(units, fit, small) <= free
                assert fit == 1 or math.ceil(units / (fit - 1)) > free  # and it is the smallest that fits
    full = SubmitLimits(max_array_size=1001)
    full.add(500, 500, "MaxSubmitPU of QOS normal")
    with pytest.raises(UserError, match="accepts no more jobs now"):
        check_fits(1, 8, full)
    assert check_fits(10**6, 1, SubmitLimits(max_array_size=1001)) == 10**6  # no limit known: no refusal


def test_parse_scontrol_config_lines() -> None:
    text = (
        "Configuration data as of 2026-01-01T00:00:00\nAccountingStorageEnforce = none\n"
        "MaxArraySize            = 10001\nMaxJobCount             = 10000\nSlurmctldParameters     = (null)\n"
    )
    conf = parse_scontrol_config(text)
    assert conf["MaxArraySize"] == "10001" and conf["MaxJobCount"] == "10000" and "Configuration" not in conf


@pytest.mark.slurm
def test_real_limits_query(tmp_path: Path) -> None:
    text = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, check=True).stdout
    conf = parse_scontrol_config(text)
    size, count = int(conf["MaxArraySize"]), int(conf["MaxJobCount"])
    lim = submit_limits(RunConfig(executor="slurm"))
    assert lim.max_array_size == size
    assert any(d.startswith(f"MaxJobCount={count}") for _, d in lim.limits)
    assert lim.free is not None and lim.free <= count
    # a configured split size above the cluster's is clamped to it
    assert submit_limits(RunConfig(slurm=SlurmConfig(max_array_size=10 * size))).max_array_size == size
    assert submit_limits(RunConfig(slurm=SlurmConfig(max_array_size=3))).max_array_size == 3
    capped = submit_limits(RunConfig(slurm=SlurmConfig(max_submit_jobs=2)))
    assert capped.free == 2 and capped.why == "slurm.max_submit_jobs=2"
    qos = subprocess.run(
        ["sacctmgr", "-n", "-P", "show", "qos", "format=Name,MaxSubmitPU,MaxSubmitPA,GrpSubmit"], capture_output=True, text=True
    )
    if qos.returncode == 0 and qos.stdout.strip():  # accounting: the real rows parse
        rows = parse_sacctmgr(qos.stdout, ["name", "max_submit_pu", "max_submit_pa", "grp_submit"])
        assert rows and all(r["name"] for r in rows)


@pytest.mark.slurm
def test_cli_detach_refuses_before_sbatch_and_a_waiting_run_paces(tmp_path: Path) -> None:
    from helpers.units import cli_env, task_folders

    src = task_folders(tmp_path, 3)
    env = cli_env(tmp_path, sleep_s=0)
    name = f"limits-{os.getpid()}"
    args = [
        "run",
        str(src),
        "--run-name",
        name,
        "--samples",
        "2",
        "--executor",
        "slurm",
        "--set",
        "unit_runner=helpers.units:work_runner",
        "--set",
        "slurm.cpus_per_task=1",
        "--set",
        "slurm.time_min=10",
        "--set",
        "slurm.poll_s=1",
        "--set",
        "slurm.max_submit_jobs=2",
        "--set",
        "slurm.units_per_task=1",
    ]
    r = subprocess.run(ET_HPC + args + ["--detach"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("et-hpc: error:")]
    assert len(err) == 1 and "6 array tasks" in err[0] and "--set slurm.units_per_task=3" in err[0]
    assert "rerun without --detach" in err[0]
    assert "Traceback" not in r.stderr
    run_dir = tmp_path / "store" / name
    assert not (run_dir / "jobs.json").exists()  # nothing was submitted
    q = subprocess.run(["squeue", "-h", "--me", "-n", f"et-hpc-{name}", "-o", "%i"], capture_output=True, text=True)
    assert q.stdout.strip() == ""

    # without --detach the same run is submitted two array tasks at a time and completes
    ok = subprocess.run(ET_HPC + args + ["--json"], env=env, capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["ok"] == 6
    assert "4 array task(s) wait to be submitted: slurm.max_submit_jobs=2" in ok.stderr
    subs = json.loads((run_dir / "jobs.json").read_text())["submissions"]
    assert sum(s["tasks"] for s in subs) == 6 and all(s["tasks"] <= 2 for s in subs) and len(subs) >= 3
