"""Reaper: workers SIGKILLed mid-episode leave instances and overlays; reap() removes them all."""

from __future__ import annotations

import getpass
import json
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from et_hpc.host import apptainer
from et_hpc.sandbox.reaper import reap

pytestmark = pytest.mark.apptainer

WORKER = textwrap.dedent("""\
    import sys
    from pathlib import Path
    from et_hpc.sandbox.sandbox import Sandbox
    sif, scratch, n = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    for i in range(n):
        with Sandbox(sif, run_prefix="t-reap", scratch=scratch) as sb:
            sb.shell().run("echo hi > /home/user/f")
        print("done", flush=True)
    """)


def _ours() -> set[str]:
    return {i.name for i in apptainer.instance_list() if i.name.startswith("t-reap-")}


def test_reap_after_random_sigkills(base_sif: Path, tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    rng = random.Random(1234)
    done = kills = 0
    before = _ours()
    while done < 50:
        p = subprocess.Popen([sys.executable, "-c", WORKER, str(base_sif), str(scratch), str(50 - done)], stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + rng.uniform(0.3, 4.0)
        os.set_blocking(p.stdout.fileno(), False)
        while time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.05)
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            kills += 1
        p.wait()
        done += (p.stdout.read() or "").count("done")
    assert kills >= 5
    leftovers = list((scratch / "overlays").glob("*.img")) + list((scratch / "live").glob("*.json"))
    dry = reap(scratch=scratch, dry_run=True)
    assert dry.dry_run and not dry.errors
    rep = reap(scratch=scratch)
    assert not rep.errors, rep.errors
    assert set(rep.stopped) == set(dry.stopped)
    assert _ours() - before == set(), f"instances left after reaping: {rep}"
    assert not list((scratch / "overlays").glob("*.img"))
    assert not list((scratch / "live").glob("*.json"))
    assert len(rep.deleted) >= len(leftovers)
    again = reap(scratch=scratch)
    assert not again.stopped and not again.deleted


def _start_in_flight(scratch: Path) -> str | None:
    """The name of a sandbox of ``scratch`` whose `apptainer instance start` runs now and has
    started the instance's own processes (its overlay is in use)."""
    from et_hpc.host import procfs
    from helpers import processes_naming

    for reg in (scratch / "live").glob("*.json"):
        if procfs.with_argument(reg.stem) and processes_naming(f"[{reg.stem}]"):
            return reg.stem
    return None


def _worker_stopped_mid_start(sif: Path, scratch: Path, sig: int) -> str:
    """Start a worker, send it ``sig`` while its first `apptainer instance start` runs; the name."""
    from helpers import until

    p = subprocess.Popen([sys.executable, "-c", WORKER, str(sif), str(scratch), "1"], stdout=subprocess.DEVNULL)
    try:
        name = until("an instance start in flight", lambda: _start_in_flight(scratch), 60, 0.005)
        p.send_signal(sig)
        assert p.wait(timeout=200) == -sig
    finally:
        if p.poll() is None:
            p.kill()
    return name


def test_reap_waits_for_a_start_its_dead_owner_left_running(base_sif: Path, tmp_path: Path) -> None:
    """SIGKILL of a worker leaves its `apptainer instance start` running: the instance appears after
    the worker is gone. Reaping at that moment must still leave no instance and no files."""
    from et_hpc.host import procfs
    from helpers import until

    scratch = tmp_path / "scratch"
    name = _worker_stopped_mid_start(base_sif, scratch, signal.SIGKILL)
    # positive control: the worker is dead, its start is not, and the instance is not there yet
    assert procfs.with_argument(name), "the start ended with its worker: nothing to test"
    assert name not in _ours()
    rep = reap(scratch=scratch)
    assert not rep.errors, rep.errors
    until("the start to end", lambda: not procfs.with_argument(name), 150, 0.05)
    assert name not in _ours(), "the instance started after reaping and was left"
    assert not list((scratch / "overlays").glob("*.img"))
    assert not list((scratch / "live").glob("*.json"))


def test_sigterm_mid_start_leaves_nothing(base_sif: Path, tmp_path: Path) -> None:
    """SIGTERM while the sandbox starts: the worker's own handler waits for the start, stops the
    instance and deletes its files before it dies; nothing is left for a reaper."""
    from et_hpc.host import procfs
    from helpers import until

    scratch = tmp_path / "scratch"
    name = _worker_stopped_mid_start(base_sif, scratch, signal.SIGTERM)
    until("the start to end", lambda: not procfs.with_argument(name), 150, 0.05)
    assert name not in _ours(), "the instance started after its worker stopped it and was left"
    assert not list((scratch / "overlays").glob("*.img"))
    assert not list((scratch / "live").glob("*.json"))


def test_reap_keeps_live_owners(base_sif: Path, tmp_path: Path) -> None:
    from et_hpc.sandbox.sandbox import Sandbox

    with Sandbox(base_sif, run_prefix="t-reap", scratch=tmp_path) as sb:
        rep = reap(scratch=tmp_path)
        assert sb.name in rep.kept and sb.name not in rep.stopped
        assert sb.overlay is not None and sb.overlay.exists()


def test_reap_cli_json(tmp_path: Path) -> None:
    live = tmp_path / "live"
    live.mkdir(parents=True)
    # a registry file from a dead worker whose instance never started
    ov = tmp_path / "overlays" / "t-reap-x-999999-deadbeef.img"
    ov.parent.mkdir()
    ov.write_bytes(b"x")
    (live / "t-reap-x-999999-deadbeef.json").write_text(
        json.dumps({"name": "t-reap-x-999999-deadbeef", "pid": 2**22 + 7, "host": os.uname().nodename, "overlay": str(ov)})
    )
    cp = subprocess.run([sys.executable, "-m", "et_hpc.cli", "reap", "--json", "--scratch", str(tmp_path)], capture_output=True, text=True)
    assert cp.returncode == 0, cp.stderr
    rep = json.loads(cp.stdout)
    assert str(ov) in rep["deleted"] and not ov.exists()


def test_reap_after_sigkill_of_a_run_with_warm_sandboxes(base_sif: Path, tmp_path: Path) -> None:
    """A run SIGKILLed while it holds warm sandboxes (started ahead, not yet handed out): they are
    registered like every sandbox, so reaping removes them with the running episode's."""
    from helpers import REPO, until

    demo = REPO / "defs" / "demo"
    env = dict(os.environ, ET_HPC_SCRATCH=str(tmp_path / "scratch"))
    et_hpc = [sys.executable, "-m", "et_hpc.cli"]
    b = subprocess.run(et_hpc + ["build", str(demo)], env=env, capture_output=True, text=True, timeout=900)
    assert b.returncode == 0, b.stderr[-2000:]
    scratch = tmp_path / "scratch" / f"et-hpc-{getpass.getuser()}"
    p = subprocess.Popen(
        et_hpc
        + [
            "run",
            str(demo),
            "--policy",
            "oracle",
            "--samples",
            "3",
            "--concurrency",
            "1",
            "--store",
            str(tmp_path / "store"),
            "--run-name",
            "reapwarm",
            "--set",
            "sandbox.warm=2",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # one episode's sandbox and two warm ones, all started
        until("3 live sandboxes", lambda: len(_run_instances()) >= 3, 180, 0.1)
        p.send_signal(signal.SIGKILL)
        p.wait()
    finally:
        if p.poll() is None:
            p.kill()
    left = _run_instances()
    assert len(left) >= 3
    assert len(list((scratch / "live").glob("*.json"))) >= 3
    cp = subprocess.run(et_hpc + ["reap", "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, cp.stderr
    rep = json.loads(cp.stdout)
    assert left <= set(rep["stopped"]), (left, rep)
    assert not _run_instances()
    assert not list((scratch / "overlays").glob("*.img"))
    assert not list((scratch / "live").glob("*.json"))


def _run_instances() -> set[str]:
    return {i.name for i in apptainer.instance_list() if i.name.startswith("et-reapwarm-")}


def test_a_reused_pid_does_not_keep_a_dead_workers_sandbox(tmp_path: Path) -> None:
    """The registry names the owner by pid and start time: a live process holding that pid now
    (here: this one, with another start time) does not make the sandbox look owned."""
    from et_hpc.host import procfs
    from et_hpc.sandbox.sandbox import scratch_paths

    live, overlays, _ = scratch_paths(tmp_path)
    me = os.getpid()
    for name, start in (("t-reap-reused", "1"), ("t-reap-mine", procfs.start_time(me))):
        (overlays / f"{name}.img").write_bytes(b"")
        (live / f"{name}.json").write_text(
            json.dumps(
                {"name": name, "pid": me, "pid_start": start, "host": socket.gethostname(), "overlay": str(overlays / f"{name}.img")}
            )
        )
    rep = reap(scratch=tmp_path)
    assert rep.kept == ["t-reap-mine"], rep
    assert not (overlays / "t-reap-reused.img").exists() and not (live / "t-reap-reused.json").exists()
    assert (overlays / "t-reap-mine.img").exists() and (live / "t-reap-mine.json").exists()
