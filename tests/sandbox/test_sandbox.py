"""Sandbox on real apptainer: lifecycle, overlay, isolation, environment, shell inside, cleanup."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from et_hpc.host import apptainer
from et_hpc.sandbox.sandbox import Sandbox, new_instance_name
from helpers import processes_naming


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    d = tmp_path / "scratch"
    d.mkdir()
    return d


def _instances() -> set[str]:
    return {i.name for i in apptainer.instance_list()}


def test_instance_name_shape_and_limit() -> None:
    n = new_instance_name("x" * 300 + "/bad name")
    assert len(n) <= apptainer.NAME_MAX
    assert all(c.isalnum() or c in "._-" for c in n)
    assert n.split("-")[-2] == str(os.getpid())
    assert new_instance_name("run") != new_instance_name("run")


@pytest.mark.apptainer
def test_lifecycle_overlay_registry_and_cleanup(base_sif: Path, scratch: Path) -> None:
    sb = Sandbox(base_sif, run_prefix="t-life", scratch=scratch)
    with sb:
        assert sb.name in _instances()
        assert sb.overlay and sb.overlay.exists()
        reg = json.loads((scratch / "live" / f"{sb.name}.json").read_text())
        assert reg["pid"] == os.getpid() and reg["overlay"] == str(sb.overlay)
        # the overlay is sparse: far less disk than its size
        assert sb.overlay.stat().st_blocks * 512 < sb.overlay.stat().st_size / 4
        cp = sb.exec(["sh", "-c", "echo hi > /opt/written && cat /opt/written && id -u"])
        assert cp.returncode == 0 and cp.stdout.decode().split() == ["hi", str(os.getuid())]
        big = sb.exec(["sh", "-c", "head -c 100000000 /dev/zero > /home/user/big && du -m /home/user/big"])
        assert big.returncode == 0, big.stdout  # beyond the 64 MiB writable-tmpfs cap
        overlay, name = sb.overlay, sb.name
    assert name not in _instances()
    assert not overlay.exists()
    assert not list((scratch / "live").iterdir())
    sb.stop()  # twice is fine


@pytest.mark.apptainer
@pytest.mark.parametrize("init_known", [True, False], ids=["kill-init", "apptainer-stop"])
def test_stop_leaves_no_process_or_state(base_sif: Path, scratch: Path, init_known: bool) -> None:
    """stop() kills the instance's init from the host; when the recorded init is not the process
    at that pid any more it leaves the stop to apptainer. Either way nothing of the instance stays."""
    sb = Sandbox(base_sif, run_prefix="t-stop", scratch=scratch).start()
    sb.shell().run("sleep 300 &")
    name = sb.name
    assert name in _instances() and processes_naming(name)  # positive control: there is something to stop
    if not init_known:
        pid, _ = sb.init_process()
        sb._init = (pid, "1")  # a start time no live process has: the pid counts as reused
    sb.stop()
    assert sb.stopped_by == ("kill" if init_known else "apptainer")
    assert name not in _instances() and not apptainer.instance_files(name)
    end = time.monotonic() + 5
    while processes_naming(name) and time.monotonic() < end:
        time.sleep(0.05)
    assert not processes_naming(name), "processes of the stopped instance are left"
    assert not list((scratch / "live").iterdir()) and not list((scratch / "overlays").iterdir())


@pytest.mark.apptainer
def test_writable_tmpfs_mode(base_sif: Path, scratch: Path) -> None:
    with Sandbox(base_sif, run_prefix="t-tmpfs", writable_tmpfs=True, scratch=scratch) as sb:
        assert sb.overlay is None
        cp = sb.exec(["sh", "-c", "echo ok > /home/user/f && cat /home/user/f"])
        assert cp.stdout == b"ok\n"


@pytest.mark.apptainer
def test_host_environment_does_not_leak(base_sif: Path, scratch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-should-not-leak")
    monkeypatch.setenv("APPTAINERENV_INJECTED", "sk-injected")
    monkeypatch.setenv("SINGULARITYENV_INJECTED2", "sk-injected2")
    with Sandbox(base_sif, run_prefix="t-env", scratch=scratch) as sb:
        env = sb.exec(["env"]).stdout.decode()
        assert "sk-" not in env and "OPENAI" not in env
        sh = sb.shell()
        r = sh.run("env; cat /proc/1/environ | tr '\\0' '\\n'")
        assert r.exit_code == 0 and "sk-" not in r.output
        assert "HOME=/home/user" in r.output


@pytest.mark.apptainer
def test_network_none_by_default(base_sif: Path, scratch: Path) -> None:
    with Sandbox(base_sif, run_prefix="t-net", scratch=scratch) as sb:
        assert sb.network_isolated
        ifaces = sb.exec(["sh", "-c", "tail -n +3 /proc/net/dev | cut -d: -f1"]).stdout.decode().split()
        assert ifaces == ["lo"]
    with Sandbox(base_sif, run_prefix="t-net", network_none=False, scratch=scratch) as sb:
        ifaces = sb.exec(["sh", "-c", "tail -n +3 /proc/net/dev | cut -d: -f1"]).stdout.decode().split()
        assert len(ifaces) > 1


@pytest.mark.apptainer
def test_shell_in_instance(base_sif: Path, scratch: Path) -> None:
    with Sandbox(base_sif, run_prefix="t-shell", scratch=scratch) as sb:
        sh = sb.shell()
        r = sh.run("pwd; echo $HOME; cd /tmp; export A=1")
        assert r.output == "/home/user\n/home/user\n" and r.exit_code == 0
        assert sh.run("pwd; echo $A").output == "/tmp\n1\n"
        sh.run("sleep 100 &")
        t = sh.run("sleep 60", timeout=1)
        assert t.timed_out and not t.shell_restarted
        left = sh.run("ps -eo args 2>/dev/null || cat /proc/[0-9]*/cmdline | tr '\\0' ' '").output
        assert "sleep 100" in left and "sleep 60" not in left
        assert sh.run("ulimit -u").output.strip() == "512"
        d = sh.run("exit")
        assert d.shell_restarted
        assert sh.run("echo back").output == "back\n"


@pytest.mark.apptainer
def test_a_closed_idle_shell_ends_on_its_own(base_sif: Path, scratch: Path) -> None:
    """Closing an idle shell lets bash end on EOF, so apptainer's exec process reaps it (both killed
    at once, bash would be left for the host's init to reap, which delays the instance's stop)."""
    with Sandbox(base_sif, run_prefix="t-shell", scratch=scratch, warm_scoring=False) as sb:
        for _ in range(8):  # killing at once loses the race to bash's own exit about 1 time in 4
            idle = sb.shell()
            assert idle.run("true").exit_code == 0 and idle.host_pid
            bash = idle.host_pid
            idle.close()
            assert idle.exit_status == 0  # ended, not killed (that would be -9)
            assert not Path(f"/proc/{bash}").exists()  # and reaped
        busy = sb.shell()
        busy.run("sleep 100 &")
        ps = ["sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"]
        assert b"sleep 100" in sb.exec(ps).stdout
        busy.close()  # a job still running: its session is killed
        assert b"sleep 100" not in sb.exec(ps).stdout


def test_exec_timeout_kills_inside(base_sif: Path, scratch: Path) -> None:
    with Sandbox(base_sif, run_prefix="t-exec", scratch=scratch) as sb:
        with pytest.raises(subprocess.TimeoutExpired):
            sb.exec(["sh", "-c", "sleep 77.5"], timeout=1)
        procs = sb.exec(["sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"]).stdout.decode()
        assert "77.5" not in procs


@pytest.mark.apptainer
def test_user_mapping_makes_home_files_users(tmp_path: Path, base_sif: Path, scratch: Path) -> None:
    """A def that does `useradd user; chown user:user`: the agent's uid is `user` inside."""
    d = tmp_path / "img"
    d.mkdir()
    (d / "t.def").write_text(
        textwrap.dedent(f"""\
        Bootstrap: localimage
        From: {base_sif}
        %post
            useradd -m -s /bin/bash user 2>/dev/null || true
            mkdir -p /home/user/proj && echo v1 > /home/user/proj/f.txt
            chown -R user:user /home/user && chmod 664 /home/user/proj/f.txt
        """)
    )
    sif = d / "t.sif"
    cp = subprocess.run(["apptainer", "-s", "build", "--fakeroot", str(sif), str(d / "t.def")], capture_output=True, text=True, cwd=d)
    assert cp.returncode == 0, cp.stderr[-2000:]
    with Sandbox(sif, run_prefix="t-uid", scratch=scratch) as sb:
        sh = sb.shell()
        r = sh.run("echo v2 >> proj/f.txt && touch proj/new && stat -c '%U:%G %a' proj/f.txt proj/new; id -un")
        assert r.exit_code == 0, r.output
        assert r.output.splitlines() == ["user:user 664", "user:user 644", "user"]


_WORKER = textwrap.dedent("""\
    import sys, time
    from pathlib import Path
    from et_hpc.sandbox.sandbox import Sandbox
    sb = Sandbox(Path(sys.argv[1]), run_prefix="t-sig", scratch=Path(sys.argv[2]))
    sb.start()
    print(sb.name, sb.overlay, flush=True)
    time.sleep(120)
    """)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR2])
@pytest.mark.apptainer
def test_signal_stops_live_sandboxes(base_sif: Path, scratch: Path, sig: int) -> None:
    p = subprocess.Popen([sys.executable, "-c", _WORKER, str(base_sif), str(scratch)], stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline().split()
        assert len(line) == 2, "worker did not start a sandbox"
        name, overlay = line
        assert name in _instances()
        p.send_signal(sig)
        rc = p.wait(timeout=60)
        assert rc != 0
    finally:
        if p.poll() is None:
            p.kill()
    assert name not in _instances()
    assert not Path(overlay).exists()
    assert not list((scratch / "live").iterdir())


def test_missing_image_is_an_infra_error(scratch: Path, tmp_path: Path) -> None:
    from et_hpc.errors import InfraError

    with pytest.raises(InfraError, match="does not exist"):
        Sandbox(tmp_path / "nope.sif", scratch=scratch).start()


@pytest.mark.apptainer
def test_start_stop_timings_recorded(base_sif: Path, scratch: Path) -> None:
    t0 = time.monotonic()
    with Sandbox(base_sif, run_prefix="t-time", scratch=scratch) as sb:
        pass
    assert {"overlay_s", "start_s", "stop_s"} <= set(sb.timings)
    assert sb.timings["start_s"] + sb.timings["stop_s"] <= time.monotonic() - t0 + 0.01
