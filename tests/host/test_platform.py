"""Platform: doctor, the base image, rootless builds and instances, a submitit array on real Slurm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from helpers import until

ET = [sys.executable, "-m", "et_hpc.cli"]


def et(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*ET, *args], capture_output=True, text=True, env=env, timeout=900)


@pytest.mark.apptainer
@pytest.mark.slurm
def test_doctor_all_ok_after_provisioning(base_sif):
    r = et("doctor", "--json")
    checks = json.loads(r.stdout)
    not_ok = [c for c in checks if c["status"] != "OK"]
    assert not_ok == [], not_ok
    assert r.returncode == 0
    names = {c["name"] for c in checks}
    assert {
        "apptainer",
        "subuid/subgid",
        "/dev/fuse",
        "fuse helpers",
        "sessiondir max size",
        "slurm MaxArraySize",
        "slurm accounting",
        "node-local scratch",
        "image cache",
        "unsquashfs",
        "runtime mode",
        "fakeroot builds",
        "squashfuse_ll",
        "slurm submit limits",
    } <= names


def test_doctor_without_apptainer_fails_with_fix(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python").symlink_to(sys.executable)
    env = dict(os.environ, PATH=str(bindir))
    r = et("doctor", env=env)
    assert r.returncode == 2
    line = next(ln for ln in r.stdout.splitlines() if ln.split()[:2] == ["FAIL", "apptainer"])
    assert "not found" in line
    assert any(ln.startswith("FAIL apptainer: fix:") and "Apptainer" in ln for ln in r.stdout.splitlines())
    assert "Traceback" not in r.stderr
    # no unsquashfs either: unpacked images are not possible, which only warns
    assert any(ln.split()[:2] == ["WARN", "unsquashfs"] and "falls back" in ln for ln in r.stdout.splitlines())


def _doctor_checks(env: dict) -> tuple[int, dict[str, dict]]:
    r = et("doctor", "--json", env=env)
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, {c["name"]: c for c in json.loads(r.stdout)}


def test_doctor_warns_about_a_cache_others_can_write(tmp_path):
    cache = tmp_path / "cache"
    (cache / "images" / "ab").mkdir(parents=True)
    sif = cache / "images" / "ab" / "abcd.sif"
    sif.write_bytes(b"image")
    for p in (cache, cache / "images", cache / "images" / "ab"):
        p.chmod(0o700)
    sif.chmod(0o644)
    env = dict(os.environ, ET_HPC_CACHE=str(cache), ET_HPC_SCRATCH=str(tmp_path / "scratch"))
    _, checks = _doctor_checks(env)
    assert checks["image cache"]["status"] == "OK", checks["image cache"]  # private: no warning
    sif.chmod(0o666)
    (cache / "images").chmod(0o775)
    _, checks = _doctor_checks(env)
    c = checks["image cache"]
    assert c["status"] == "WARN" and "swap a SIF" in c["detail"] and f"chmod -R go-w {cache}" in c["fix"]
    assert str(cache / "images") in c["detail"] and "and 1 more" in c["detail"]


def test_scratch_of_others_or_open_to_them_is_refused(tmp_path):
    import getpass

    from et_hpc.errors import UserError
    from et_hpc.paths import check_private_dir

    base = tmp_path / "scratch"
    mine = base / f"et-hpc-{getpass.getuser()}"
    env = dict(os.environ, ET_HPC_SCRATCH=str(base))
    _, checks = _doctor_checks(env)
    assert checks["node-local scratch"]["status"] == "OK" and mine.stat().st_mode & 0o777 == 0o700
    mine.chmod(0o777)  # as if another user had made it first on a shared /tmp
    rc, checks = _doctor_checks(env)
    c = checks["node-local scratch"]
    assert rc == 2 and c["status"] == "FAIL" and "writable by others" in c["detail"] and "chmod 700" in c["fix"]
    r = et(
        "run", "defs/demo", "--policy", "null", "--store", str(tmp_path / "store"), "--run-name", "x", env=env
    )  # run refuses it too, in one line, before any episode
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("et-hpc: error:")]
    assert r.returncode == 2 and len(err) == 1 and "writable by others" in err[0], r.stderr
    assert "Traceback" not in r.stderr and not list((tmp_path / "store").rglob("part-*.parquet"))
    mine.rmdir()
    mine.symlink_to(tmp_path)
    _, checks = _doctor_checks(env)
    assert checks["node-local scratch"]["status"] == "FAIL" and "not a plain directory" in checks["node-local scratch"]["detail"]
    try:  # someone else's directory (root's here)
        check_private_dir(Path("/usr"), "node-local scratch")
    except UserError as e:
        assert "belongs to uid 0, not you" in str(e) and "\n" not in str(e)
    else:
        assert os.getuid() == 0


def test_base_build_second_run_is_cached(base_sif):
    r = et("base", "build", "--source", "debian", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["cached"] is True
    assert Path(info["path"]) == base_sif
    r2 = et("base", "build", "--source", "debian")
    assert r2.returncode == 0 and r2.stdout.startswith("cached:")


@pytest.mark.apptainer
def test_fakeroot_build_of_localimage_def(base_sif, tmp_path):
    d = tmp_path / "t.def"
    d.write_text(
        f"Bootstrap: localimage\nFrom: {base_sif}\n\n%post -c /bin/bash\n"
        "    set -euo pipefail\n    mkdir -p /home/user/data\n    echo built-$((6*7)) > /home/user/data/x.txt\n"
        "    pip3 --version >/dev/null\n"
    )
    sif = tmp_path / "t.sif"
    r = subprocess.run(
        ["apptainer", "build", "--fakeroot", str(sif), str(d)],
        capture_output=True,
        text=True,
        env=dict(os.environ, APPTAINER_TMPDIR=str(tmp_path)),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = subprocess.run(["apptainer", "exec", str(sif), "cat", "/home/user/data/x.txt"], capture_output=True, text=True)
    assert out.stdout.strip() == "built-42"


def _instances() -> list[str]:
    r = subprocess.run(["apptainer", "instance", "list", "--json"], capture_output=True, text=True, check=True)
    return [i["instance"] for i in json.loads(r.stdout or "{}").get("instances", [])]


@pytest.mark.apptainer
def test_instance_with_overlay_roundtrip(base_sif, tmp_path):
    ov = tmp_path / "ov.img"
    subprocess.run(["apptainer", "overlay", "create", "--sparse", "--size", "64", str(ov)], check=True, capture_output=True)
    name = f"ettest-{uuid.uuid4().hex[:8]}"
    subprocess.run(
        ["apptainer", "instance", "start", "--containall", "--cleanenv", "--overlay", str(ov), str(base_sif), name],
        check=True,
        capture_output=True,
    )
    try:
        assert name in _instances()
        subprocess.run(["apptainer", "exec", f"instance://{name}", "sh", "-c", "echo persisted > /home/user/w.txt"], check=True)
        r = subprocess.run(["apptainer", "exec", f"instance://{name}", "cat", "/home/user/w.txt"], capture_output=True, text=True)
        assert r.stdout.strip() == "persisted"
    finally:
        subprocess.run(["apptainer", "instance", "stop", name], capture_output=True)
    assert name not in _instances()


@pytest.mark.slurm
def test_submitit_array_on_real_slurm(tmp_path):
    import submitit

    ex = submitit.AutoExecutor(folder=tmp_path / "logs", cluster="slurm")
    ex.update_parameters(timeout_min=5, slurm_array_parallelism=4, cpus_per_task=1, mem_gb=1)
    jobs = ex.map_array(pow, [2, 3, 4, 5, 6, 7], [2] * 6)
    assert all("_" in j.job_id for j in jobs)  # array task ids
    results = [j.result() for j in jobs]
    assert results == [4, 9, 16, 25, 36, 49]
    # submitit reads each result as soon as the task has written it; the job's own end reaches
    # accounting a moment later, so wait for every array task's record to say COMPLETED.
    array_id = jobs[0].job_id.split("_")[0]

    def all_completed() -> bool:
        r = subprocess.run(["sacct", "-n", "-X", "-j", array_id, "-o", "State"], capture_output=True, text=True)
        return r.returncode == 0 and r.stdout.split() == ["COMPLETED"] * 6

    until(f"accounting to record the 6 tasks of array {array_id} as COMPLETED", all_completed, 120, every_s=2)
