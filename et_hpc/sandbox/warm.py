"""Sandboxes started ahead of their episodes, so that setup leaves the critical path.

``start_ready(spec)`` makes one ``Ready`` (image lease, overlay, instance, first shell, watchdog
helper); a ``WarmPool`` of ``size`` makes them ahead in background threads for the specs its
owners ``want``. ``reserve`` gives a ``Ticket``; ``Ticket.take()`` hands out a sandbox only if a
host-side health check passes (else ``None``: the episode starts its own inline). Guarantees: a
sandbox is handed out at most once; ``close()`` (also on the run's ``stop`` event and at exit)
stops every sandbox not handed out; retired sandboxes stop in the background; failing starts
back off (2 s up to 60 s). Warm sandboxes have registry files, so ``et-hpc reap`` removes them.
The full contract: docs/sandbox.md.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from itertools import chain, zip_longest
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, TypeVar

from et_hpc.sandbox.sandbox import Sandbox
from et_hpc.sandbox.shell import Shell
from et_hpc.sandbox.watchdog import Watchdog

if TYPE_CHECKING:
    from et_hpc.images.local_copy import LocalImage, Mode

log = logging.getLogger(__name__)
T = TypeVar("T")

# Endless Terminals' recorded agents created files group-writable (0664): their shells ran with
# umask 002, and generated final tests check modes against that. The agent's shell does the same.
AGENT_UMASK = "0002"


@dataclass(frozen=True)
class SandboxSpec:
    """What a sandbox is made of; episodes with equal specs can use each other's warm sandboxes."""

    image_path: str
    image_digest: str | None
    run_prefix: str
    overlay_mb: int | None
    writable_tmpfs: bool
    network_none: bool
    nproc: int | None
    vmem_mb: int | None
    fsize_mb: int | None
    output_limit: int
    memory_mb: int | None = None  # watchdog (et_hpc.sandbox.watchdog); interval 0: none
    max_pids: int | None = None
    watchdog_interval_s: float = 0.0
    local_copy: Mode = "auto"
    local_copy_budget_gb: float = 20.0
    binds: tuple[str, ...] = ()  # --bind options (SandboxConfig.bind_options)


@dataclass
class Ready:
    """A started sandbox, its first shell (prepared, ulimits and umask set), its watchdog (prepared,
    not polling yet: ``watchdog.start()`` when the episode begins) and the image lease."""

    sandbox: Sandbox
    shell: Shell
    sif: Path | LocalImage  # the image path, or a leased node-local copy: kept as long as the sandbox runs
    start_s: float  # seconds the start took
    watchdog: Watchdog | None = None

    def stop(self) -> None:
        _stop(self.sandbox, self.watchdog, self.sif)


def _stop(sandbox: Sandbox, watchdog: Watchdog | None, sif: Path | LocalImage) -> None:
    try:
        if watchdog is not None:
            watchdog.stop()
        sandbox.stop()
    finally:
        release = getattr(sif, "release", None)
        if release:
            release()


def start_ready(spec: SandboxSpec) -> Ready:
    """Start a sandbox for ``spec``, open its first shell, prepare its watchdog. Raises
    InfraError/OSError; leaves nothing behind when it does."""
    from et_hpc.images.local_copy import episode_image

    t0 = time.monotonic()
    sif: Path | LocalImage
    if spec.image_path.endswith(".cas"):  # a CAS image starts only from its node-local tree
        from et_hpc.images.cas_node import cas_tree

        sif = cas_tree(spec.image_path, spec.image_digest, budget_gb=spec.local_copy_budget_gb)
    else:
        sif = episode_image(SimpleNamespace(path=spec.image_path, digest=spec.image_digest), spec)
    sandbox = Sandbox(
        Path(sif),
        run_prefix=spec.run_prefix,
        overlay_mb=spec.overlay_mb,
        writable_tmpfs=spec.writable_tmpfs,
        network_none=spec.network_none,
        nproc=spec.nproc,
        vmem_mb=spec.vmem_mb,
        fsize_mb=spec.fsize_mb,
        binds=spec.binds,
    )
    wd: Watchdog | None = None
    try:
        sandbox.start()
        shell = sandbox.shell(output_limit=spec.output_limit)
        shell.run(f"umask {AGENT_UMASK}", timeout=30)
        if spec.watchdog_interval_s:
            # the agent's shell is spared at first (the command that blew up returns killed) and gets the note
            wd = Watchdog(
                sandbox,
                memory_mb=spec.memory_mb,
                max_pids=spec.max_pids,
                interval_s=spec.watchdog_interval_s,
                protect=lambda: set() if shell.host_pid is None else {shell.host_pid},
                on_event=shell.add_note,
            )
            wd.prepare()
    except BaseException:
        _stop(sandbox, wd, sif)
        raise
    return Ready(sandbox, shell, sif, time.monotonic() - t0, wd)


def dead_reason(ready: Ready) -> str | None:
    """None when the sandbox and its shell run; else why not (checked from the host)."""
    health = ready.sandbox.health()
    if health != "alive":
        return f"instance {health}"
    if not ready.shell.alive():
        return "its shell exited"
    return None


@dataclass(eq=False)
class _Entry:
    spec: SandboxSpec
    done: threading.Event = field(default_factory=threading.Event)
    ready: Ready | None = None
    error: BaseException | None = None
    discard: bool = False  # stop it once started (pool closed, ticket discarded)


class Ticket:
    """One reserved warm sandbox (its contract: docs/sandbox.md)."""

    def __init__(self, pool: WarmPool, entry: _Entry) -> None:
        self._pool, self._entry = pool, entry
        self._used = False

    @property
    def spec(self) -> SandboxSpec:
        return self._entry.spec

    def take(self) -> Ready | None:
        """The started sandbox, alive; None when its start failed, it died, or the pool closed."""
        if self._used:
            return None
        self._used = True
        e = self._entry
        while not e.done.wait(0.2):
            if self._pool.closed:
                break
        with self._pool._lock:
            if not e.done.is_set() or e.discard or e.ready is None:
                e.discard = True  # the starter stops it when it finishes
                ready = None
            else:
                ready = e.ready
        if ready is None:
            if e.error is not None:
                log.info("warm sandbox for %s failed to start: %s", e.spec.image_path, e.error)
            return None
        why = dead_reason(ready)
        if why is not None:
            log.warning("warm sandbox %s is dead (%s): discarded, starting a fresh one", ready.sandbox.name, why)
            ready.stop()
            return None
        return ready

    def retire(self, readies: list[Ready]) -> bool:
        """Hand the episode's finished sandboxes back to the pool to stop in the background (the
        teardown leaves the critical path; ``close()`` waits for it). False when the pool is closed:
        the caller stops them itself."""
        return self._pool.retire(readies)

    def discard(self) -> None:
        """Stop the sandbox unless it was handed out (safe to call more than once)."""
        if self._used:
            return
        self._used = True
        self._pool._drop(self._entry)


class WarmPool:
    """Up to ``size`` sandboxes started ahead for the specs sources ``want`` (docs/sandbox.md)."""

    def __init__(self, size: int, *, stop: threading.Event | None = None, starter: Callable[[SandboxSpec], Ready] = start_ready) -> None:
        self.size = max(0, int(size))
        self.closed = False
        self._closed = threading.Event()  # close() has finished
        self._starter = starter
        self._lock = threading.Lock()
        self._stock: list[_Entry] = []  # starting or ready, not reserved
        self._wants: dict[Hashable, list[SandboxSpec]] = {}
        self._threads: set[threading.Thread] = set()
        self._failures = 0
        self._paused_until = 0.0
        self.started = 0  # sandboxes started ahead
        self.handed = 0  # reserved by episodes
        atexit.register(self.close)
        if stop is not None:
            threading.Thread(target=self._watch, args=(stop,), name="warm-watch", daemon=True).start()

    # -- what episodes call -------------------------------------------------------------------

    def want(self, source: Hashable, specs: Iterable[SandboxSpec | None]) -> None:
        """``source`` will next need sandboxes of ``specs``, in order (replaces its earlier want)."""
        with self._lock:
            if self.closed:
                return
            self._wants[source] = [s for s in specs if s is not None]
            self._fill()

    def reserve(self, spec: SandboxSpec | None) -> Ticket | None:
        """A ticket for a ready (else starting) sandbox of ``spec``, out of the pool; or None."""
        if spec is None:
            return None
        with self._lock:
            if self.closed:
                return None
            mine = [e for e in self._stock if e.spec == spec]
            if not mine:
                return None
            entry = next((e for e in mine if e.done.is_set()), mine[0])
            self._stock.remove(entry)
            self.handed += 1
            return Ticket(self, entry)

    def retire(self, readies: list[Ready]) -> bool:
        """Stop ``readies`` (finished episodes' sandboxes) in a background thread that ``close()``
        waits for; False (nothing done) when the pool is closed."""

        def run() -> None:
            try:
                for r in readies:
                    r.stop()
            finally:
                with self._lock:
                    self._threads.discard(threading.current_thread())

        with self._lock:
            if self.closed:
                return False
            t = threading.Thread(target=run, name="warm-retire", daemon=True)
            self._threads.add(t)
            t.start()
        return True

    def close(self, wait_s: float = 60.0) -> None:
        """Stop every sandbox not handed out, waiting up to ``wait_s`` for starts in progress
        (a second call waits for the first to finish)."""
        with self._lock:
            first, self.closed = not self.closed, True
            stock, self._stock = self._stock, []
            self._wants.clear()
            threads = list(self._threads)
        if not first:
            self._closed.wait(wait_s)
            return
        for e in stock:
            self._drop(e)
        end = time.monotonic() + wait_s
        for t in threads:
            if t is not threading.current_thread():
                t.join(max(0.0, end - time.monotonic()))
        self._closed.set()
        try:
            atexit.unregister(self.close)
        except Exception:  # noqa: BLE001 - interpreter shutting down
            pass

    def __enter__(self) -> WarmPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- inside -----------------------------------------------------------------------------

    def _watch(self, stop: threading.Event) -> None:
        while not self.closed:
            if stop.wait(0.5):
                self.close()
                return

    def _desired(self) -> list[SandboxSpec]:
        """The first ``size`` specs of all sources' wants, taken in turn."""
        return interleave(self._wants.values())[: self.size]

    def _fill(self) -> None:
        """(Under the lock.) Start what the wants lack; make room from ready ones nobody wants."""
        spare = list(self._stock)
        missing: list[SandboxSpec] = []
        for spec in self._desired():
            match = next((e for e in spare if e.spec == spec), None)
            if match is not None:
                spare.remove(match)
            else:
                missing.append(spec)
        if not missing or time.monotonic() < self._paused_until:
            return
        for spec in missing:
            if len(self._stock) >= self.size:
                victim = next((e for e in spare if e.done.is_set()), None)
                if victim is None:
                    return
                spare.remove(victim)
                self._stock.remove(victim)
                self._stop_later(victim)
            entry = _Entry(spec)
            self._stock.append(entry)
            self.started += 1
            t = threading.Thread(target=self._start, args=(entry,), name="warm-start", daemon=True)
            self._threads.add(t)
            t.start()

    def _start(self, entry: _Entry) -> None:
        ready = error = None
        try:
            ready = self._starter(entry.spec)
        except BaseException as e:  # noqa: BLE001 - reported to whoever takes it
            error = e
            log.warning("starting a warm sandbox for %s failed: %s", entry.spec.image_path, e)
        with self._lock:
            entry.ready, entry.error = ready, error
            entry.done.set()
            drop = entry.discard or self.closed
            if error is not None:
                self._failures += 1
                self._paused_until = time.monotonic() + min(60.0, 2.0**self._failures)
                if entry in self._stock:
                    self._stock.remove(entry)
            else:
                self._failures = 0
            if drop and entry in self._stock:
                self._stock.remove(entry)
            self._threads.discard(threading.current_thread())
        if drop and ready is not None:
            ready.stop()
            return
        with self._lock:
            if not self.closed:
                self._fill()

    def _stop_later(self, entry: _Entry) -> None:
        """(Under the lock.) Stop an unwanted ready sandbox in the background (close() waits for it)."""

        def run() -> None:
            self._drop(entry)
            with self._lock:
                self._threads.discard(threading.current_thread())

        t = threading.Thread(target=run, name="warm-stop", daemon=True)
        self._threads.add(t)
        t.start()

    def _drop(self, entry: _Entry) -> None:
        """Stop an entry's sandbox now if started, else once its start ends."""
        with self._lock:
            entry.discard = True
            ready = entry.ready if entry.done.is_set() else None
            entry.ready = None
        if ready is not None:
            ready.stop()


def interleave(lists: Iterable[list[T]]) -> list[T]:
    """[[a, b], [c]] -> [a, c, b]"""
    return [x for x in chain.from_iterable(zip_longest(*lists)) if x is not None]
