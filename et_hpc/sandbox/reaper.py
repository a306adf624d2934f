"""Clean up after workers that died without stopping their sandboxes (SIGKILL, node trouble).

A sandbox leaves three traces on a node: the apptainer instance, its overlay file and its registry
file ``<scratch>/live/<name>.json`` (written before the overlay or the instance exist). ``reap()``
stops instances and deletes files whose owner process is dead on this host; sandboxes whose owner is
alive are left alone (an owner is its pid and that process's start time, so a reused pid does not
keep a dead worker's sandbox alive). An ``apptainer instance start`` that a killed worker left
running is waited for, so its instance is stopped too. Runners call it when a worker starts;
``start_reaping`` runs it every few seconds in a thread of a long-lived process (a continuous run's
controller and its workers), so a SIGKILLed worker's sandboxes go within one lease period without
waiting for the next worker; ``et-hpc reap`` runs it by hand.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from pathlib import Path

from pydantic import BaseModel, Field

from et_hpc.errors import InfraError
from et_hpc.host import apptainer, procfs
from et_hpc.sandbox.sandbox import START_WAIT_S, scratch_paths

log = logging.getLogger(__name__)

# <run_prefix>-<host>-<pid>-<8 hex>, as made by sandbox.new_instance_name
_NAME_RE = re.compile(r"^(?P<head>.+)-(?P<pid>\d+)-(?P<rand>[0-9a-f]{8})$")


class ReapReport(BaseModel):
    stopped: list[str] = Field(default_factory=list)  # instances stopped
    deleted: list[str] = Field(default_factory=list)  # overlay and registry files deleted
    kept: list[str] = Field(default_factory=list)  # sandboxes whose owner is alive
    errors: list[str] = Field(default_factory=list)
    dry_run: bool = False


def _short_host() -> str:
    return apptainer.safe_name(socket.gethostname().split(".")[0])


def _name_owner(name: str) -> int | None:
    """The owner pid encoded in an instance name made on this host, else None."""
    m = _NAME_RE.match(name)
    if not m or f"-{_short_host()}" not in m.group("head"):
        return None
    return int(m.group("pid"))


def reap(scratch: Path | None = None, all_runs: bool = False, dry_run: bool = False, wait_starts: bool = True) -> ReapReport:
    """Stop dead workers' instances and delete their overlays and registry files.

    Default: what the registry and overlay files in this node's scratch name. ``all_runs``: also any
    instance of this user on this host named like ours (``PREFIX-HOST-PID-RAND``) whose PID is dead,
    wherever its files live. Without ``wait_starts`` a dead worker's sandbox whose instance start
    is still running is left for the next call (nothing here then waits). Apptainer is asked only
    when there is something to reap.
    """
    r = _Reaping(ReapReport(dry_run=dry_run))
    live_dir, overlays_dir, _ = scratch_paths(scratch)
    dead = r.dead_registered(live_dir, socket.gethostname())
    dead.update(r.dead_overlays(overlays_dir))
    if not dead and not all_runs:
        return r.rep
    r.list_running()
    r.settle_starts(dead, wait_starts)
    for name, files in dead.items():
        r.stop(name)
        for f in files:
            r.delete(f)
    if all_runs:
        r.stop_strays()
    if r.rep.stopped or r.rep.deleted:
        log.info("reaped %d instance(s), %d file(s)", len(r.rep.stopped), len(r.rep.deleted))
    return r.rep


class _Reaping:
    """One ``reap`` call: its report, the instances apptainer lists, the names already judged."""

    def __init__(self, rep: ReapReport) -> None:
        self.rep = rep
        self.running: dict[str, apptainer.InstanceInfo] = {}
        self.handled: set[str] = set()

    def stop(self, name: str) -> None:
        if name not in self.running or name in self.rep.stopped:
            return
        if not self.rep.dry_run:
            try:
                apptainer.instance_stop(name, timeout_s=0)
            except InfraError as e:
                self.rep.errors.append(str(e))
                return
            # `instance stop -t 0` signals and returns; apptainer's monitor removes the instance
            # afterwards. Reaped means gone: wait for it, as Sandbox.stop does.
            if not apptainer.wait_gone(name):
                self.rep.errors.append(f"instance {name} still listed after it was stopped")
        self.rep.stopped.append(name)

    def delete(self, p: Path) -> None:
        if not (p.exists() or p.is_symlink()):
            return
        if not self.rep.dry_run:
            try:
                p.unlink()
            except OSError as e:
                self.rep.errors.append(f"cannot delete {p}: {e}")
                return
        self.rep.deleted.append(str(p))

    def dead_registered(self, live_dir: Path, host: str) -> dict[str, list[Path]]:
        """Sandboxes of dead owners named by registry files: name -> files to delete."""
        dead: dict[str, list[Path]] = {}
        for reg in sorted(live_dir.glob("*.json")):
            try:
                rec = json.loads(reg.read_text())
                name, pid, rhost = rec["name"], int(rec["pid"]), rec.get("host", host)
            except (OSError, ValueError, KeyError, TypeError) as e:
                self.rep.errors.append(f"unreadable registry file {reg}: {e}")
                continue
            self.handled.add(name)
            if rhost != host:
                continue  # another node's scratch seen through a shared path: not ours to judge
            if procfs.pid_alive(pid, rec.get("pid_start")):
                self.rep.kept.append(name)
                continue
            dead[name] = ([Path(rec["overlay"])] if rec.get("overlay") else []) + [reg]
        return dead

    def dead_overlays(self, overlays_dir: Path) -> dict[str, list[Path]]:
        """Overlays without a registry file whose name's owner pid is dead on this host."""
        dead: dict[str, list[Path]] = {}
        for ov in sorted(overlays_dir.glob("*.img")):
            name = ov.stem
            if name in self.handled:
                continue
            owner = _name_owner(name)
            if owner is not None and not procfs.pid_alive(owner):
                self.handled.add(name)
                dead[name] = [ov]
        return dead

    def list_running(self) -> None:
        try:
            self.running = {i.name: i for i in apptainer.instance_list()}
        except InfraError as e:
            self.rep.errors.append(str(e))

    def settle_starts(self, dead: dict[str, list[Path]], wait_starts: bool) -> None:
        """A worker killed while it started a sandbox leaves its start running: the instance appears
        after the listing, from an overlay deleted under it. A start is in flight while its
        `apptainer instance start` runs or while its instance's own processes (named ``[NAME]``)
        exist unlisted. Wait for such starts to end and look again (or, without ``wait_starts``,
        leave them to the next call)."""
        unlisted = [n for n in dead if n not in self.running]
        if not unlisted:
            return
        deadline = time.monotonic() + START_WAIT_S
        while True:
            starting = [n for n in unlisted if n in dead and n not in self.running and _in_flight(n)]
            if starting and (not wait_starts or time.monotonic() > deadline):
                for n in starting:
                    if wait_starts:
                        self.rep.errors.append(f"the start of instance {n} still runs after {START_WAIT_S:.0f} s")
                    del dead[n]  # its files stay for the next reaping, which finds it started
                starting = []
            if not starting:
                # A start that ended between the listing and the look at the process table made
                # its instance after the listing: list again.
                self.list_running()
                return
            time.sleep(0.1)
            self.list_running()

    def stop_strays(self) -> None:
        """Instances named like ours whose owner pid is dead, wherever their files live."""
        for name in list(self.running):
            if name in self.handled:
                continue
            owner = _name_owner(name)
            if owner is not None and not procfs.pid_alive(owner):
                self.stop(name)


def _in_flight(name: str) -> bool:
    return bool(procfs.with_argument(name) or procfs.naming(f"[{name}]"))


def reap_dead(scratch: Path | None = None, *, wait_starts: bool = True) -> ReapReport | None:
    """``reap(scratch)`` that never raises (a worker must not die of its cleanup); None on failure."""
    try:
        rep = reap(scratch=scratch, wait_starts=wait_starts)
    except Exception:  # noqa: BLE001
        log.exception("sandbox reaper failed")
        return None
    for e in rep.errors:
        log.warning("reaper: %s", e)
    if rep.stopped:
        log.warning("reaped the sandboxes of dead workers: %s", ", ".join(rep.stopped))
    return rep


def start_reaping(stop: threading.Event, interval_s: float, scratch: Path | None = None) -> threading.Thread:
    """A daemon thread that reaps dead workers' sandboxes on this node every ``interval_s`` until
    ``stop`` is set. Each round costs a directory listing and a look at /proc; apptainer is started
    only when a dead owner's sandbox is found."""

    def loop() -> None:
        while not stop.wait(interval_s):
            reap_dead(scratch, wait_starts=False)

    t = threading.Thread(target=loop, name="reaper", daemon=True)
    t.start()
    return t
