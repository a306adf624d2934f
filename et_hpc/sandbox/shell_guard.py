"""Keep the shell's command input out of reach of the commands it runs (kernel facts, not bash's).

- ``PRIVATE_LINE``: the first line every shell reads. It copies bash to a fresh directory, makes
  the copy execute-only and ``exec``s it on the same input, then deletes it. A process that runs a
  binary it cannot read is non-dumpable: no process of the agent can open ``/proc/SHELL/fd``,
  read its memory or ptrace it. ``non_dumpable(pid)`` checks that from the host.
- ``boundary_sweep(...)``: between two commands, from the host, stop and kill every process that
  could read the next command: a fork of the shell that never exec'd (non-dumpable: it may hold
  bash's saved copy of its input) and any other process holding the command pipe (a copy made by a
  redirection such as ``cmd <&10 &``). Returns one note per job ended (its own forks go with it).
"""

from __future__ import annotations

import os
import signal
import time

from et_hpc.host import procfs
from et_hpc.scoring.sweep import pidfd_of, pidfd_signal, wait_exited

COPY_FAILED = "ET_SHELL_NOT_PRIVATE"

# Tried in order (/dev/shm first: the copy, held until the shell ends, takes no space of the
# agent's disk); a noexec mount or a full one moves on to the next. Nothing is left behind.
PRIVATE_LINE = (
    'shopt -s execfail; for __et_d in /dev/shm /tmp "$HOME"; do '
    '__et_t=$(mktemp -d "$__et_d/.et-shell.XXXXXX" 2>/dev/null) || continue; '
    'if cp "$(command -v bash)" "$__et_t/bash" 2>/dev/null && chmod 0111 "$__et_t/bash"; then '
    '__ET_COPY=$__et_t exec "$__et_t/bash" --noprofile --norc; fi; rm -rf "$__et_t"; done; '
    f"echo {COPY_FAILED}\n"
    # read by the copy (or by the first bash when every copy failed)
    'shopt -u execfail; [ -n "${__ET_COPY-}" ] && rm -rf "$__ET_COPY"; unset __ET_COPY __et_d __et_t\n'
)

BACKGROUND_NOTE = (
    "a background job that runs shell code without exec keeps the shell's command input open; "
    "start background work as a program: nohup/setsid/bash -c '...' &"
)
EXEC_GRACE_S = 1.0  # a fork of the shell is non-dumpable until it execs: how long it gets to
GRACE_ROUNDS = 4  # forks found after a grace (forked meanwhile) get one too, this many times

HOLDER_NOTE = "it held the shell's command input open (a redirection from the shell's own input)"


def non_dumpable(pid: int) -> bool:
    """The kernel hides ``pid``'s fds and memory from its own user (``/proc/PID/fd`` is then owned
    by another uid). False when the process is gone."""
    try:
        return os.stat(f"/proc/{pid}/fd").st_uid != os.getuid()
    except OSError:
        return False


def holds_pipe(pid: int, link: str) -> bool:
    """One of ``pid``'s fds is ``link`` (``pipe:[INODE]``)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == link:
                return True
        except OSError:
            continue
    return False


def _ancestors(pid: int, top: int) -> set[int]:
    """``pid`` and its parents up to ``top`` (the process we started), never beyond: the
    processes that start the shell, not ours that started them."""
    out: set[int] = set()
    while pid > 1 and pid not in out:
        out.add(pid)
        if pid == top:
            break
        st = procfs.stat(pid)
        if st is None:
            break
        pid = st[0]
    return out


def _candidates(shell: int, session: int) -> tuple[set[int], set[int]]:
    """(processes to look at, the agent's side of them). In an instance: all of its processes;
    the agent's are those below the shell or adopted by the instance's init (or by the shell's
    starter); others (scoring's warm-up) reach the host through a parent of their own. On the
    host: the shell's session and descendants, all the agent's."""
    ns = procfs.pid_ns(shell)
    own = _ancestors(shell, session)
    if ns is None or procfs.ns_ids(shell)[0] == shell:
        pids = {p for p, _ in procfs.session_members(session)} | procfs.descendants({shell})
        return pids - own, pids - own
    pids = procfs.instance_pids(ns) - own
    inits = {p for p in pids if procfs.ns_ids(p)[0] == 1 and procfs.pid_ns(p) == ns}
    roots = own | inits
    agent = {p for p in pids if _reaches(p, roots)} - inits
    return pids - inits, agent


def _reaches(pid: int, roots: set[int]) -> bool:
    """``pid`` or one of its parents (as they are now) is in ``roots``."""
    seen: set[int] = set()
    while pid > 1 and pid not in seen:
        if pid in roots:
            return True
        seen.add(pid)
        st = procfs.stat(pid)
        if st is None:
            return False
        pid = st[0]
    return False


def _victims(shell: int, session: int, link: str, scan: tuple[set[int], set[int]] | None = None) -> dict[int, str]:
    pids, agent = scan or _candidates(shell, session)
    forks = {p for p in pids & agent if non_dumpable(p)}
    out = dict.fromkeys(forks, BACKGROUND_NOTE)
    for pid in pids - forks:
        if holds_pipe(pid, link):
            out[pid] = HOLDER_NOTE
    return out


def _await_exec(forks: set[int]) -> None:
    """Wait until each of ``forks`` exec'd or ended (``cmd &`` and ``(cmd &)`` are forks that
    exec a moment later), at most ``EXEC_GRACE_S``."""
    deadline = time.monotonic() + EXEC_GRACE_S
    while forks and time.monotonic() < deadline:
        time.sleep(0.01)
        forks = {p for p in forks if non_dumpable(p)}


def _settle(shell: int, session: int) -> tuple[set[int], set[int]] | None:
    """Give every fork found one grace, new ones found after a grace too, for at most
    ``GRACE_ROUNDS`` rounds; the last scan when it found no fork to wait for, else None."""
    graced: set[int] = set()
    for _ in range(GRACE_ROUNDS):
        scan = _candidates(shell, session)
        forks = {p for p in scan[0] & scan[1] if non_dumpable(p)} - graced
        if not forks:
            return scan if not graced else None
        _await_exec(forks)
        graced |= forks
    return None


def boundary_sweep(shell: int, session: int, link: str, rounds: int = 10) -> list[str]:
    """Stop, then kill, every process but the shell that could read the shell's input ``link``;
    one note per job ended (a stopped fork of another is part of its job). Forks first get their
    grace to exec (``_settle``); nothing is written to the shell meanwhile, so nothing can be read."""
    scan = _settle(shell, session)
    stopped: dict[int, tuple[int, str]] = {}
    parent: dict[int, int] = {}
    for _ in range(rounds):
        found = _victims(shell, session, link, scan)
        scan = None
        new = {p: why for p, why in found.items() if p not in stopped}
        if not new:
            break
        for pid, why in new.items():
            start = procfs.start_time(pid)
            st = procfs.stat(pid)  # None: gone or a zombie, it reads nothing more
            fd = pidfd_of(pid, start) if start is not None and st is not None else None
            if fd is None or st is None:
                continue
            pidfd_signal(fd, signal.SIGSTOP)
            parent[pid] = st[0]
            stopped[pid] = (fd, f"[ended background process {_describe(pid)}: {why}]")
    if not stopped:
        return []
    # a fork of a job (its parent as read when stopped, theirs as now) ends with it, under the
    # job's note: the model reads one note per job
    notes = [note for pid, (_, note) in stopped.items() if not _reaches(parent[pid], set(parent) - {pid})]
    fds = [fd for fd, _ in stopped.values()]
    try:
        for fd in fds:
            pidfd_signal(fd, signal.SIGKILL)
        wait_exited(fds, float("inf"))
    finally:
        for fd in fds:
            os.close(fd)
    return notes


def _describe(pid: int) -> str:
    ns_pid = procfs.ns_ids(pid)[0] or pid
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read(1024).replace(b"\0", b" ").decode("utf-8", "surrogateescape").strip()  # shown by the caller
    except OSError:
        cmd = ""
    return f"{ns_pid} ({cmd[:80]})" if cmd else str(ns_pid)
