"""The scoring entry helper's first part: its start time, system calls, processes and errors.

Stamps ``T_START`` before any other import (the helper's stage timings start there), then holds
what every later part uses: mount flags and ``mount``/``check`` over libc, ``STAGES`` and
``mark`` (``time.monotonic()`` per stage, sent with the result), ``Refused`` (the agent's state
cannot be scored) and ``Infra`` (a failure outside the agent's reach), ``kill_all`` for the
instance's pid namespace, ``read_small`` (a regular file only, never a FIFO), ``drop_privileges``
and the scoring rlimits (``set_limits``). Stdlib only: it runs as the first part of the helper
program (``et_hpc.scoring.enter.helper_argv``; docs/sandbox.md, "Scoring entry").
"""

from __future__ import annotations

import time

T_START = time.monotonic()  # when this helper began (stage timings, CLOCK_MONOTONIC: host-comparable)

import ctypes
import os
import signal

MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 4096, 16384, 1 << 18
PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 4, 24, 38, 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
PR_SET_PDEATHSIG = 1
STAGES: dict[str, float] = {"helper_start": T_START}  # stage -> time.monotonic(), sent with the result


def mark(stage: str) -> None:
    STAGES[stage] = time.monotonic()


libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)


class Refused(Exception):
    """The state the agent left cannot be scored safely (the agent's failure)."""


class Infra(Exception):
    """A failure outside the agent's reach."""


def check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def mount(src: str | bytes, target: str | bytes, fstype: str | None, flags: int, data: str | None = None) -> None:
    """mount(2); paths are file system bytes (``os.fsencode``: any name an agent chose, as it is)."""
    check(
        libc.mount(os.fsencode(src), os.fsencode(target), fstype.encode() if fstype else None, flags, data.encode() if data else None),
        f"mount {os.fsdecode(target)!r}",
    )


def stat_fields(text: str | bytes) -> list[str]:
    """The fields of a /proc/PID/stat after the command name (which a process chooses: any bytes)."""
    if isinstance(text, bytes):
        text = text.decode("ascii", "replace")
    return text[text.rfind(")") + 2 :].split()


def others(me: int) -> list[int]:
    out = []
    for n in os.listdir("/proc"):
        if not n.isdigit() or int(n) in (1, me):
            continue
        try:
            with open(f"/proc/{n}/stat", "rb") as f:  # bytes: the command name is the process's
                st = f.read()
        except OSError:
            continue
        if stat_fields(st)[:1] not in (["Z"], ["X"]):
            out.append(int(n))
    return out


def kill_all(me: int, rounds: int = 500) -> tuple[bool, int]:
    """SIGKILL every process of this pid namespace but init and ``me``; (none left, how many)."""
    killed = 0
    for _ in range(rounds):
        left = others(me)
        if not left:
            return True, killed
        killed += len(left)
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
        time.sleep(0.01)
    return not others(me), killed


def read_small_bytes(path: str, limit: int = 65536) -> bytes | None:
    """At most ``limit`` bytes of the regular file ``path``, or None if it is absent, a symlink or
    not a regular file (never blocks on a FIFO or device an agent or a test's program left there)."""
    import stat as _st

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if not _st.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks, left = [], limit
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 16))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def read_small(path: str, limit: int = 65536) -> str | None:
    """``read_small_bytes`` as text (invalid UTF-8 replaced): the report, stage times."""
    data = read_small_bytes(path, limit)
    return None if data is None else data.decode("utf-8", "replace")


class _Caps(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


class _CapHdr(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


def drop_privileges() -> None:
    """Every capability gone (bounding, ambient, effective, permitted, inheritable), no_new_privs."""
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    hdr = _CapHdr(0x20080522, 0)
    data = (_Caps * 2)()
    check(libc.capset(ctypes.byref(hdr), data), "capset")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def set_limits(cfg: dict) -> None:
    import resource as _r

    lim = cfg.get("limits") or {}
    for name, res, scale in (
        ("vmem_mb", _r.RLIMIT_AS, 1 << 20),
        ("nproc", _r.RLIMIT_NPROC, 1),
        ("fsize_mb", _r.RLIMIT_FSIZE, 1 << 20),
        ("cpu_s", _r.RLIMIT_CPU, 1),
    ):
        v = lim.get(name)
        if v:
            _r.setrlimit(res, (int(v) * scale, int(v) * scale))
    _r.setrlimit(_r.RLIMIT_CORE, (0, 0))
