"""Memory an instance holds that no process's RSS shows, measured from the host.

``TmpfsProbe`` runs a small host-Python helper inside the instance's user, mount and IPC
namespaces that reports (and can free) what its tmpfs mounts and unattached SysV segments use;
``nested_tmpfs`` and ``held_files`` find tmpfs in nested mount namespaces and memfd or tmpfs
files only open fds keep. ``Sample`` is one poll of all of it. Nothing here raises: what cannot
be read counts as nothing (a probe that cannot start says why in ``error``). What is counted and
why: docs/sandbox.md.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from stat import S_ISREG as stat_is_reg
from typing import Any

from et_hpc.host import procfs

# Runs as a separate host process: enters the instance's user and mount namespaces, then answers
# one JSON line per request line: "s" -> {"used": {mountpoint: bytes}}, "e PATH" -> {"freed": bytes}.
_HELPER = r"""
import ctypes, json, os, shutil, sys
pid = int(sys.argv[1])
def unescape(p):
    return p.encode().decode("unicode_escape")
def tmpfs(path):
    out = {}
    with open(path) as f:
        for line in f:
            a, _, b = line.partition(" - ")
            fs = b.split()
            if fs and fs[0] == "tmpfs":
                p = a.split()
                out.setdefault(p[2], unescape(p[4]))
    return out
mine = tmpfs("/proc/%d/mountinfo" % pid)
host = tmpfs("/proc/self/mountinfo")
mounts = sorted(mp for dev, mp in mine.items() if dev not in host)
devs = sorted(dev for dev in mine if dev not in host)
proc = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY)  # the host's, kept across setns
libc = ctypes.CDLL(None, use_errno=True)
fds = [os.open("/proc/%d/ns/%s" % (pid, n), os.O_RDONLY) for n in ("user", "mnt")]
try:  # the instance's SysV IPC namespace, for its shared memory segments (opened while /proc is the host's)
    ipc = os.open("/proc/%d/ns/ipc" % pid, os.O_RDONLY)
except OSError:
    ipc = None
for fd, flag in zip(fds, (0x10000000, 0x00020000)):
    if libc.setns(fd, flag) != 0:
        sys.stdout.write(json.dumps({"error": "setns: " + os.strerror(ctypes.get_errno())}) + "\n")
        sys.exit(0)
    os.close(fd)
if ipc is not None:
    libc.setns(ipc, 0x08000000)
    os.close(ipc)
sys.stdout.write(json.dumps({"mounts": mounts, "devs": devs}) + "\n")
sys.stdout.flush()
def used(mp):
    st = os.statvfs(mp)
    return (st.f_blocks - st.f_bfree) * st.f_frsize
def nested(p, mp):
    fd = os.open("%d/root%s" % (p, mp), os.O_RDONLY | os.O_DIRECTORY, dir_fd=proc)
    try:
        st = os.fstatvfs(fd)
    finally:
        os.close(fd)
    return (st.f_blocks - st.f_bfree) * st.f_frsize
def sysv(remove=False):
    total = 0
    try:
        with open("/proc/sysvipc/shm") as f:
            head = f.readline().split()
            for line in f:
                v = dict(zip(head, line.split()))
                if v.get("nattch") == "0":
                    if remove and libc.shmctl(int(v["shmid"]), 0, None) != 0:  # IPC_RMID
                        continue
                    total += int(v.get("rss") or v.get("size") or 0)
    except (OSError, ValueError, KeyError):
        pass
    return total
for line in sys.stdin:
    cmd = line.rstrip("\n")
    res = {}
    try:
        if cmd == "s":
            res["used"] = {mp: used(mp) for mp in mounts}
            res["sysv"] = sysv()
        elif cmd == "r":
            res["freed"] = sysv(remove=True)
        elif cmd.startswith("n "):
            p, _, mp = cmd[2:].partition(" ")
            res["used"] = nested(int(p), bytes.fromhex(mp).decode("utf-8", "surrogateescape"))
        elif cmd.startswith("e ") and cmd[2:] in mounts:
            mp = cmd[2:]
            before = used(mp)
            for n in os.listdir(mp):
                p = os.path.join(mp, n)
                if os.path.isdir(p) and not os.path.islink(p):
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    try:
                        os.unlink(p)
                    except OSError:
                        pass
            res["freed"] = before - used(mp)
        else:
            res["error"] = "bad request"
    except (OSError, ValueError) as e:
        res["error"] = str(e)
    sys.stdout.write(json.dumps(res) + "\n")
    sys.stdout.flush()
"""


class TmpfsProbe:
    """The helper process that measures (and can empty) the instance's tmpfs mounts."""

    def __init__(self, init_pid: int) -> None:
        self.mounts: list[str] = []
        self.devs: set[str] = set()  # "major:minor" of those mounts
        self.sysv = 0  # bytes of SysV shared memory no process has attached (last ``used``)
        self.error: str | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _HELPER, str(init_pid)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                close_fds=True,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            )
            first = self._ask(None)
        except OSError as e:
            first = {"error": str(e)}
        if "error" in first:
            self.error = str(first["error"])
            self.close()
        else:
            self.mounts = list(first.get("mounts") or [])
            self.devs = set(first.get("devs") or [])

    def _ask(self, line: str | None) -> dict[str, Any]:
        with self._lock:  # one request and its reply at a time (the poll thread and a caller's sample())
            return self._ask_locked(line)

    def _ask_locked(self, line: str | None) -> dict[str, Any]:
        proc = self._proc
        if proc is None or proc.stdin is None or proc.stdout is None:
            return {"error": "no helper"}
        try:
            if line is not None:
                proc.stdin.write(line + "\n")
                proc.stdin.flush()
            reply = proc.stdout.readline()
        except (OSError, ValueError) as e:
            return {"error": str(e)}
        if not reply:
            return {"error": "the helper exited"}
        try:
            return json.loads(reply)
        except json.JSONDecodeError:
            return {"error": f"bad reply {reply[:100]!r}"}

    @property
    def ok(self) -> bool:
        return self._proc is not None

    def used(self) -> dict[str, int]:
        res = self._ask("s")
        if "error" in res:
            self.error = str(res["error"])
            return {}
        self.sysv = int(res.get("sysv") or 0)
        return {k: int(v) for k, v in (res.get("used") or {}).items()}

    def nested(self, pid: int, mountpoint: str) -> int | None:
        """Bytes used on the tmpfs mounted at ``mountpoint`` in host pid ``pid``'s mount namespace."""
        res = self._ask(f"n {pid} {mountpoint.encode('utf-8', 'surrogateescape').hex()}")
        return None if "error" in res else int(res.get("used") or 0)

    def remove_sysv(self) -> int:
        """Remove the SysV shared memory segments no process has attached; returns bytes freed."""
        return int(self._ask("r").get("freed") or 0)

    def empty(self, mountpoint: str) -> int:
        if mountpoint not in self.mounts:
            return 0
        return int(self._ask(f"e {mountpoint}").get("freed") or 0)

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.stdin:
                proc.stdin.close()
            proc.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()


@dataclass
class Sample:
    """One poll: the instance's processes, their memory, its tmpfs usage and memory held elsewhere."""

    pids: list[int]
    proc_kb: int
    tmpfs: dict[str, int] = field(default_factory=dict)  # mountpoint -> bytes used
    held: int = 0  # bytes of memfd and tmpfs files only open fds keep (no counted mount has them)
    sysv: int = 0  # bytes of SysV shared memory segments no process has attached

    @property
    def tmpfs_kb(self) -> int:
        return sum(self.tmpfs.values()) // 1024

    @property
    def other_kb(self) -> int:
        return (self.held + self.sysv) // 1024

    @property
    def total_kb(self) -> int:
        return self.proc_kb + self.tmpfs_kb + self.other_kb


def _unescape_mount(path: str) -> str:
    """A mountinfo path with its octal escapes (``\\040`` for a space) undone."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def _mountinfo(pid: int) -> dict[int, tuple[str, str, str]] | None:
    """mount id -> (major:minor, mountpoint, fstype) of ``pid``'s mount namespace."""
    out = {}
    try:
        with open(f"/proc/{pid}/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                a, _, b = line.partition(" - ")
                p, fs = a.split(), b.split()
                if len(p) >= 5 and fs:
                    out[int(p[0])] = (p[2], _unescape_mount(p[4]), fs[0])
    except (OSError, ValueError):
        return None
    return out


def _fd_mount_id(pid: int, fd: str) -> int | None:
    return procfs.field(f"/proc/{pid}/fdinfo/{fd}", b"mnt_id:")


def _dev(st: os.stat_result) -> str:
    return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def _maps_any(pid: int, files: dict[tuple[int, int], int]) -> bool:
    """``pid`` maps one of ``files`` ((st_dev, inode) keys)."""
    want = {(f"{os.major(d):02x}:{os.minor(d):02x}".encode(), str(i).encode()) for d, i in files}
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:  # bytes: mapped file names are the agent's
            for line in f:
                p = line.split(maxsplit=5)
                if len(p) >= 5 and (p[3], p[4]) in want:
                    return True
    except OSError:
        pass
    return False


def _pss_shmem_kb(pid: int) -> int:
    return procfs.field(f"/proc/{pid}/smaps_rollup", b"Pss_Shmem:") or 0


def host_tmpfs_devs() -> set[str]:
    return {dev for dev, _mp, fs in (_mountinfo(os.getpid()) or {}).values() if fs == "tmpfs"}


def nested_tmpfs(probe: TmpfsProbe, own_mnt: str | None, pids: list[int], counted: set[str]) -> dict[str, int]:
    """Bytes used on tmpfs mounts made in mount namespaces of the instance's processes other
    than the instance's own (``own_mnt``) (``unshare -rm`` then ``mount -t tmpfs``); ``counted`` (devices
    already measured) grows by the ones measured here."""
    out: dict[str, int] = {}
    seen = {own_mnt}
    for pid in pids:
        try:
            mnt = os.readlink(f"/proc/{pid}/ns/mnt")
        except OSError:
            continue
        if mnt in seen:
            continue
        seen.add(mnt)
        for dev, mp, fstype in (_mountinfo(pid) or {}).values():
            if fstype != "tmpfs" or dev in counted:
                continue
            used = probe.nested(pid, mp)
            if used is not None:
                counted.add(dev)
                out[f"{mp} (nested mount namespace of pid {pid})"] = used
    return out


def _open_file(pid: int, fd: str) -> tuple[str, os.stat_result] | None:
    """The path and stat of a regular file behind ``pid``'s ``fd`` (not /dev, /proc), or None."""
    try:
        link = os.readlink(f"/proc/{pid}/fd/{fd}")
        if not link.startswith("/") or link.startswith(("/dev/null", "/dev/pts/", "/proc/")):
            return None
        st = os.stat(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return None
    return (link, st) if stat_is_reg(st.st_mode) else None


def _on_tmpfs(pid: int, fd: str, st: os.stat_result, mounts: dict[int, dict[int, tuple[str, str, str]] | None]) -> bool:
    """The file behind ``fd`` is on a tmpfs, or on a mount no namespace shows any more (a tmpfs
    whose namespace is gone lives on while a file of it is open); ``mounts`` caches mountinfo."""
    if pid not in mounts:
        mounts[pid] = _mountinfo(pid)
    mid = _fd_mount_id(pid, fd)
    entry = (mounts[pid] or {}).get(mid) if mid is not None else None
    if entry is not None:
        return entry[2] == "tmpfs"
    return os.major(st.st_dev) == 0


def held_files(pids: list[int], counted: set[str]) -> tuple[int, int]:
    """Bytes of memfd and tmpfs files that open fds keep and no measured mount counts (an
    unlinked /dev/shm file counts there; a memfd or a file of an unmounted tmpfs nowhere
    else), each file once; and the KiB of shared memory that processes mapping such files
    show in their PSS (taken off theirs so it is not counted twice)."""
    files: dict[tuple[int, int], int] = {}
    mounts: dict[int, dict[int, tuple[str, str, str]] | None] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            found = _open_file(pid, fd)
            if found is None:
                continue
            link, st = found
            if _dev(st) in counted or (st.st_dev, st.st_ino) in files:
                continue
            if link.startswith("/memfd:") or _on_tmpfs(pid, fd, st, mounts):
                files[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    if not files:
        return 0, 0
    shmem_kb = sum(_pss_shmem_kb(pid) for pid in pids if _maps_any(pid, files))
    return sum(files.values()), shmem_kb
