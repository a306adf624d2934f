"""The scoring entry helper's first part: its start time, system calls, processes and errors.

Stamps ``T_START`` before any other import (the helper's stage timings start there), then holds
what every later part uses: mount flags and ``_mount``/``_check`` over libc, ``STAGES`` and
``_mark`` (``time.monotonic()`` per stage, sent with the result), ``Refused`` (the agent's state
cannot be scored) and ``Infra`` (a failure outside the agent's reach), ``kill_all`` for the
instance's pid namespace, ``_read_small`` (a regular file only, never a FIFO), ``drop_privileges``
and the scoring rlimits (``_limits``). Stdlib only: it runs as the first part of the helper
program (``et_hpc.sandbox.enter.helper_argv``; docs/sandbox.md, "Scoring entry").
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


def _mark(stage: str) -> None:
    STAGES[stage] = time.monotonic()


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)


class Refused(Exception):
    """The state the agent left cannot be scored safely (the agent's failure)."""


class Infra(Exception):
    """A failure outside the agent's reach."""


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _mount(src: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(
        _libc.mount(src.encode(), target.encode(), fstype.encode() if fstype else None, flags, data.encode() if data else None),
        f"mount {target}",
    )


def _stat_fields(text: str) -> list[str]:
    return text[text.rfind(")") + 2 :].split()


def _others(me: int) -> list[int]:
    out = []
    for n in os.listdir("/proc"):
        if not n.isdigit() or int(n) in (1, me):
            continue
        try:
            with open(f"/proc/{n}/stat") as f:
                st = f.read()
        except OSError:
            continue
        if _stat_fields(st)[:1] not in (["Z"], ["X"]):
            out.append(int(n))
    return out


def kill_all(me: int, rounds: int = 500) -> tuple[bool, int]:
    """SIGKILL every process of this pid namespace but init and ``me``; (none left, how many)."""
    killed = 0
    for _ in range(rounds):
        left = _others(me)
        if not left:
            return True, killed
        killed += len(left)
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
        time.sleep(0.01)
    return not _others(me), killed


def _read_small(path: str, limit: int = 65536) -> str | None:
    """A regular file of ours (the report, stage times: on scoring's own tmpfs) as text, or None
    if it is absent or not a regular file (never blocks on a FIFO a test's program left there)."""
    import stat as _st

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if not _st.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, limit).decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


class _Caps(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


class _CapHdr(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


def drop_privileges() -> None:
    """Every capability gone (bounding, ambient, effective, permitted, inheritable), no_new_privs."""
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    for cap in range(64):
        _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    hdr = _CapHdr(0x20080522, 0)
    data = (_Caps * 2)()
    _check(_libc.capset(ctypes.byref(hdr), data), "capset")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def _limits(cfg: dict) -> None:
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
