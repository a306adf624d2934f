"""The NFS-safe build lock: mutual exclusion across processes, takeover of dead or stalled holders."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from et_hpc.images.lock import BuildLock, LockInfo, LockTimeout


def _hold_and_count(lock_path: str, log_path: str, hold: float) -> None:
    with BuildLock(Path(lock_path), stale_after=30, poll=0.05):
        with open(log_path, "a") as f:
            f.write(f"in {os.getpid()}\n")
            f.flush()
        time.sleep(hold)
        with open(log_path, "a") as f:
            f.write(f"out {os.getpid()}\n")


def _holders_take_turns(lock: Path, log: Path, *, n: int, hold_s: float) -> None:
    """Start n processes that each take the lock once; never two holders at once."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_hold_and_count, args=(str(lock), str(log), hold_s)) for _ in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    lines = [ln.split() for ln in log.read_text().splitlines()]
    assert len(lines) == 2 * n
    # Every "in" is followed by the same process's "out".
    for enter, leave in zip(lines[0::2], lines[1::2]):
        assert enter[0] == "in" and leave[0] == "out" and enter[1] == leave[1]


def test_processes_take_turns(tmp_path: Path) -> None:
    lock = tmp_path / "locks" / "k.lock"
    _holders_take_turns(lock, tmp_path / "log", n=6, hold_s=0.2)
    assert not lock.exists()
    assert not [p for p in lock.parent.iterdir()], "no lock or temp files left behind"


def test_dead_holder_is_taken_over_at_once(tmp_path: Path) -> None:
    lock = tmp_path / "k.lock"
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from pathlib import Path; from et_hpc.images.lock import BuildLock\n"
                f"l = BuildLock(Path({str(lock)!r}), stale_after=3600); l.acquire(); print('held', flush=True); time.sleep(600)"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "held"
    child.kill()
    child.wait()
    info, _ = LockInfo.read(lock)
    assert info is not None and info.pid == child.pid
    t0 = time.monotonic()
    with BuildLock(lock, stale_after=3600, poll=0.05, timeout=30) as mine:
        assert mine.still_held()
        assert LockInfo.read(lock)[0].pid == os.getpid()
    assert time.monotonic() - t0 < 30  # bound only: the stale timeout (an hour) was not needed


def test_silent_holder_on_another_host_goes_stale(tmp_path: Path) -> None:
    lock = tmp_path / "k.lock"
    lock.write_text(json.dumps({"host": "some-other-node", "pid": 1, "pid_start": None, "token": "t0", "taken_at": time.time()}))
    waits: list[float] = []
    with BuildLock(lock, stale_after=1.5, poll=0.1, timeout=60, on_wait=lambda i, w: waits.append(w)) as mine:
        assert mine.still_held()
        assert mine.waited >= 1.5  # it did wait for the stale timeout, not less


def test_live_holder_with_heartbeat_is_not_taken_over(tmp_path: Path) -> None:
    lock = tmp_path / "k.lock"
    holder = BuildLock(lock, stale_after=1.0, poll=0.05)
    holder.acquire()
    try:
        # Pretend the holder lives on another host so only the heartbeat protects it.
        d = json.loads(lock.read_text())
        d["host"] = "some-other-node"
        lock.write_text(json.dumps(d))
        with pytest.raises(LockTimeout):
            BuildLock(lock, stale_after=1.0, poll=0.05, timeout=3.0).acquire()
        assert holder.still_held()
        assert not holder.lost
    finally:
        holder.release()
    assert not lock.exists()


def test_takeover_race_has_one_winner(tmp_path: Path) -> None:
    lock = tmp_path / "k.lock"
    lock.write_text(
        json.dumps({"host": socket.gethostname(), "pid": 2**22 + 12345, "pid_start": None, "token": "dead", "taken_at": time.time()})
    )
    _holders_take_turns(lock, tmp_path / "log", n=5, hold_s=0.3)
