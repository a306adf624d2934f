"""The work queue of a continuous run: unit files on the shared filesystem, claimed by rename.

A unit is one group (the ``samples`` episodes of one task in one epoch). Guarantees: every
transition of a unit is a ``rename`` of its one file (pending, leased, done), so a unit is in
exactly one place, only the attempt still holding its lease commits it, and it is done exactly
once, whoever dies when; publishing a committed group into the gapless stream slots
``part-s<seq>.parquet`` is idempotent and anyone may finish it. Needs a filesystem with atomic
``rename`` and ``link`` (local or NFS) and node clocks within a fraction of ``lease_s``. Layout,
transitions and publishing: docs/rollouts.md.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from et_hpc.runs.shards import STREAM_SLOT_PREFIX
from et_hpc.util import atomic_write_text, fsync_dir

log = logging.getLogger(__name__)

SLOT_PREFIX = STREAM_SLOT_PREFIX  # the store never compacts these (et_hpc.runs.shards.is_stream_slot)
SLOT_DIGITS = 10
SEP = "~"
LIST_TTL_S = 5.0


def slot_name(seq: int) -> str:
    return f"{SLOT_PREFIX}{seq:0{SLOT_DIGITS}d}.parquet"


def new_worker_id() -> str:
    host = socket.gethostname().split(".")[0].replace("~", "_").replace("-", "_") or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass
class Unit:
    """One queued group: task ``task_id``, epoch ``epoch``, ``samples`` episodes numbered from
    ``base`` (taken from the run's sample counter; older units: ``epoch * samples``)."""

    uid: str
    task_id: str
    epoch: int
    pos: int
    samples: int
    enqueued_at: float = field(default_factory=time.time)
    base: int | None = None

    @property
    def group_id(self) -> str:
        return f"{self.task_id}@e{self.epoch}"

    def sample_index(self, i: int) -> int:
        return (self.epoch * self.samples if self.base is None else self.base) + i

    def to_json(self) -> str:
        return json.dumps(self.__dict__, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Unit:
        d = json.loads(text)
        return cls(**{k: d[k] for k in ("uid", "task_id", "epoch", "pos", "samples", "enqueued_at", "base") if k in d})


def unit_uid(epoch: int, pos: int) -> str:
    return f"e{epoch:06d}-{pos:06d}"


@dataclass
class Lease:
    """A claimed unit: ``path`` is the lease file, ``attempt`` names this claim."""

    unit: Unit
    attempt: str
    path: Path
    claimed_at: float = field(default_factory=time.time)


class WorkQueue:
    """The unit files of one run (see the module docstring). Safe to use from many processes."""

    def __init__(self, run_dir: Path | str, lease_s: float = 60.0, grace_s: float | None = None):
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / "queue"
        self.pending = self.root / "pending"
        self.leased = self.root / "leased"
        self.done = self.root / "done"
        self.results = self.root / "results"
        self.workers = self.root / "workers"
        self.lease_s = float(lease_s)
        self.grace_s = float(grace_s if grace_s is not None else lease_s)
        self._cand: list[str] = []
        self._cand_at = 0.0
        self._claim_lock = threading.Lock()

    # ------------------------------------------------------------ setup
    def exists(self) -> bool:
        return self.root.is_dir()

    def init(self) -> WorkQueue:
        for d in (self.pending, self.leased, self.done, self.results, self.workers):
            d.mkdir(parents=True, exist_ok=True)
        return self

    # ------------------------------------------------------------ epochs (controller)
    def read_state(self) -> dict[str, Any]:
        try:
            return json.loads((self.root / "state.json").read_text())
        except (FileNotFoundError, ValueError):
            return {"next_epoch": 0, "enqueuing": None}

    def write_state(self, state: dict[str, Any]) -> None:
        atomic_write_text(self.root / "state.json", json.dumps(state) + "\n")

    def enqueue_epoch(self, task_ids: list[str], samples: int, seed: int = 0, min_sample: int = 0) -> int:
        """Queue the next epoch: every task once, in an order shuffled by (seed, epoch).

        Each unit's samples come from the run's shared counter (``et_hpc.runs.groups.take_samples``,
        at least ``min_sample``: the store's highest sample + 1), so a restart with another
        ``samples``, or another writer of the run, never reuses a unit key. Idempotent under a
        controller crash: the epoch is marked as being enqueued first, and a restarted controller
        re-enqueues only the units of that epoch that exist nowhere.
        """
        from et_hpc.runs.groups import take_samples

        state = self.read_state()
        epoch = state["enqueuing"] if state.get("enqueuing") is not None else state["next_epoch"]
        recovering = state.get("enqueuing") is not None
        if not recovering:
            state["enqueuing"] = epoch
            self.write_state(state)
        # units of an older layout (no counter) numbered epoch * samples + i: stay above them
        floor = max(min_sample, int(state.get("next_epoch", 0)) * int(state.get("samples") or 0))
        order = list(task_ids)
        random.Random(f"{seed}:{epoch}").shuffle(order)
        known = self._known_uids() if recovering else set()
        now = time.time()
        for pos, tid in enumerate(order):
            uid = unit_uid(epoch, pos)
            if uid in known:
                continue
            base = take_samples(self.run_dir, tid, samples, floor)[0]
            u = Unit(uid=uid, task_id=tid, epoch=epoch, pos=pos, samples=samples, enqueued_at=now, base=base)
            tmp = self.pending / f".{uid}.{secrets.token_hex(3)}.tmp"
            tmp.write_text(u.to_json())
            os.rename(tmp, self.pending / f"{uid}.json")
        fsync_dir(self.pending)
        state = {"next_epoch": epoch + 1, "enqueuing": None, "samples": samples, "tasks": len(order)}
        self.write_state(state)
        return epoch

    def _known_uids(self) -> set[str]:
        out = set()
        for d in (self.pending, self.leased, self.done):
            for name in _names(d):
                if name.endswith(".json") and not name.startswith("."):
                    out.add(name[:-5].split(SEP)[0])
        return out

    # ------------------------------------------------------------ counting
    def pending_names(self) -> list[str]:
        return sorted(n for n in _names(self.pending) if n.endswith(".json") and not n.startswith("."))

    def count(self) -> dict[str, int]:
        c = {"pending": 0, "leased": 0, "done": 0}
        for k, d in (("pending", self.pending), ("leased", self.leased), ("done", self.done)):
            c[k] = sum(1 for n in _names(d) if n.endswith(".json") and not n.startswith("."))
        return c

    # ------------------------------------------------------------ claim / heartbeat / release / commit
    def claim(self, worker: str, spread: int = 2) -> Lease | None:
        """Take one pending unit (about the oldest); None when the queue is empty or stopped."""
        if self.stopped():
            return None
        with self._claim_lock:  # the cached listing is shared by a worker's slots
            return self._claim(worker, spread)

    def _claim(self, worker: str, spread: int) -> Lease | None:
        # The listing is cached (a claim costs one rename, not a directory listing) and refreshed
        # when used up or older than LIST_TTL_S; a name another worker took fails with ENOENT.
        now = time.monotonic()
        if not self._cand or now - self._cand_at > LIST_TTL_S:
            self._cand, self._cand_at = self.pending_names(), now
        names = self._cand
        relisted = False
        while True:
            if not names:
                if relisted:
                    return None
                relisted = True
                names = self._cand = self.pending_names()
                self._cand_at = time.monotonic()
                if not names:
                    return None
            # one of the oldest few, picked at random, so racing workers rarely collide
            i = random.randrange(min(spread, len(names)))
            name = names.pop(i)
            uid = name[:-5]
            attempt = f"{worker}.{secrets.token_hex(3)}"
            dst = self.leased / f"{uid}{SEP}{attempt}.json"
            try:
                os.rename(self.pending / name, dst)
            except FileNotFoundError:
                continue  # another worker took it
            os.utime(dst)  # the lease starts now, not when the unit was enqueued
            try:
                unit = Unit.from_json(dst.read_text())
            except (OSError, ValueError, TypeError, KeyError) as e:
                log.error("unit file %s is unreadable (%s); moved aside", dst, e)
                os.rename(dst, self.root / f"bad-{uid}.json")
                continue
            return Lease(unit=unit, attempt=attempt, path=dst)
        return None

    def heartbeat(self, lease: Lease) -> bool:
        """Renew the lease; False when it is gone (expired and requeued, or committed elsewhere)."""
        try:
            os.utime(lease.path)
            return True
        except FileNotFoundError:
            return False

    def release(self, lease: Lease) -> bool:
        """Give the unit back to the queue (stopped, abandoned). False when it was no longer ours."""
        try:
            os.rename(lease.path, self.pending / f"{lease.unit.uid}.json")
            return True
        except FileNotFoundError:
            return False

    def results_path(self, lease: Lease) -> Path:
        return self.results / f"{lease.unit.uid}{SEP}{lease.attempt}.parquet"

    def commit(self, lease: Lease, table: pa.Table) -> int | None:
        """Write the group's records and commit the unit; returns its stream slot.

        None when the lease was lost before the commit (the records are discarded: another
        attempt does the unit). The commit is the rename ``leased -> done``.
        """
        res = self.results_path(lease)
        tmp = self.results / f".tmp-{res.name}"
        with open(tmp, "xb") as f:
            pq.write_table(table, f, compression="lz4")
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, res)
        try:
            os.rename(lease.path, self.done / f"{lease.unit.uid}{SEP}{lease.attempt}.json")
        except FileNotFoundError:
            res.unlink(missing_ok=True)
            return None
        fsync_dir(self.done)
        return self.publish(res)

    # ------------------------------------------------------------ publication into the stream
    def publish(self, res: Path) -> int | None:
        """Link a committed results file into the next free stream slot (see module docstring)."""
        take = res.with_name(f"{res.name.split('.take-')[0]}.take-{secrets.token_hex(4)}")
        try:
            os.rename(res, take)
        except FileNotFoundError:
            return None  # someone else is publishing it (or did)
        try:
            if os.stat(take).st_nlink >= 2:  # already in a slot
                return None
            seq = self.read_head()
            while True:
                try:
                    os.link(take, self.run_dir / slot_name(seq))
                    break
                except FileExistsError:
                    seq += 1
                except FileNotFoundError:
                    return None  # a sweep took it over from us
            fsync_dir(self.run_dir)
            self.write_head(seq + 1)
            return seq
        finally:
            try:
                os.unlink(take)
            except FileNotFoundError:
                pass

    def read_head(self) -> int:
        try:
            return int((self.root / "head").read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def write_head(self, seq: int) -> None:
        if seq > self.read_head():
            try:
                atomic_write_text(self.root / "head", f"{seq}\n")
            except OSError:  # only a hint
                pass

    def published(self) -> int:
        """Groups in the stream (slots 0..n-1), found from the head hint."""
        seq = self.read_head()
        while seq > 0 and not (self.run_dir / slot_name(seq - 1)).exists():
            seq -= 1
        while (self.run_dir / slot_name(seq)).exists():
            seq += 1
        return seq

    # ------------------------------------------------------------ sweeping (anyone, any time)
    def sweep(self, now: float | None = None) -> dict[str, int]:
        """Requeue expired leases, finish interrupted publications, drop orphaned results."""
        now = time.time() if now is None else now
        out = {"requeued": 0, "published": 0, "dropped": 0}
        for name in _names(self.leased):
            if not name.endswith(".json") or name.startswith("."):
                continue
            p = self.leased / name
            try:
                age = now - p.stat().st_mtime
            except FileNotFoundError:
                continue
            if age > self.lease_s:
                uid = name[:-5].split(SEP)[0]
                try:
                    os.rename(p, self.pending / f"{uid}.json")
                    out["requeued"] += 1
                    log.warning("lease %s expired (%.0f s without a heartbeat): unit requeued", name, age)
                except FileNotFoundError:
                    pass
        for name in _names(self.results):
            if name.startswith("."):
                if name.startswith(".tmp-") and _age(self.results / name, now) > max(self.grace_s, 3600):
                    (self.results / name).unlink(missing_ok=True)
                continue
            p = self.results / name
            if _age(p, now) <= self.grace_s:
                continue
            base = name.split(".take-")[0]  # <uid>~<attempt>.parquet
            stem = base[: -len(".parquet")]
            if (self.done / f"{stem}.json").exists():
                if self.publish(p) is not None:
                    out["published"] += 1
            elif not (self.leased / f"{stem}.json").exists():
                # an attempt that lost its lease before committing: its records are not the unit's
                p.unlink(missing_ok=True)
                out["dropped"] += 1
        return out

    # ------------------------------------------------------------ stop and workers
    def stop_path(self) -> Path:
        return self.root / "STOP"

    def stopped(self) -> bool:
        return self.stop_path().exists()

    def request_stop(self, reason: str = "stop requested") -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.stop_path(), json.dumps({"reason": reason, "at": time.time()}) + "\n")

    def clear_stop(self) -> None:
        self.stop_path().unlink(missing_ok=True)

    def stop_reason(self) -> str | None:
        try:
            return json.loads(self.stop_path().read_text()).get("reason")
        except FileNotFoundError:
            return None
        except ValueError:
            return "stop file present"

    def write_worker(self, worker: str, info: dict[str, Any]) -> None:
        try:
            atomic_write_text(self.workers / f"{worker}.json", json.dumps(info) + "\n")
        except OSError as e:
            log.warning("worker file not written: %s", e)

    def live_workers(self, now: float | None = None) -> list[dict[str, Any]]:
        now = time.time() if now is None else now
        out = []
        for name in _names(self.workers):
            if not name.endswith(".json") or name.startswith("."):
                continue
            p = self.workers / name
            try:
                st = p.stat()
                info = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            if now - st.st_mtime <= self.lease_s and not info.get("exited"):
                out.append(info)
        return out

    def done_times(self) -> list[float]:
        out = []
        for name in _names(self.done):
            try:
                out.append((self.done / name).stat().st_mtime)
            except FileNotFoundError:
                pass
        return out

    def status(self, window_s: float = 600.0) -> dict[str, Any]:
        """Queue counts, live workers and throughput over the last ``window_s`` (for et-hpc status)."""
        now = time.time()
        c = self.count()
        recent = [t for t in self.done_times() if now - t <= window_s]
        workers = self.live_workers(now)
        state = self.read_state()
        span = min(window_s, now - min(recent)) if recent else 0.0
        per_group = int(state.get("samples") or 1)
        return {
            "pending": c["pending"],
            "leased": c["leased"],
            "done": c["done"],
            "published": self.published(),
            "epochs": state.get("next_epoch", 0),
            "workers_live": len(workers),
            "groups_per_min": round(60 * len(recent) / span, 2) if span > 0 else None,
            "episodes_per_min": round(60 * len(recent) * per_group / span, 2) if span > 0 else None,
            "stopped": self.stop_reason(),
        }


def _names(d: Path) -> Iterator[str]:
    try:
        with os.scandir(d) as it:
            for e in it:
                yield e.name
    except FileNotFoundError:
        return


def _age(p: Path, now: float) -> float:
    try:
        return now - p.stat().st_mtime
    except OSError as e:
        if e.errno == errno.ENOENT:
            return -1.0
        raise
