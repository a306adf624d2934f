"""Which mode Apptainer runs in: doctor tells it, run.json records it, a run refuses mode "none".

The no-namespace case is real: a user namespace of the test's own (``unshare --user --map-auto
--map-root-user``, subordinate ids from /etc/subuid) whose root sets ``max_user_namespaces`` to 0
in it and drops to uid 1000 of it (``setpriv``). Apptainer there cannot create its namespace; the
test first shows that (the positive control), then that doctor and a run say so in one line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from et_hpc.host import runtime

ET_HPC = [sys.executable, "-m", "et_hpc.cli"]

# run as root of a fresh user namespace: no nested namespace may be made, then "$@" as uid 1000 of it
NO_USERNS = r"""#!/bin/sh
echo 0 > /proc/sys/user/max_user_namespaces || exit 99
d=$(mktemp -d /tmp/et-nons.XXXXXX) && chown 1000:1000 "$d" || exit 98
exec setpriv --reuid 1000 --regid 1000 --clear-groups env HOME="$d" ET_HPC_SCRATCH="$d/scratch" \
    ET_HPC_CACHE="$d/cache" ET_HPC_STORE="$d/store" "$@"
"""


def test_version_lines_of_each_flavour() -> None:
    assert runtime.parse_version("apptainer version 1.4.5\n") == ("apptainer", "1.4.5")
    assert runtime.parse_version("singularity-ce version 4.1.2-jammy\n") == ("singularity-ce", "4.1.2-jammy")
    assert runtime.parse_version("singularity version 3.8.7-1.el8\n") == ("singularity", "3.8.7-1.el8")
    assert runtime.parse_version("") == ("", "")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A folder uid 1000 of the test's namespace can read (pytest's tmp_path is private to etuser)."""
    d = Path(tempfile.mkdtemp(prefix="et-modes-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _tasks(root: Path) -> Path:
    from helpers.units import task_folders

    src = task_folders(root, 2)
    for p in [root, *root.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return src


def _in_no_userns(shared: Path, *cmd: str) -> subprocess.CompletedProcess[str]:
    script = shared / "no-userns.sh"
    script.write_text(NO_USERNS)
    script.chmod(0o755)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")])))
    return subprocess.run(
        ["unshare", "--user", "--map-auto", "--map-root-user", str(script), *cmd], env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.apptainer
def test_doctor_and_run_json_name_this_nodes_mode(tmp_path: Path) -> None:
    from helpers.units import cli_env, task_folders

    rt = runtime.probe()
    assert rt.flavour == "apptainer" and rt.version and rt.mode == runtime.USERNS, rt
    r = subprocess.run([*ET_HPC, "doctor", "--json"], capture_output=True, text=True, timeout=300)
    checks = {c["name"]: c for c in json.loads(r.stdout)}
    assert checks["runtime mode"]["status"] == "OK" and checks["runtime mode"]["detail"].startswith("userns:")
    assert checks["fakeroot builds"]["status"] == "OK" and checks["squashfuse_ll"]["status"] == "OK"
    assert checks["apptainer"]["detail"] == f"apptainer version {rt.version}"

    src = task_folders(tmp_path, 1)
    run = subprocess.run(
        [*ET_HPC, "run", str(src), "--run-name", "modes", "--set", "unit_runner=helpers.units:work_runner"],
        env=cli_env(tmp_path, sleep_s=0),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    got = json.loads((tmp_path / "store" / "modes" / "run.json").read_text())["runtime"]
    assert got["flavour"] == "apptainer" and got["version"] == rt.version and got["mode"] == "userns"
    assert got["kernel"] == os.uname().release and got["max_user_namespaces"] == rt.max_user_namespaces


@pytest.mark.apptainer
def test_without_user_namespaces_doctor_and_a_run_say_so_in_one_line(base_sif: Path, shared_dir: Path) -> None:
    if not shutil.which("setpriv") or not shutil.which("newuidmap"):
        pytest.skip("needs setpriv and newuidmap (util-linux, uidmap)")
    sif = shared_dir / "base.sif"
    shutil.copyfile(base_sif, sif)
    sif.chmod(0o644)
    # positive control: inside, apptainer itself cannot create its namespace
    ctl = _in_no_userns(shared_dir, "apptainer", "exec", str(sif), "true")
    assert ctl.returncode not in (0, 98, 99), ctl.stderr
    assert "Failed to create user namespace" in ctl.stderr and "max_user_namespaces" in ctl.stderr, ctl.stderr
    # and outside, the same command works
    assert subprocess.run(["apptainer", "exec", str(sif), "true"], capture_output=True, timeout=300).returncode == 0

    doc = _in_no_userns(shared_dir, sys.executable, "-m", "et_hpc.cli", "doctor", "--json")
    assert doc.returncode == 2, doc.stderr
    checks = {c["name"]: c for c in json.loads(doc.stdout)}
    mode = checks["runtime mode"]
    assert mode["status"] == "FAIL" and "\n" not in mode["detail"]
    assert mode["detail"] == "none: max_user_namespaces is 0 and no setuid starter: apptainer cannot start a container on this node"
    assert "max_user_namespaces" in mode["fix"]
    assert checks["user namespaces"]["status"] == "FAIL" and checks["fakeroot builds"]["status"] == "WARN"
    assert "build on another node" in checks["fakeroot builds"]["fix"]

    src = _tasks(shared_dir / "t")
    run = _in_no_userns(shared_dir, sys.executable, "-m", "et_hpc.cli", "run", str(src), "--run-name", "nons", "--policy", "oracle")
    assert run.returncode == 2, run.stderr
    errors = [ln for ln in run.stderr.splitlines() if ln.startswith("et-hpc: error:")]
    assert len(errors) == 1 and "apptainer cannot start a container on this node" in errors[0], run.stderr
    assert "Traceback" not in run.stderr
