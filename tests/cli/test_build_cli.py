"""``et-hpc build`` end to end: real fixtures, real apptainer, a real Slurm array.

Builds take about a minute each here and the machine is shared, so the suite builds two real
fixtures (one native that builds, the Harbor task whose recipe downloads kubectl from an
unreachable host) plus one tiny def through Slurm.
"""

from __future__ import annotations

import getpass
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

NATIVE = "task_000000_dfbcff7a"
KUBECTL = "task_000000_2884808f"  # Harbor: curl https://dl.k8s.io/... fails offline


def et_hpc(*args: str, cwd: Path | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "et_hpc.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=timeout)


def cache_with_base(tmp_path: Path, base_sif: Path) -> Path:
    """A fresh image cache sharing the session's base image (symlinked with its digest sidecar)."""
    cache = tmp_path / "cache"
    (cache / "base").mkdir(parents=True)
    for f in (base_sif, base_sif.with_suffix(".json")):
        (cache / "base" / f.name).symlink_to(f)
    return cache


def copy_tasks(fixtures_dir: Path, dest: Path, names: dict[str, str]) -> Path:
    for name, kind in names.items():
        shutil.copytree(fixtures_dir / kind / name, dest / name)
    return dest


def by_task(out: str) -> dict[str, dict]:
    return {r["task_id"]: r for r in json.loads(out)["results"]}


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, fixtures_dir: Path) -> None:
    r = et_hpc("build", str(tmp_path / "nope"))
    assert r.returncode == 2 and r.stderr.strip().startswith("et-hpc: error:") and "Traceback" not in r.stderr
    tasks = copy_tasks(fixtures_dir, tmp_path / "tasks", {NATIVE: "native"})
    r = et_hpc("build", str(tasks), "--glob", "nothing_*")
    assert r.returncode == 2 and "no tasks selected" in r.stderr
    r = et_hpc("build", str(tasks), "--slurm", "--time", "1:xx")
    assert r.returncode == 2 and "--time '1:xx'" in r.stderr
    empty_cache = tmp_path / "empty-cache"
    r = et_hpc("build", str(tasks), "--cache", str(empty_cache))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"et-hpc: error: base image {empty_cache / 'base' / 'ubuntu_22.04.sif'} not found: build it with 'et-hpc base build'"
    ]


def test_build_fixtures_statuses_and_summary(tmp_path: Path, fixtures_dir: Path, base_sif: Path) -> None:
    cache = cache_with_base(tmp_path, base_sif)
    tasks = copy_tasks(fixtures_dir, tmp_path / "tasks", {NATIVE: "native", KUBECTL: "harbor"})

    r = et_hpc("build", str(tasks), "--cache", str(cache), "--jobs", "2", "--json")
    assert r.returncode == 1, r.stderr  # one failed
    res = by_task(r.stdout)
    assert res[NATIVE]["status"] == "built" and Path(res[NATIVE]["path"]).is_file()
    assert res[KUBECTL]["status"] == "failed"
    assert res[KUBECTL]["reason"] == "curl: (6) Could not resolve host: dl.k8s.io"
    assert json.loads(r.stdout)["counts"] == {"built": 1, "failed": 1}
    failed_rec = cache / "failed" / f"{res[KUBECTL]['key']}.json"
    stamp = failed_rec.stat().st_mtime_ns

    r = et_hpc("build", str(tasks), "--cache", str(cache))  # the human table this time
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["task", "status", "seconds", "reason"]
    rows = {ln.split()[0]: ln.split(None, 3) for ln in lines[2:]}
    assert rows[NATIVE][1] == "cached" and rows[KUBECTL][1] == "failed"
    assert rows[KUBECTL][3] == "curl: (6) Could not resolve host: dl.k8s.io"
    assert f"failed: {KUBECTL}" in r.stderr and "1 cached, 1 failed" in r.stderr
    assert failed_rec.stat().st_mtime_ns == stamp, "a recorded failure is not rebuilt"

    r = et_hpc("build", str(tasks), "--cache", str(cache), "--ids", NATIVE, "--json")
    assert r.returncode == 0
    assert by_task(r.stdout)[NATIVE]["path"] == res[NATIVE]["path"]

    r = et_hpc("build", str(tasks), "--cache", str(cache), "--dry-run", "--json")
    assert r.returncode == 0
    assert {k: v["status"] for k, v in by_task(r.stdout).items()} == {NATIVE: "cached", KUBECTL: "failed"}


@pytest.mark.slurm
def test_build_as_slurm_array(tmp_path: Path, base_sif: Path) -> None:
    cache = cache_with_base(tmp_path, base_sif)
    tasks = tmp_path / "tasks"
    for name, body in {"tiny_a": "echo a > /a.txt", "tiny_b": "echo b > /b.txt"}.items():
        d = tasks / name
        d.mkdir(parents=True)
        (d / "task.json").write_text(json.dumps({"description": f"task {name}", "truth": "x"}))
        (d / "container.def").write_text(f"Bootstrap: localimage\nFrom: ./ubuntu_22.04.sif\n\n%post\n    {body}\n")
    r = et_hpc(
        "build",
        str(tasks),
        "--cache",
        str(cache),
        "--slurm",
        "--per-task",
        "2",
        "--time",
        "20",
        "--cpus",
        "1",
        "--deadline",
        "15",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    assert "submitted Slurm array" in r.stderr
    res = by_task(r.stdout)
    assert sorted(v["status"] for v in res.values()) == ["built", "built"]
    for v in res.values():
        assert Path(v["path"]).is_file()
    assert list((cache / "slurm").iterdir()), "submitit folder on the cache"

    r = et_hpc("build", str(tasks), "--cache", str(cache), "--slurm", "--json")
    assert r.returncode == 0
    assert "submitted" not in r.stderr, "nothing to build: no array is submitted"
    assert {v["status"] for v in by_task(r.stdout).values()} == {"cached"}


@pytest.mark.slurm
def test_slurm_killed_build_is_reported_not_waited_for(tmp_path: Path, base_sif: Path) -> None:
    from helpers.images import build_processes

    cache = cache_with_base(tmp_path, base_sif)
    d = tmp_path / "tasks" / "slow_task"
    d.mkdir(parents=True)
    started = tmp_path / "started"
    (d / "task.json").write_text(json.dumps({"description": "slow", "truth": "x"}))
    (d / "container.def").write_text(f"Bootstrap: localimage\nFrom: ./ubuntu_22.04.sif\n\n%setup\n    touch {started}\n    sleep 600\n")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "et_hpc.cli",
            "build",
            str(d.parent),
            "--cache",
            str(cache),
            "--slurm",
            "--time",
            "30",
            "--cpus",
            "1",
            "--deadline",
            "20",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not started.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the build never started in Slurm"
            time.sleep(1)
        jobs = subprocess.run(
            ["squeue", "-h", "-u", getpass.getuser(), "-n", "et-hpc-build", "-o", "%i"], capture_output=True, text=True
        ).stdout.split()
        assert jobs, "the build array is in the queue"
        subprocess.run(["scancel", *jobs], check=True)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    r = by_task(out)["slow_task"]
    assert r["status"] == "failed" and "ended CANCELLED" in r["reason"], r
    key = r["key"]
    assert not (cache / "failed" / f"{key}.json").exists(), "a cancelled build is not a recorded failure"
    end = time.monotonic() + 120
    while build_processes(key):
        assert time.monotonic() < end, f"build processes outlived the cancelled job: {build_processes(key)}"
        time.sleep(1)
    assert not list((cache / "images").rglob("*.sif")), "no image, whole or partial"
