"""Space is planned: ``et-hpc build`` and ``et-hpc run`` refuse a plan that does not fit, before it starts.

The small filesystem is real: a tmpfs of a few MB mounted in a user and mount namespace of our
own (``unshare --user --mount --map-root-user``), so ``statvfs`` reports its true size. The
positive control runs the same plan on a large tmpfs, where it fits.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from et_hpc.images import space

NATIVE = "task_000000_dfbcff7a"


def _userns_tmpfs_works() -> bool:
    if not shutil.which("unshare"):
        return False
    r = subprocess.run(["unshare", "--user", "--mount", "--map-root-user", "true"], capture_output=True)
    return r.returncode == 0


needs_userns = pytest.mark.skipif(not _userns_tmpfs_works(), reason="no unprivileged user+mount namespaces here")


def on_tmpfs(mnt: Path, size: str, *cmd: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` with a fresh tmpfs of ``size`` mounted at ``mnt`` (seen by ``cmd`` only)."""
    mnt.mkdir(parents=True, exist_ok=True)
    script = 'mount -t tmpfs -o size="$1" tmpfs "$2" && mkdir -p "$2/cache/base" "$2/scratch" && shift 2 && exec "$@"'
    return subprocess.run(
        ["unshare", "--user", "--mount", "--map-root-user", "sh", "-c", script, "sh", size, str(mnt), *cmd],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


def et_hpc_env(mnt: Path) -> dict[str, str]:
    import os

    return {**os.environ, "ET_HPC_SCRATCH": str(mnt / "scratch"), "ET_HPC_CACHE": str(mnt / "cache")}


def with_base(base_sif: Path, mnt: Path) -> list[str]:
    """Shell words that link the session's base image (and its digest sidecar) into the tmpfs cache."""
    return [f"ln -s {base_sif} {mnt}/cache/base/ && ln -s {base_sif.with_suffix('.json')} {mnt}/cache/base/"]


@needs_userns
def test_build_refuses_on_a_small_cache_and_fits_on_a_large_one(tmp_path: Path, fixtures_dir: Path, base_sif: Path) -> None:
    tasks = tmp_path / "tasks"
    shutil.copytree(fixtures_dir / "native" / NATIVE, tasks / NATIVE)
    mnt = tmp_path / "fs"
    build = f"{sys.executable} -m et_hpc.cli build {tasks} --cache {mnt}/cache --jobs 1"
    small = on_tmpfs(mnt, "8m", "sh", "-c", f"{with_base(base_sif, mnt)[0]} && {build}", env=et_hpc_env(mnt))
    assert small.returncode == 2, small.stderr
    lines = [ln for ln in small.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in small.stderr, small.stderr
    assert lines[0].startswith(f"et-hpc: error: not enough space on {mnt} (tmpfs)"), lines[0]
    needed = int(lines[0].split("the plan needs ")[1].split(" bytes")[0])
    assert needed >= base_sif.stat().st_size + space.task_image_bytes(), lines[0]
    assert "free 8388608 bytes" in lines[0], lines[0]  # statvfs of the real 8 MB filesystem
    # positive control: the same plan on a large filesystem passes the check (dry run: nothing built)
    large = on_tmpfs(mnt, "64g", "sh", "-c", f"{with_base(base_sif, mnt)[0]} && {build} --dry-run", env=et_hpc_env(mnt))
    assert large.returncode == 0, large.stderr
    assert f"space for 1 image(s): {mnt}: needs" in large.stderr, large.stderr


@needs_userns
def test_run_refuses_when_overlays_do_not_fit_on_scratch(tmp_path: Path, base_sif: Path) -> None:
    task = tmp_path / "tasks" / "demo_hello_file"
    shutil.copytree(Path(__file__).resolve().parents[2] / "defs" / "demo" / "demo_hello_file", task)
    (task / "container.def").unlink()
    (task / "container.sif").symlink_to(base_sif)  # a prebuilt image: no build needed
    mnt = tmp_path / "fs"
    cmd = [sys.executable, "-m", "et_hpc.cli", "run", str(task.parent), "--policy", "oracle", "--concurrency", "2"]
    cmd += ["--store", str(tmp_path / "runs"), "--set", "sandbox.overlay_mb=64", "--set", "sandbox.local_copy=never"]
    small = on_tmpfs(mnt, "32m", *cmd, env=et_hpc_env(mnt))
    assert small.returncode == 2, small.stderr
    last = small.stderr.strip().splitlines()[-1]
    assert last.startswith(f"et-hpc: error: not enough space on {mnt} (tmpfs): the plan needs 67108864 bytes"), last
    assert "1 overlay(s) of 64 MB" in last, last  # one task, one sample: one episode at once
    # positive control, same plan and the same real statvfs, on a filesystem large enough
    probe = (
        f"from et_hpc.images import space; print(space.check([space.Need(__import__('pathlib').Path('{mnt}/scratch'), {64 << 20}, 'x')]))"
    )
    large = on_tmpfs(mnt, "1g", sys.executable, "-c", probe, env=et_hpc_env(mnt))
    assert large.returncode == 0 and large.stdout.strip().endswith("None)"), large.stdout + large.stderr


def test_quota_outputs_are_parsed() -> None:
    lfs = "/lustre/scratch  1048576*  2097152  3145728  -  100  0  0  -\n"
    assert space.parse_lfs_quota(lfs) == (2097152 - 1048576) * 1024
    assert space.parse_lfs_quota("/lustre 4 0 0 - 1 0 0 -") is None  # no limit set
    q = (
        "Disk quotas for user etuser (uid 1000): \n"
        "     Filesystem  blocks   quota   limit   grace   files   quota   limit   grace\n"
        "      /dev/sdb1   51200  102400  204800               12       0       0        \n"
    )
    assert space.parse_quota_w(q, "/dev/sdb1", "/home") == (102400 - 51200) * 1024
    assert space.parse_quota_w(q, "/dev/sdc1", "/scratch") is None  # another filesystem


def test_a_quota_smaller_than_free_space_refuses(tmp_path: Path) -> None:
    r = space.FsRoom(mount="/home", device="/dev/sdb1", needed=10 * space.MB, free=10**12, quota_left=space.MB, quota_source="quota")
    assert not r.fits
    assert "quota (quota) leaves 1048576 bytes" in space.refusal(r)
    assert space.FsRoom(mount="/", device="d", needed=1, free=2).fits
