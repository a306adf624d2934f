"""A build lock that works on NFS and survives killed holders.

One lock is one file (``locks/<key>.lock``), created by ``os.link`` of a private temp file (atomic,
and it fails if the name exists, on NFS too) and touched every ``heartbeat`` seconds by its holder.
One holder at a time; a waiter takes the lock over when its holder is gone: at once when it ran on
the same host and its pid is dead, else when the file has not changed for ``stale_after`` seconds
of the waiter's own clock. Specification (takeover): docs/images.md ("The build lock").
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from et_hpc.host.procfs import pid_alive, start_time

log = logging.getLogger(__name__)

CLOCK_SKEW_S = 60.0


class LockTimeout(TimeoutError):
    """The lock was not acquired within the wait bound."""


@dataclass(frozen=True)
class LockInfo:
    host: str
    pid: int
    pid_start: str | None
    token: str
    taken_at: float

    @classmethod
    def read(cls, path: Path) -> tuple[LockInfo | None, os.stat_result | None]:
        """The lock's content and stat, or (None, None) if there is no lock; a half-read file gives (None, stat)."""
        try:
            st = os.stat(path)
            raw = Path(path).read_bytes()
        except FileNotFoundError:
            return None, None
        try:
            d = json.loads(raw)
            return cls(d["host"], int(d["pid"]), d.get("pid_start"), d["token"], float(d["taken_at"])), st
        except (ValueError, KeyError, TypeError):
            return None, st

    def describe(self) -> str:
        return f"{self.host}:{self.pid}"


_pid_start, _pid_alive = start_time, pid_alive  # their old names


class BuildLock:
    """Mutual exclusion for one key across processes and hosts sharing a filesystem.

    Use as a context manager, or ``acquire()`` / ``release()``. ``lost`` turns true if the
    holder finds its lock gone or replaced (taken over after a stall); the holder should then
    treat its work as unprotected (publishing by atomic rename keeps results whole regardless).
    """

    def __init__(
        self,
        path: Path,
        *,
        stale_after: float = 60.0,
        heartbeat: float | None = None,
        poll: float = 0.5,
        timeout: float | None = None,
        on_wait: Callable[[LockInfo | None, float], None] | None = None,
    ) -> None:
        self.path = Path(path)
        self.stale_after = float(stale_after)
        self.heartbeat = heartbeat if heartbeat is not None else max(0.2, self.stale_after / 4)
        self.poll = poll
        self.timeout = timeout
        self.on_wait = on_wait
        self.info: LockInfo | None = None
        self.acquired_at: float | None = None  # wall clock, when we got it
        self.waited: float = 0.0
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- acquiring ---------------------------------------------------------------------------
    def _try_create(self) -> bool:
        pid = os.getpid()
        info = LockInfo(socket.gethostname(), pid, start_time(pid), uuid.uuid4().hex, time.time())
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{info.token}")
        with open(tmp, "w") as f:
            json.dump(info.__dict__, f)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, self.path)
        except OSError:
            pass  # exists; or on NFS a lost reply: the link count below tells the truth
        try:
            made = os.stat(tmp).st_nlink == 2
        finally:
            os.unlink(tmp)
        if not made:
            return False
        self.info = info
        self.acquired_at = info.taken_at
        return True

    def acquire(self) -> BuildLock:
        t0 = time.monotonic()
        seen_key: tuple | None = None
        seen_since = t0
        last_note = t0
        while True:
            if self._try_create():
                self.waited = time.monotonic() - t0
                self._start_heartbeat()
                return self
            info, st = LockInfo.read(self.path)
            now = time.monotonic()
            if st is None:
                continue  # released between our attempt and the read: try again at once
            key = (info.token if info else None, st.st_mtime_ns, st.st_size)
            if key != seen_key:
                seen_key, seen_since = key, now
            if self._is_stale(info, st, unchanged_for=now - seen_since):
                self._take_over(info, st)
                continue
            if self.timeout is not None and now - t0 > self.timeout:
                who = info.describe() if info else "unknown holder"
                raise LockTimeout(f"lock {self.path} still held by {who} after {now - t0:.0f} s")
            if self.on_wait and now - last_note >= 5.0:
                last_note = now
                self.on_wait(info, now - t0)
            time.sleep(self.poll * (0.75 + 0.5 * (uuid.uuid4().int % 1000) / 1000))

    def _is_stale(self, info: LockInfo | None, st: os.stat_result, *, unchanged_for: float) -> bool:
        if info is not None and info.host == socket.gethostname() and not pid_alive(info.pid, info.pid_start):
            log.info("lock %s: holder %s is dead", self.path, info.describe())
            return True
        if unchanged_for >= self.stale_after:
            log.info("lock %s: no heartbeat for %.1f s", self.path, unchanged_for)
            return True
        if time.time() - st.st_mtime > self.stale_after + CLOCK_SKEW_S:
            log.info("lock %s: last heartbeat %.0f s ago", self.path, time.time() - st.st_mtime)
            return True
        return False

    def _take_over(self, info: LockInfo | None, st: os.stat_result) -> None:
        aside = self.path.with_name(f".{self.path.name}.stale-{uuid.uuid4().hex}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # someone else moved it first
        moved, _ = LockInfo.read(aside)
        same = (moved.token if moved else None) == (info.token if info else None)
        if not same and moved is not None:
            # We moved a fresh lock taken after our judgement: put it back if nobody took the name.
            try:
                os.link(aside, self.path)
            except FileExistsError:
                log.warning("lock %s: a fresh lock of %s was displaced during takeover", self.path, moved.describe())
        else:
            log.warning("lock %s: took over stale lock of %s", self.path, info.describe() if info else "unknown holder")
        try:
            os.unlink(aside)
        except FileNotFoundError:
            pass

    # -- holding -----------------------------------------------------------------------------
    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name=f"lock-heartbeat-{self.path.name}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat):
            if not self.still_held():
                self.lost = True
                log.warning("lock %s was taken from us", self.path)
                return
            try:
                os.utime(self.path)
            except FileNotFoundError:
                self.lost = True
                return
            except OSError as e:
                log.debug("lock %s: heartbeat failed: %s", self.path, e)

    def still_held(self) -> bool:
        info, _ = LockInfo.read(self.path)
        return info is not None and self.info is not None and info.token == self.info.token

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self.info is not None and self.still_held():
            # Move aside before deleting so we never delete a lock someone else just created.
            aside = self.path.with_name(f".{self.path.name}.done-{self.info.token}")
            try:
                os.rename(self.path, aside)
                moved, _ = LockInfo.read(aside)
                if moved is not None and moved.token != self.info.token:
                    try:
                        os.link(aside, self.path)
                    except FileExistsError:
                        pass
                os.unlink(aside)
            except FileNotFoundError:
                pass
        self.info = None

    def __enter__(self) -> BuildLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
