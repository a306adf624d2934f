"""End every process an instance holds but its init, from the host, before scoring enters it.

Members are found in the host's ``/proc`` only: every process in the instance's PID namespace
and all their descendants (nested PID namespaces and subreapers included). ``sweep`` repeats
until a pass finds none: a pidfd per member (checked against its start time, so a reused pid is
never signalled), ``SIGSTOP`` to all, then ``SIGKILL`` to all and a wait for their exit. Nothing
here runs inside the instance. Specification: docs/scoring.md ("The kill sweep").
"""

from __future__ import annotations

import os
import select
import signal
import time
from dataclasses import dataclass

from et_hpc.host import procfs


@dataclass
class SweepResult:
    killed: int = 0  # processes signalled (each counted once)
    rounds: int = 0
    left: int = 0  # members still alive when the deadline passed
    init_gone: bool = False  # the instance's init ended (or its pid is another process's now)


def members(init_pid: int) -> dict[int, str]:
    """pid -> start time of every live process of the instance whose init is ``init_pid``, init
    itself excluded: its PID namespace's members and all their descendants (nested namespaces),
    as the watchdog finds them (``procfs.instance_processes``)."""
    ns = procfs.pid_ns(init_pid)
    if ns is None:
        return {}
    return {pid: start for pid, (_ppid, start) in procfs.instance_processes(ns, {init_pid}).items()}


def pidfd_of(pid: int, start: str) -> int | None:
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return None
    if procfs.start_time(pid) != start:  # gone, or the pid was reused between the scan and the open
        os.close(fd)
        return None
    return fd


def pidfd_signal(fd: int, sig: int) -> None:
    try:
        signal.pidfd_send_signal(fd, sig)
    except OSError:
        pass


def sweep(init_pid: int, init_start: str, timeout_s: float = 20.0) -> SweepResult:
    """Stop and kill every process of the instance but init, until a pass finds none (or
    ``timeout_s``: ``left`` says how many remain). Never signals init, nor a pid it cannot
    tie to the process it listed."""
    res = SweepResult()
    seen: set[tuple[int, str]] = set()
    deadline = time.monotonic() + timeout_s
    while True:
        if procfs.start_time(init_pid) != init_start:
            res.init_gone = True
            return res
        found = members(init_pid)
        if not found:
            return res
        if time.monotonic() > deadline:
            res.left = len(found)
            return res
        res.rounds += 1
        fds = []
        for pid, start in found.items():
            fd = pidfd_of(pid, start)
            if fd is None:
                continue
            pidfd_signal(fd, signal.SIGSTOP)
            fds.append(fd)
            if (pid, start) not in seen:
                seen.add((pid, start))
                res.killed += 1
        try:
            for fd in fds:
                pidfd_signal(fd, signal.SIGKILL)
            wait_exited(fds, deadline)
        finally:
            for fd in fds:
                os.close(fd)


def wait_exited(fds: list[int], deadline: float) -> None:
    """Until every pidfd reports its process exited (or ``deadline``, or 2 s)."""
    end = min(deadline, time.monotonic() + 2.0)
    poll = select.poll()
    left = set(fds)
    for fd in fds:
        poll.register(fd, select.POLLIN)
    while left:
        wait_ms = max(0, int((end - time.monotonic()) * 1000))
        for fd, _ev in poll.poll(wait_ms):
            poll.unregister(fd)
            left.discard(fd)
        if time.monotonic() >= end:
            return
