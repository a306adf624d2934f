"""A per-episode memory and process watchdog that works without cgroups.

``Watchdog(sandbox, memory_mb=..., max_pids=...)`` is a context manager running one thread that
polls the instance's processes (nested PID namespaces included) every ``interval_s``, sums their
PSS and the memory no process shows (``et_hpc.sandbox.hidden_memory``), and at either ceiling
SIGKILLs them from the host through pidfds: all but init and the ``protect()``-ed shell first,
then ``/dev/shm`` and SysV segments, then the shell. Each trip is one line in ``events``, and
``on_event`` gets a note before the kill. A trip is the agent's doing (status ok). It never raises
once started: a failed poll is logged and retried; an unmeasurable tmpfs leaves ``tmpfs_ok``
False. Limits and what is counted: SECURITY.md ("Limits"); the API in full: docs/sandbox.md.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from et_hpc.errors import InfraError
from et_hpc.host import apptainer, procfs
from et_hpc.sandbox.hidden_memory import Sample, TmpfsProbe, held_files, host_tmpfs_devs, nested_tmpfs

if TYPE_CHECKING:
    from et_hpc.sandbox.sandbox import Sandbox

log = logging.getLogger(__name__)

DEFAULT_MEMORY_MB = 4096
DEFAULT_MAX_PIDS = 512
DEFAULT_INTERVAL_S = 0.25
PHASE_AGENT = "the agent's commands"
PHASE_SCORING = "the final tests"
_KILL_ROUNDS = 200


def instance_init_pid(name: str) -> int:
    """Host pid of the init process of this user's running instance ``name``."""
    cp = apptainer.run(["instance", "list", "--json", name], timeout=60)
    try:
        data = json.loads(cp.stdout or b"{}")
    except json.JSONDecodeError as e:
        raise InfraError(f"apptainer instance list --json printed something that is not JSON: {e}") from e
    for inst in data.get("instances") or []:
        if inst.get("instance") == name and inst.get("pid"):
            return int(inst["pid"])
    raise InfraError(f"instance {name} is not running")


class Watchdog:
    """See the module docstring and docs/sandbox.md. ``memory_mb``/``max_pids`` of None switch that check off."""

    def __init__(
        self,
        sandbox: Sandbox | None = None,
        *,
        init_pid: int | None = None,
        memory_mb: int | None = DEFAULT_MEMORY_MB,
        max_pids: int | None = DEFAULT_MAX_PIDS,
        interval_s: float = DEFAULT_INTERVAL_S,
        protect: Callable[[], set[int]] | None = None,
        on_event: Callable[[str], None] | None = None,
        measure_tmpfs: bool = True,
    ) -> None:
        self.sandbox = sandbox
        self._init_pid = init_pid
        self.memory_mb = memory_mb
        self.max_pids = max_pids
        self.interval_s = max(0.05, float(interval_s))
        self.protect = protect or (lambda: set())
        self.on_event = on_event
        self.measure_tmpfs = measure_tmpfs
        self.phase = PHASE_AGENT
        self.events: list[str] = []
        self.trips = 0
        self.trips_by_phase: dict[str, int] = {}
        self.killed = 0
        self.peak_kb = 0
        self.peak_pids = 0
        self.peak_tmpfs_kb = 0
        self.polls = 0
        self.poll_s = 0.0  # thread CPU time spent polling
        self.tmpfs_ok = False
        self.ns: str | None = None
        self.init_pid: int | None = None
        self._probe: TmpfsProbe | None = None
        self._own_mnt: str | None = None
        self._host_tmpfs: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> Watchdog:
        """Find the instance's init and namespace (unless ``prepare`` did) and start polling
        (raises InfraError if the instance is not running)."""
        self.prepare()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="et-watchdog", daemon=True)
        self._thread.start()
        return self

    def prepare(self) -> Watchdog:
        """Everything of ``start`` but polling: init, namespace, the tmpfs helper (once)."""
        if self.ns is not None:
            return self
        pid = self._init_pid or getattr(self.sandbox, "init_pid", None)
        if not pid and self.sandbox is not None and hasattr(self.sandbox, "init_process"):
            pid = self.sandbox.init_process()[0]  # (host pid, start time), found once per start
        if not pid:
            name = getattr(self.sandbox, "name", None)
            if not name:
                raise InfraError("the watchdog needs a running sandbox or an init pid")
            pid = instance_init_pid(name)
        ns = procfs.pid_ns(pid)
        if ns is None:
            raise InfraError(f"cannot read the PID namespace of instance init {pid}")
        self.init_pid, self.ns = int(pid), ns
        try:
            self._own_mnt = os.readlink(f"/proc/{pid}/ns/mnt")
        except OSError:
            self._own_mnt = None
        self._host_tmpfs = host_tmpfs_devs()
        if self.measure_tmpfs and self.memory_mb:
            self._probe = TmpfsProbe(self.init_pid)
            self.tmpfs_ok = self._probe.ok
            if not self._probe.ok:
                log.warning("watchdog: cannot measure the instance's tmpfs (%s); /dev/shm is not limited", self._probe.error)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        self.ns = None  # a later start() prepares again

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- polling ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            t = time.thread_time()
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the watchdog must keep watching
                log.warning("watchdog poll failed", exc_info=True)
            self.poll_s += time.thread_time() - t
            self._stop.wait(self.interval_s)

    def sample(self) -> Sample:
        assert self.ns is not None and self.init_pid is not None
        pids = sorted(procfs.instance_processes(self.ns, {self.init_pid}))
        kb = sum(procfs.memory_kb(p) for p in pids)
        probe = self._probe
        tmp = probe.used() if probe is not None else {}
        if probe is None:
            return Sample(pids, kb, tmp)
        counted = set(probe.devs) | self._host_tmpfs
        tmp.update(nested_tmpfs(probe, self._own_mnt, [self.init_pid, *pids], counted))
        held, shmem_kb = held_files([self.init_pid, *pids], counted)
        return Sample(pids, kb - shmem_kb, tmp, held, probe.sysv)

    def check(self) -> str | None:
        """One poll; returns the event line when it tripped."""
        with self._lock:
            s = self.sample()
            self.polls += 1
            self.peak_kb = max(self.peak_kb, s.total_kb)
            self.peak_pids = max(self.peak_pids, len(s.pids))
            self.peak_tmpfs_kb = max(self.peak_tmpfs_kb, s.tmpfs_kb)
            if self.max_pids and len(s.pids) >= self.max_pids:
                return self._trip(f"process limit {self.max_pids} reached ({len(s.pids)} processes)", s)
            if self.memory_mb and s.total_kb > self.memory_mb * 1024:
                what = f"{-(-s.total_kb // 1024)} MB"  # rounded up: over the ceiling reads as over it
                if s.tmpfs_kb >= 1024 or s.other_kb >= 1024:
                    what += f": processes {s.proc_kb // 1024} MB, tmpfs {s.tmpfs_kb // 1024} MB"
                nested = [f"{mp} {used // 2**20} MB" for mp, used in s.tmpfs.items() if "nested" in mp and used >= 1 << 20]
                if nested:
                    what += f" (of it {', '.join(nested)})"
                if s.other_kb >= 1024:
                    what += (
                        f", files held open (memfd, unmounted tmpfs) {s.held // 2**20} MB,"
                        f" unattached SysV shared memory {s.sysv // 2**20} MB"
                    )
                return self._trip(f"memory ceiling {self.memory_mb} MB reached ({what})", s)
            return None

    def _over(self, s: Sample) -> bool:
        return bool(self.memory_mb and s.total_kb > self.memory_mb * 1024)

    def _trip(self, reason: str, s: Sample) -> str:
        assert self.ns is not None and self.init_pid is not None
        phase = self.phase  # a long kill (a fork bomb) may outlast the phase
        if self.on_event is not None:
            try:  # before killing, so the command that dies gets the note with its result
                self.on_event(f"[{reason}: the sandbox's processes were killed]")
            except Exception:  # noqa: BLE001
                log.debug("watchdog on_event failed", exc_info=True)
        keep = {p for p in self.protect() if p}
        killed = self.kill_all(keep)
        notes: list[str] = []
        s = self.sample()
        if self._over(s) and self._probe is not None:
            for mp, used in sorted(s.tmpfs.items(), key=lambda kv: -kv[1]):
                if mp == "/dev/shm" and used >= 1 << 20:
                    freed = self._probe.empty(mp)
                    notes.append(f"emptied {mp} ({freed // 2**20} MB; the agent's files there are gone)")
            if s.sysv >= 1 << 20:
                freed = self._probe.remove_sysv()
                notes.append(f"removed the unattached SysV shared memory segments ({freed // 2**20} MB)")
            s = self.sample()
        if keep and (self._over(s) or (self.max_pids and len(s.pids) >= self.max_pids)):
            killed += self.kill_all(set())
            notes.append("the shell was killed too")
        line = f"{reason} during {phase}: killed {killed} processes"
        if notes:
            line += "; " + "; ".join(notes)
        self.trips += 1
        self.trips_by_phase[phase] = self.trips_by_phase.get(phase, 0) + 1
        self.killed += killed
        self.events.append(line)
        log.info("watchdog %s: %s", getattr(self.sandbox, "name", self.init_pid), line)
        return line

    def kill_all(self, keep: set[int]) -> int:
        """SIGKILL every process of the instance but init and ``keep``, and whatever they fork
        meanwhile (a fork bomb refills between rounds), until none of them is left. Processes a
        kept shell starts after this began are not touched. Returns how many were killed."""
        assert self.ns is not None and self.init_pid is not None
        spare = {self.init_pid} | keep
        doomed = set(procfs.instance_processes(self.ns, spare))
        hit: set[int] = set()
        for _ in range(_KILL_ROUNDS):
            victims = []
            for pid, (ppid, start) in procfs.instance_processes(self.ns, spare).items():
                if pid in doomed or ppid in doomed or ppid == self.init_pid:
                    victims.append((pid, start))
            if not victims:
                break
            doomed.update(p for p, _ in victims)
            for pid, start in victims:
                if _kill(pid, start):
                    hit.add(pid)
            time.sleep(0.005)
        return len(hit)

    def tripped_in(self, phase: str) -> bool:
        return self.trips_by_phase.get(phase, 0) > 0


def _kill(pid: int, start: str) -> bool:
    """SIGKILL ``pid`` if it is still the process that started at ``start`` (as the walk of the
    instance's processes saw it); through a pidfd, so a pid reused between the check and the
    signal is never hit."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        if procfs.start_time(pid) != start:
            return False
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
