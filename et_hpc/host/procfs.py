"""Host-side ``/proc`` reading (sandboxes, the build lock): one place for every ``/proc`` parser et-hpc uses.

Everything reads the host's ``/proc`` directly (an instance's processes are ordinary host
processes of the same user), spawns nothing, and never raises for a process that vanished in
between: it is left out (``None`` / skipped). Offers a process's ``stat``, ``ns_ids``,
``start_time`` (to tell a reused pid), ``pid_alive``; sessions (``session_members``); PID
namespaces (``pid_ns``, ``ns_members``, ``instance_pids``, ``instance_processes``: an instance's
processes with nested namespaces); memory (``memory_kb``: PSS, else RSS; ``field`` for one keyed
number of a /proc file); ``with_argument`` (pids by one command-line element).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

_PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024


def _pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, pgid, session) of a live host pid, or None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2 :].split()
    if fields[:1] in ([b"Z"], [b"X"]):
        return None
    try:
        return int(fields[1]), int(fields[2]), int(fields[3])
    except (IndexError, ValueError):
        return None


def ns_ids(pid: int) -> tuple[int | None, int | None]:
    """(pid, pgid) of a host pid as seen in its innermost PID namespace."""
    ns_pid = ns_pgid = None
    try:
        with open(f"/proc/{pid}/status", "rb") as f:  # bytes: its Name: line is the process's choice
            for line in f:
                if line.startswith(b"NSpid:"):
                    ns_pid = int(line.split()[-1])
                elif line.startswith(b"NSpgid:"):
                    ns_pgid = int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return ns_pid, ns_pgid


def session_members(sid: int) -> list[tuple[int, int]]:
    """(pid, pgid) of every live process in session ``sid``."""
    out = []
    for pid in _pids():
        st = stat(pid)
        if st and st[2] == sid:
            out.append((pid, st[1]))
    return out


def start_time(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot (field 22 of /proc/PID/stat), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        return data[data.rfind(b")") + 2 :].split()[19].decode()
    except IndexError:
        return None


def pid_alive(pid: int, start: str | None = None) -> bool:
    """The process exists and is not a zombie (a pid of another user counts as alive); with
    ``start`` (a ``start_time`` taken earlier) a pid now held by another process counts as gone."""
    if start is not None:
        now = start_time(pid)
        if now is not None and now != start:
            return False  # pid reused by another process
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return data[data.rfind(b")") + 2 :][:1] not in (b"Z", b"X")
    except OSError:
        return True


def pid_ns(pid: int) -> str | None:
    """``readlink /proc/PID/ns/pid`` (e.g. ``pid:[4026532253]``), None when unreadable."""
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def ns_members(ns: str, exclude: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """Live (non-zombie) host pids whose PID namespace is ``ns``, minus ``exclude``."""
    out = []
    for pid in _pids():
        if pid in exclude:
            continue
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") != ns:
                continue
        except OSError:
            continue
        if stat(pid) is not None:
            out.append(pid)
    return out


def descendants(roots: set[int]) -> set[int]:
    """``roots`` and every process below them, walking ``/proc/X/task/*/children`` (a process
    forked during the walk may be missed: the next walk finds it)."""
    found, todo = set(roots), list(roots)
    while todo:
        pid = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            todo += [k for k in kids if k not in found]
            found.update(kids)
    return found


def instance_pids(ns: str) -> set[int]:
    """Host pids of the instance's processes: those whose PID namespace is ``ns`` and every
    descendant of them. A process in a nested PID namespace is a child of one of the instance's,
    and when its parent dies it is reaped by an init that is one too; so the walk down
    ``/proc/X/task/*/children`` from the namespace's members finds them all (a process forked
    during the walk may be missed: it is found by the next one)."""
    found: set[int] = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.readlink(f"/proc/{name}/ns/pid") == ns:
                    found.add(int(name))
            except OSError:
                continue
    return descendants(found)


def instance_processes(ns: str, exclude: set[int] | frozenset[int] = frozenset()) -> dict[int, tuple[int, str]]:
    """The instance's live processes (``instance_pids``) but ``exclude``: host pid -> (parent
    pid, start time); zombies left out."""
    out: dict[int, tuple[int, str]] = {}
    for pid in instance_pids(ns) - set(exclude):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                data = f.read()
            fields = data[data.rfind(b")") + 2 :].split()
            if fields[0] in (b"Z", b"X"):
                continue
            out[pid] = (int(fields[1]), fields[19].decode())
        except (OSError, IndexError, ValueError):
            continue
    return out


def field(path: str, key: bytes) -> int | None:
    """The number after ``key`` (e.g. ``b"Pss:"``) on its line of the /proc file ``path``; None
    when the file or the line is missing or unreadable."""
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def memory_kb(pid: int) -> int:
    """Proportional set size (``smaps_rollup`` Pss) in KiB; RSS from ``statm`` when that is not
    readable; 0 when the process is gone."""
    pss = field(f"/proc/{pid}/smaps_rollup", b"Pss:")
    if pss is not None:
        return pss
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_KB
    except (OSError, ValueError, IndexError):
        return 0


def _cmdlines() -> Iterator[tuple[int, bytes]]:
    """(pid, raw command line) of each live (non-zombie) host process that can be read."""
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if stat(pid) is not None:
            yield pid, cmdline


def with_argument(arg: str) -> list[int]:
    """Live (non-zombie) host pids whose command line has ``arg`` as one of its elements (e.g. an
    ``apptainer instance start ... NAME`` still running for an instance name)."""
    want = arg.encode()
    return [pid for pid, cmdline in _cmdlines() if want in cmdline.split(b"\0")]


def naming(text: str) -> list[int]:
    """Live (non-zombie) host pids whose command line contains ``text`` anywhere (an instance's
    own processes show ``[NAME]`` in theirs)."""
    want = text.encode()
    return [pid for pid, cmdline in _cmdlines() if want in cmdline]
