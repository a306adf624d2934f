"""``et-hpc model serve`` takes its server with it: SIGTERM is passed on to llama-server and waited for,
and a SIGKILLed parent leaves no server (the server's parent-death signal). Real processes throughout:
the positive control shows, before the kill, that the server is the command's own child and answers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from helpers import need

ET_HPC = [sys.executable, "-m", "et_hpc.cli"]


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for a reaper)."""
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _serve(tmp: Path) -> tuple[subprocess.Popen, int, str]:
    """Start the command; return it, its server's pid and the server's /health URL (after the control)."""
    ep = tmp / "ep" / "endpoint.json"
    p = subprocess.Popen(
        [*ET_HPC, "model", "serve", "--endpoint-file", str(ep), "--parallel", "1", "--ctx-size", "1024"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 180
    while not ep.exists():
        assert p.poll() is None, p.stdout.read()
        assert time.monotonic() < deadline, "no endpoint file"
        time.sleep(0.2)
    rec = json.loads(ep.read_text())
    health = f"http://127.0.0.1:{rec['port']}/health"
    kids = _children(p.pid)
    # positive control: the server is the command's own child (not a wrapper's), alive and answering
    assert len(kids) == 1, kids
    assert Path(os.readlink(f"/proc/{kids[0]}/exe")).name == "llama-server"
    assert _alive(kids[0]) and _answers(health)
    return p, kids[0], health


def _gone(pid: int, health: str) -> bool:
    deadline = time.monotonic() + 60
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not _alive(pid) and not _answers(health)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_serve_stops_its_server(tmp_path, sig):
    need("model")
    p, server, health = _serve(tmp_path)
    p.send_signal(sig)
    out = p.communicate(timeout=120)[0]
    assert p.returncode == 0, out
    assert _gone(server, health)
    assert not (tmp_path / "ep" / "endpoint.json").exists()


def test_sigkilled_serve_leaves_no_server(tmp_path):
    need("model")
    p, server, health = _serve(tmp_path)
    try:
        p.kill()  # SIGKILL: the command can do nothing about it
        p.wait(timeout=30)
        assert _gone(server, health)
    finally:
        if _alive(server):
            os.kill(server, signal.SIGKILL)
