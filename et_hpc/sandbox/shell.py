"""One persistent bash per episode: run a command, get its output and exit code, with real timeouts.

Started from an argv (a host ``bash`` for tests, ``apptainer exec instance://NAME bash`` in a
sandbox) and fed one line per command through a pipe that neither the command nor anything it
starts can read (``shell_guard``), so none can read a pending line or forge an end. Every command
gets its own process group, killed from the host on timeout; a shell that exited or does not
answer is started anew, and the result says so. Output is kept as a head and a tail; it and the
notes appended to it go through ``et_hpc.text.visible`` (controls shown as escapes, counted in
``escaped``). Specification: docs/shell.md; residuals: SECURITY.md.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from et_hpc.errors import InfraError
from et_hpc.host.procfs import ns_ids as _ns_ids
from et_hpc.host.procfs import session_members as _session_members
from et_hpc.host.procfs import stat as _stat
from et_hpc.sandbox import shell_guard
from et_hpc.text import hidden_count, visible

log = logging.getLogger(__name__)

OUTPUT_LIMIT_CHARS = 50_000  # characters of one command's output kept (the rest is cut)

_READ_SIZE = 1 << 16
_SLACK = 1 << 16  # bytes kept beyond the tail so the end marker (and job list) is always seen
_KILL_GRACE_S = 3.0  # how long to wait for the shell after killing a timed-out command
_EOF_GRACE_S = 0.5  # how long a closed shell gets to end on its own before its session is killed
_START_TIMEOUT_S = 60.0


@dataclass
class CommandResult:
    output: str  # merged stdout+stderr and notes, through ``visible``; head+tail truncated with a notice
    exit_code: int | None  # None when timed out or the shell died
    timed_out: bool = False
    truncated: bool = False
    duration_s: float = 0.0
    shell_restarted: bool = False  # the shell had died; it was restarted and `output` says so
    escaped: int = 0  # control characters and bytes that are not UTF-8 (lone surrogates) shown as escapes


def bash_quote(s: str) -> str:
    """``s`` as a bash ``$'…'`` word: printable ASCII kept, everything else as ``\\xHH`` bytes,
    UTF-8 with ``surrogateescape`` as the shell's pipe and output: a string decoded from bytes gives
    back those bytes (``\\udcff`` is 0xff); another lone surrogate is written as ``surrogatepass``."""
    out = ["$'"]
    for ch in s:
        o = ord(ch)
        if ch == "\\":
            out.append("\\\\")
        elif ch == "'":
            out.append("\\'")
        elif 0x20 <= o < 0x7F:
            out.append(ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif 0xDC80 <= o <= 0xDCFF:  # an undecodable byte under ``surrogateescape``: that byte
            out.append(f"\\x{o - 0xDC00:02x}")
        else:  # other lone surrogates (no byte they came from) as UTF-8 would write them
            out.append("".join(f"\\x{b:02x}" for b in ch.encode("utf-8", "surrogatepass")))
    out.append("'")
    return "".join(out)


class _Capture:
    """Output of one command: the first ``head_cap`` bytes, the last bytes, and how much was dropped."""

    def __init__(self, limit: int) -> None:
        self.head_cap = limit // 2
        self.tail_cap = limit - self.head_cap
        self.head = bytearray()
        self.buf = bytearray()  # recent bytes not yet moved to head or dropped
        self.dropped = 0
        self.scan_from = 0
        self.marker: bytes | None = None
        self.end_token: bytes | None = None
        self.found: tuple[bytes, bytes] | None = None  # (output bytes, info field)
        self.eof = False

    def set_marker(self, marker: str) -> None:
        self.marker = marker.encode()
        self.end_token = self.marker + b".\n"
        self.scan_from = len(self.buf)

    def feed(self, data: bytes) -> bytes | None:
        """Add bytes; when the end marker completes, record the result and return what follows it."""
        self.buf += data
        if self.marker is not None and self.end_token is not None:  # set together by set_marker
            start = max(0, self.scan_from - len(self.end_token))
            i = self.buf.find(self.end_token, start)
            if i >= 0:
                j = self.buf.rfind(b"\n" + self.marker + b":", 0, i)
                after = bytes(self.buf[i + len(self.end_token) :])
                if j < 0:  # marker start scrolled away (absurdly long job list): keep what we have
                    self.found = (b"", b"")
                    del self.buf[:]
                else:
                    info = bytes(self.buf[j + len(self.marker) + 2 : i])
                    del self.buf[j:]
                    self.found = (b"", info)
                return after
            self.scan_from = len(self.buf)
        keep = self.tail_cap + _SLACK
        if len(self.buf) > keep + _SLACK:  # trim in large steps to keep the cost per byte low
            excess = len(self.buf) - keep
            if len(self.head) < self.head_cap:
                take = min(self.head_cap - len(self.head), excess)
                self.head += self.buf[:take]
                excess -= take
                del self.buf[:take]
            if excess > 0:
                del self.buf[:excess]
                self.dropped += excess
            self.scan_from = len(self.buf)
        return None

    def output(self) -> tuple[str, bool]:
        """The captured text (raw: controls still in it; truncated with a notice) and whether anything was cut."""
        head, rest, dropped = bytes(self.head), bytes(self.buf), self.dropped
        if len(head) < self.head_cap:
            take = self.head_cap - len(head)
            head, rest = head + rest[:take], rest[take:]
        if len(rest) > self.tail_cap:
            dropped += len(rest) - self.tail_cap
            rest = rest[len(rest) - self.tail_cap :]
        if dropped:
            text = _decode(head) + f"\n[... output truncated: {dropped} bytes omitted from the middle ...]\n" + _decode(rest)
        else:
            text = _decode(head + rest)
        return text, dropped > 0


def _decode(b: bytes) -> str:
    """Agent bytes stay bytes: each one that is not UTF-8 becomes a lone surrogate (U+DC80-U+DCFF),
    which ``visible`` shows as ``\\udcHH`` and counts."""
    return b.decode("utf-8", errors="surrogateescape")


# ---------------------------------------------------------------------------------------------
# Killing the process groups of a timed-out command from the host side (parsing: procfs).


def kill_session(sid: int, rounds: int = 10) -> None:
    """SIGKILL every process group in session ``sid`` (host view) until none is left."""
    for _ in range(rounds):
        groups = {pgid for _pid, pgid in _session_members(sid)}
        if not groups:
            return
        for pgid in groups:
            _killpg(pgid)
        time.sleep(0.02)


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class ShellDied(InfraError):
    """The shell did not start (or restart). Whose fault that is decides the caller, from the host:
    see ``Sandbox.health`` and ``et_hpc.agent.loop.run_agent``'s ``shell_blame``."""


class Shell:
    """One persistent bash. `argv` starts it: ["bash", "--noprofile", "--norc"] on the host (tests),
    or ["apptainer", "exec", "--pwd", "/home/user", "instance://NAME", "bash", ...] in an instance.

    ``env`` is exported and ``init`` (a bash snippet, e.g. ``ulimit`` lines) is run once in every
    new shell. ``killer(pgid)`` kills one host process group of a timed-out command (default:
    SIGKILL through ``os.killpg``).
    """

    def __init__(
        self,
        argv: list[str],
        *,
        home: str = "/home/user",
        output_limit: int = OUTPUT_LIMIT_CHARS,
        env: dict[str, str] | None = None,
        killer: Callable[[int], None] | None = None,
        init: str | None = None,
        popen_env: dict[str, str] | None = None,
        guard: bool = True,
    ) -> None:
        self.argv = list(argv)
        self.home = home
        self.output_limit = output_limit
        self.env = dict(env or {})
        self.killer = killer or _killpg
        self.init = init
        self.popen_env = popen_env
        self.guard = guard  # off only to show, in tests, what the guard stops
        self._pipe = ""  # the command pipe as its holders' fds show it (``pipe:[INODE]``)
        self._proc: subprocess.Popen[bytes] | None = None
        self._cv = threading.Condition()
        self._cap: _Capture | None = None
        self._reader: threading.Thread | None = None
        self._run_lock = threading.Lock()
        self._protected: set[int] = set()  # namespace pgids of background jobs from earlier commands
        self.ns_pid: int | None = None  # the shell's pid inside its PID namespace
        self.host_pid: int | None = None  # the shell's pid on the host
        self.exit_status: int | None = None  # of the shell's process once closed (negative: a signal)
        self.restarts = 0
        self._notes: list[str] = []  # added from other threads (the watchdog), shown with the next result

    def add_note(self, note: str) -> None:
        """Attach ``note`` to the result of the running (or next) command, e.g. a watchdog kill."""
        with self._cv:
            self._notes.append(note)

    def _take_notes(self) -> list[str]:
        with self._cv:
            notes, self._notes = self._notes, []
        return notes

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self.alive():
            return
        self._spawn()

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and not (self._cap and self._cap.eof)

    def _spawn(self) -> None:
        self._proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=self.popen_env,
            close_fds=True,
        )
        with self._cv:
            self._cap = _Capture(self.output_limit)
        self._reader = threading.Thread(target=self._read_loop, args=(self._proc,), name="et-shell-reader", daemon=True)
        self._reader.start()
        self._protected = set()
        assert self._proc.stdin is not None
        self._pipe = f"pipe:[{os.fstat(self._proc.stdin.fileno()).st_ino}]"
        lines = [shell_guard.PRIVATE_LINE.rstrip("\n")] if self.guard else []
        lines += ["set -m", f"export HOME={bash_quote(self.home)}"]
        lines += [f"export {k}={bash_quote(v)}" for k, v in self.env.items() if _valid_name(k)]
        lines.append('cd "$HOME" 2>/dev/null || cd /')
        if self.init:
            lines.append(f"eval {bash_quote(self.init)} </dev/null")
        script = "\n".join(lines) + "\n"
        marker = _new_marker()
        cap = self._exchange(script, marker, "$$", _START_TIMEOUT_S)
        if cap.found is None:
            out = cap.output()[0]
            self._terminate()
            raise ShellDied(visible(f"the shell did not start: {' '.join(self.argv)}: {out.strip()[-500:]}"))
        self.ns_pid, _ = _parse_info(cap.found[1].decode("utf-8", "replace"))
        self.host_pid = self._find_host_pid()
        if self.guard:
            self._check_private(cap.output()[0])
        log.debug("shell started: host pid %s, namespace pid %s", self.host_pid, self.ns_pid)

    def _check_private(self, startup_output: str) -> None:
        """The new shell must be non-dumpable (seen from the host); else it is ended."""
        if self.host_pid is not None and shell_guard.non_dumpable(self.host_pid):
            return
        self._terminate()
        why = (
            "no copy of bash could be made and run (/dev/shm, /tmp and $HOME full, read-only or noexec, or bash unreadable)"
            if shell_guard.COPY_FAILED in startup_output
            else "the new shell is readable by the commands (its bash copy was replaced?)"
        )
        raise ShellDied(f"the shell's input could not be made private: {why}")

    def boundary_notes(self) -> list[str]:
        """End what could read the shell's next command (``shell_guard.boundary_sweep``)."""
        if not self.guard or self._proc is None or self.host_pid is None:
            return []
        notes = shell_guard.boundary_sweep(self.host_pid, self._proc.pid, self._pipe)
        if notes:  # bash reports its killed jobs at its next line: let it do so on a line of ours
            self._exchange("jobs >/dev/null 2>&1", _new_marker(), "$?", _KILL_GRACE_S)
        return notes

    def _find_host_pid(self) -> int | None:
        assert self._proc is not None
        if self.ns_pid is None:
            return None
        if self.ns_pid == self._proc.pid:
            return self._proc.pid
        for pid, _pgid in _session_members(self._proc.pid):
            if _ns_ids(pid)[0] == self.ns_pid:
                return pid
        return None

    def close(self) -> None:
        """Stop the shell and every process still in its session."""
        self._terminate()

    def _terminate(self) -> None:
        proc = self._proc
        if proc is None:
            return
        try:
            if proc.stdin:
                proc.stdin.close()
        except OSError:
            pass
        # An idle bash ends on EOF and apptainer's exec process reaps it and exits. Killing both
        # at once would leave bash to be reaped outside the instance (by the host's init, whenever
        # it gets to it), and apptainer waits for that before it drops a stopped instance.
        try:
            proc.wait(timeout=_EOF_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        for _ in range(5):
            members = _session_members(proc.pid)
            if not members and proc.poll() is not None:
                break
            for pgid in {pg for _pid, pg in members} | {proc.pid}:
                _killpg(pgid)
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        if self._reader is not None:
            self._reader.join(timeout=2)
        if proc.stdout:
            proc.stdout.close()
        self.exit_status = proc.returncode
        self._proc = None

    def __enter__(self) -> Shell:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading ---------------------------------------------------------------------------

    def _read_loop(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        while True:
            try:
                data = os.read(fd, _READ_SIZE)
            except OSError:
                data = b""
            with self._cv:
                if proc is not self._proc:
                    return
                cap = self._cap
                assert cap is not None
                if not data:
                    cap.eof = True
                    self._cv.notify_all()
                    return
                rest = cap.feed(data)
                if rest is not None:
                    self._cv.notify_all()
                    nxt = _Capture(self.output_limit)
                    if rest:
                        nxt.feed(rest)
                    self._cap = nxt

    # -- running ---------------------------------------------------------------------------

    def _exchange(self, script: str, marker: str, info_expr: str, timeout: float) -> _Capture:
        """Send ``script`` then the marker line; wait until the marker, EOF or ``timeout``.

        Returns the command's capture: ``found`` is set when the marker arrived, ``eof`` when the
        shell died; neither when it timed out.
        """
        assert self._proc is not None and self._proc.stdin is not None
        with self._cv:
            cap = self._cap
            assert cap is not None
            cap.set_marker(marker)
        # The end marker is printed by the same line as the script's last command: bash reads a
        # whole line before it runs any of it, so while the command runs nothing of ours is left
        # unread in the pipe (no marker to read from the shell's saved copy of its input), and the
        # next line is written only after this one's marker came.
        tail = f"printf '\\n%s:%s:' {marker} \"{info_expr}\"; jobs -p; printf '%s.\\n' {marker}\n"
        line = script.rstrip("\n") + "; " + tail
        try:
            self._proc.stdin.write(line.encode("utf-8", "surrogateescape"))
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
        self._wait(cap, timeout)
        return cap

    def _wait(self, cap: _Capture, timeout: float) -> None:
        """Wait for the marker, EOF, the shell process exiting, or ``timeout``.

        Background jobs keep the output pipe open after the shell exits, so EOF alone does not
        tell that it died: the process is polled too.
        """
        deadline = time.monotonic() + timeout
        proc = self._proc
        with self._cv:
            while cap.found is None and not cap.eof:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cv.wait(min(left, 0.05))
                if cap.found is None and proc is not None and proc.poll() is not None:
                    self._cv.wait(0.05)  # let the reader take what the shell wrote last
                    if cap.found is None:
                        cap.eof = True

    def run(self, command: str, timeout: float = 60.0) -> CommandResult:
        """Run one command in the shell (cwd, exports and shell variables persist)."""
        with self._run_lock:
            return self._run(command, timeout)

    def _run(self, command: str, timeout: float) -> CommandResult:
        t0 = time.monotonic()
        notes: list[str] = []
        restarted = False
        if not self.alive():
            was_started = self._proc is not None or self.restarts > 0
            self._terminate()
            self._spawn()
            if was_started:
                restarted = True
                self.restarts += 1
                notes.append(_RESTART_NOTE)
        notes += self.boundary_notes()  # again right before the line: nothing new since the last end
        marker = _new_marker()
        cap = self._exchange(f"eval {bash_quote(command)} </dev/null\n", marker, "$?", timeout)
        if cap.found is not None:
            return self._finish(cap, t0, notes, restarted, timed_out=False)
        if cap.eof:
            return self._restart(cap, t0, notes, _DIED_NOTE, "the shell exited", timed_out=False)
        # Timed out: kill the command's process groups, give the shell a moment to report.
        self._kill_foreground()
        self._wait(cap, _KILL_GRACE_S)
        if cap.found is None and not cap.eof:
            self._kill_foreground()  # late children (e.g. a fork bomb) get one more sweep
            self._wait(cap, 0.5)
        timeout_note = f"[command timed out after {timeout:g} s and was killed]"
        if cap.found is not None:
            return self._finish(cap, t0, notes + [timeout_note], restarted, timed_out=True)
        return self._restart(cap, t0, notes + [timeout_note], _WEDGED_NOTE, "the shell did not respond", timed_out=True)

    def _restart(self, cap: _Capture, t0: float, notes: list[str], note: str, what: str, *, timed_out: bool) -> CommandResult:
        """The shell is dead or wedged: start a new one and say so in the command's result."""
        out, trunc = cap.output()
        notes = notes + self._take_notes()
        self._terminate()
        self.restarts += 1
        try:
            self._spawn()
        except ShellDied as e:
            note = f"[{what} and could not be restarted: {e}]"
        output, escaped = _shown(out, notes + [note])
        return CommandResult(
            output=output,
            escaped=escaped,
            exit_code=None,
            timed_out=timed_out,
            truncated=trunc,
            duration_s=time.monotonic() - t0,
            shell_restarted=True,
        )

    def _finish(self, cap: _Capture, t0: float, notes: list[str], restarted: bool, *, timed_out: bool) -> CommandResult:
        out, trunc = cap.output()
        info = cap.found[1].decode("utf-8", "replace") if cap.found else ""
        code, self._protected = _parse_info(info)
        notes = notes + self.boundary_notes() + self._take_notes()
        if timed_out:
            code = None
        output, escaped = _shown(out, notes)
        return CommandResult(
            output=output,
            escaped=escaped,
            exit_code=code,
            timed_out=timed_out,
            truncated=trunc,
            duration_s=time.monotonic() - t0,
            shell_restarted=restarted,
        )

    def _kill_foreground(self) -> None:
        """SIGKILL every process group in the shell's session except the shell's own and
        background jobs started by earlier commands."""
        proc = self._proc
        if proc is None:
            return
        shell_pid = self.host_pid or proc.pid
        own = set()
        for p in (shell_pid, proc.pid):
            st = _stat(p)
            if st:
                own.add(st[1])
        for _ in range(20):
            victims = set()
            for pid, pgid in _session_members(proc.pid):
                if pgid in own or pid == shell_pid:
                    continue
                if self._protected:
                    ns_pgid = _ns_ids(pid)[1]
                    if ns_pgid in self._protected:
                        continue
                victims.add(pgid)
            if not victims:
                return
            for pgid in victims:
                self.killer(pgid)
            time.sleep(0.02)


_RESTART_NOTE = "[the shell had exited; a new shell was started in $HOME (directory and variables reset)]"
_DIED_NOTE = "[the shell exited; a new shell was started in $HOME (directory and variables reset)]"
_WEDGED_NOTE = "[the shell did not respond after the timeout; a new shell was started in $HOME (directory and variables reset)]"


def _parse_info(info: str) -> tuple[int | None, set[int]]:
    """Split the marker's ``VALUE:JOBPGIDS`` field into the value and the background job pgids."""
    value, _, jobs = info.partition(":")
    try:
        num: int | None = int(value)
    except ValueError:
        num = None
    return num, {int(x) for x in jobs.split() if x.isdigit()}


def _shown(out: str, notes: list[str]) -> tuple[str, int]:
    """The output with the notes after it (which name agent-chosen argv and mount points), through
    ``visible``; and how many characters it escaped."""
    if notes:
        sep = "\n" if out and not out.endswith("\n") else ""
        out = out + sep + "\n".join(notes)
    return visible(out), hidden_count(out)


def _new_marker() -> str:
    return "__ET_" + secrets.token_hex(12)


def _valid_name(k: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k))
