"""Many policy servers (vLLM replicas) from one directory of endpoint files, shared by a whole process.

``replica_set(dir)`` returns the process's one ``ReplicaSet`` for ``policy.endpoint_dir`` (one
endpoint file per server job, ``<dir>/<job id>.json``). It rescans at most every ``refresh_s``,
rereads a file only when it changed, ignores unsafe or unreadable files with one warning, and
probes a new server before it gets work. ``acquire`` gives an episode the least loaded live
replica, which it keeps until ``mark_dead``; ``inflight`` counts requests across threads. Keys
are held in memory only and never logged. Details: docs/policy.md, "Replicas".
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

from et_hpc.agent.endpoint import NO_KEY, parse_endpoint, probe_models, resolve_api_key
from et_hpc.errors import UserError

log = logging.getLogger(__name__)

NEW, LIVE, DEAD, GONE = "new", "live", "dead", "gone"
MAX_FILE_BYTES = 1 << 16


Sig = tuple[int, int, int, int]


def _sig(st: os.stat_result) -> Sig:
    """What tells a rewritten (or re-moded) file: inode, size, mtime, ctime."""
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(eq=False)
class Replica:
    """One server: its endpoint file, what the file says, and what this process knows about it."""

    name: str  # the file name without .json (the job id for vllm.sbatch)
    path: Path
    sig: Sig  # inode, size, mtime_ns of the file last read
    base_url: str
    model: str | None = None
    model_version: str | None = None
    served_model: str | None = None  # the versioned alias the server also answers to (et_hpc.agent.served)
    job_id: str | None = None
    api_key: str = field(default=NO_KEY, repr=False)
    state: str = NEW  # new (not probed yet), live, dead, gone (its file was removed)
    why: str = ""  # why it is dead
    outstanding: int = 0  # requests in flight, from every thread of the process
    episodes: int = 0  # episodes on it now
    assigned: int = 0  # episodes given to it (offset when it joins; for fair ties)
    checked_at: float = 0.0  # monotonic time of the last probe or death
    probing: bool = False

    def label(self) -> str:
        return f"{self.name} ({self.base_url})"


class _Published(TypedDict):
    """What a replica's endpoint file says (the fields of ``Replica`` it sets)."""

    base_url: str
    model: str | None
    model_version: str | None
    served_model: str | None
    job_id: str | None
    api_key: str


class ReplicaSet:
    """The replicas of one endpoint directory (see the module docstring). Thread-safe."""

    def __init__(
        self,
        directory: Path,
        *,
        api_key: str | None = None,
        api_key_env: str | None = None,
        probe_timeout_s: float = 5.0,
        refresh_s: float = 1.0,
        reprobe_dead_s: float = 30.0,
    ):
        self.directory = Path(directory).expanduser()
        self._api_key, self._api_key_env = api_key, api_key_env
        self.probe_timeout_s = probe_timeout_s
        self.refresh_s = refresh_s
        self.reprobe_dead_s = reprobe_dead_s
        self.replicas: dict[str, Replica] = {}
        self.ignored: dict[str, tuple[Sig, str]] = {}  # name -> (sig, why) of bad files
        self.reads = 0  # endpoint files read (the rest of a scan is stat only)
        self.probes = 0
        self._listed_at = float("-inf")
        self._warned: set[tuple[str, Sig]] = set()
        self._lock = threading.Lock()
        self._rng = random.Random()

    # -- the directory -----------------------------------------------------------------------
    def _load(self, path: Path) -> tuple[dict | None, str]:
        """(record, "") or (None, why the file is ignored)."""
        self.reads += 1
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError as e:
            return None, f"cannot be read ({e.strerror})"
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                return None, "is not a regular file"
            if st.st_uid != os.getuid():
                return None, f"belongs to uid {st.st_uid}, not you (only your own server jobs' files are used)"
            if st.st_mode & 0o077:
                return None, (
                    f"can be read by others (mode {stat.S_IMODE(st.st_mode):04o}): run `chmod 600 {path}` "
                    "and restart that server job (its key may be known)"
                )
            text = f.read(MAX_FILE_BYTES).decode("utf-8", errors="replace")
        data = parse_endpoint(text)
        if data is None:
            return None, "is not an endpoint record (JSON with base_url, or host and port)"
        return data, ""

    def _scan(self) -> None:
        """Bring ``replicas`` in line with the directory (lock held)."""
        self._listed_at = time.monotonic()
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            entries = []
        except OSError as e:
            self._warn_once("", (0, 0, 0, 0), f"endpoint directory {self.directory} cannot be listed ({e.strerror})")
            entries = []
        seen = set()
        for entry in entries:
            if entry.name.startswith(".") or not entry.name.endswith(".json"):
                continue
            name = entry.name[:-5]
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            sig = _sig(st)
            seen.add(name)
            rep = self.replicas.get(name)
            if (rep is not None and rep.sig == sig) or self.ignored.get(name, (None,))[0] == sig:
                continue
            path = Path(entry.path)
            data, why = self._load(path)
            if data is None:
                self.ignored[name] = (sig, why)
                self._warn_once(name, sig, f"ignoring endpoint file {path}: it {why}")
                if rep is not None:
                    self._drop(rep, f"its endpoint file {why}")
                continue
            self.ignored.pop(name, None)
            self._update(name, path, sig, data, rep)
        for name in [n for n in self.replicas if n not in seen]:
            self._drop(self.replicas[name], "its endpoint file was removed")
        for name in [n for n in self.ignored if n not in seen]:
            del self.ignored[name]

    def _update(self, name: str, path: Path, sig: Sig, data: dict, rep: Replica | None) -> None:
        job, version = data.get("job_id"), data.get("model_version")
        fields = _Published(
            base_url=str(data["base_url"]).rstrip("/"),
            model=data.get("model"),
            model_version=None if version is None else str(version),
            served_model=data["served_model"] if isinstance(data.get("served_model"), str) else None,
            job_id=None if job is None else str(job),
            api_key=resolve_api_key(self._api_key, self._api_key_env, data),
        )
        if rep is None:
            rep = self.replicas[name] = Replica(name=name, path=path, sig=sig, **fields)
            log.info("policy server %s found", rep.label())
            return
        moved = (fields["base_url"], fields["api_key"]) != (rep.base_url, rep.api_key)
        for k, v in fields.items():
            setattr(rep, k, v)
        rep.sig = sig
        if rep.state == DEAD or moved:  # rewritten: a restarted or moved server; probe it before use
            rep.state = NEW

    def _drop(self, rep: Replica, why: str) -> None:
        rep.state, rep.why = GONE, why
        self.replicas.pop(rep.name, None)
        log.info("policy server %s dropped: %s", rep.label(), why)

    def _warn_once(self, name: str, sig: Sig, msg: str) -> None:
        if (name, sig) not in self._warned:
            self._warned.add((name, sig))
            log.warning("%s", msg)

    # -- probing -----------------------------------------------------------------------------
    def refresh(self, force: bool = False) -> None:
        """Scan the directory (at most every ``refresh_s`` unless ``force``) and probe what needs it."""
        now = time.monotonic()
        with self._lock:
            if force or now - self._listed_at >= self.refresh_s:
                self._scan()
            due = [
                r
                for r in self.replicas.values()
                if not r.probing and (r.state == NEW or (r.state == DEAD and now - r.checked_at >= self.reprobe_dead_s))
            ]
            for r in due:
                r.probing = True  # one prober at a time per replica
            jobs = [(r, r.sig, r.base_url, r.api_key, r.state) for r in due]
        for r, sig, url, key, was in jobs:
            self.probes += 1
            ok, model, what = probe_models(url, timeout=self.probe_timeout_s, api_key=key)
            with self._lock:
                r.probing = False
                if r.sig != sig or r.state != was:
                    continue  # rewritten or changed meanwhile: the next refresh decides
                if ok:
                    r.state, r.why = LIVE, ""
                    r.model = r.model or model
                    self._join(r)
                    log.info("policy server %s is live%s", r.label(), " again" if was == DEAD else "")
                else:
                    r.state, r.why, r.checked_at = DEAD, f"GET /models: {what}", time.monotonic()
                    if was == NEW:
                        log.warning("policy server %s does not answer: %s", r.label(), r.why)

    def _join(self, rep: Replica) -> None:
        """A replica that (re)joins starts level with the least used live one."""
        others = [r.assigned for r in self.replicas.values() if r.state == LIVE and r is not rep]
        rep.assigned = max(rep.assigned, min(others)) if others else rep.assigned

    # -- assignment --------------------------------------------------------------------------
    def acquire(self, wait_s: float = 0.0, poll_s: float = 0.5) -> Replica | None:
        """A live replica for a new episode (see the module docstring), waiting at most ``wait_s``; None if none."""
        deadline = time.monotonic() + wait_s
        force = False
        while True:
            self.refresh(force=force)
            with self._lock:
                live = [r for r in self.replicas.values() if r.state == LIVE]
                if live:
                    best = min((r.outstanding, r.assigned) for r in live)
                    pick = self._rng.choice([r for r in live if (r.outstanding, r.assigned) == best])
                    pick.assigned += 1
                    pick.episodes += 1
                    return pick
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(poll_s, left))
            force = True

    def release(self, rep: Replica) -> None:
        """The episode on ``rep`` ended or moved away."""
        with self._lock:
            rep.episodes = max(0, rep.episodes - 1)

    @contextlib.contextmanager
    def inflight(self, rep: Replica) -> Iterator[None]:
        """Count one request to ``rep`` as outstanding while the block runs."""
        with self._lock:
            rep.outstanding += 1
        try:
            yield
        finally:
            with self._lock:
                rep.outstanding -= 1

    def mark_dead(self, rep: Replica, why: str) -> None:
        """Give ``rep`` no more work until its file is rewritten or a later probe answers."""
        with self._lock:
            if rep.state in (LIVE, NEW):
                rep.state, rep.why, rep.checked_at = DEAD, why, time.monotonic()
                log.warning("policy server %s marked dead: %s", rep.label(), why)

    def usable(self, rep: Replica) -> bool:
        """Whether an episode may keep sending to ``rep`` (not dead, its file not gone)."""
        self.refresh()
        return rep.state in (LIVE, NEW)

    def current(self, rep: Replica) -> Replica:
        """``rep`` with its file re-read when it changed (one ``stat`` otherwise): a new
        ``model_version``, address or key."""
        try:
            st = os.stat(rep.path, follow_symlinks=False)
        except OSError:
            return rep  # gone: the next scan drops it; the last record is what was served
        if _sig(st) != rep.sig:
            with self._lock:
                self._scan()
        return rep

    def version(self, rep: Replica) -> str | None:
        return self.current(rep).model_version

    # -- reporting ---------------------------------------------------------------------------
    def describe(self) -> str:
        """What is in the directory, for an error message (no keys)."""
        with self._lock:
            parts = [f"{r.name}: {r.state}{': ' + r.why if r.why else ''}" for r in self.replicas.values()]
            parts += [f"{n}.json: ignored, it {why}" for n, (_, why) in self.ignored.items()]
        return "; ".join(parts) if parts else "no endpoint files"

    def wait_live(self, wait_s: float, poll_s: float = 2.0) -> None:
        """Return once a replica is live; raise ``UserError`` naming the directory after ``wait_s``."""
        deadline = time.monotonic() + wait_s
        force = False
        while True:
            self.refresh(force=force)
            with self._lock:
                if any(r.state == LIVE for r in self.replicas.values()):
                    return
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(poll_s, left))
            force = True
        raise UserError(
            f"no policy server in endpoint directory {self.directory} answered GET /models within {wait_s:g} s "
            f"({self.describe()}); start servers with `sbatch slurm/vllm.sbatch --endpoint-dir "
            f"{self.directory} MODEL`, or wait longer (policy.endpoint_wait_s)"
        )

    def stats(self) -> dict[str, dict]:
        """Per replica: state, outstanding requests, episodes now and assigned (no keys)."""
        with self._lock:
            return {
                r.name: {
                    "state": r.state,
                    "base_url": r.base_url,
                    "outstanding": r.outstanding,
                    "episodes": r.episodes,
                    "assigned": r.assigned,
                }
                for r in self.replicas.values()
            }


_SETS: dict[tuple, ReplicaSet] = {}
_SETS_LOCK = threading.Lock()


def replica_set(directory: Path, *, api_key: str | None = None, api_key_env: str | None = None) -> ReplicaSet:
    """The process's one ``ReplicaSet`` for ``directory`` (and key fallback)."""
    key = (str(Path(directory).expanduser().absolute()), api_key, api_key_env)
    with _SETS_LOCK:
        rs = _SETS.get(key)
        if rs is None:
            rs = _SETS[key] = ReplicaSet(Path(key[0]), api_key=api_key, api_key_env=api_key_env)
        return rs
