"""The trainer's side of a continuous run: complete groups in arrival order, each once per consumer.

``RolloutStream(run_dir, consumer=...)`` reads the stream slots the queue publishes. Guarantees:
a group is handed out again only if its batch was not committed (``commit(state=...)``, or the
next ``next_batch`` with ``auto_commit``), so the trainer's ``state`` and the cursor move
together across restarts; one process per consumer name; what a trainer must not get (stale,
masked, incomplete, without exact tokens: ``et_hpc.runs.groups.untrainable``) is counted in the
cursor, never delivered nor dropped silently; a poll reads only new slots. Slots survive store
compactions; a slot that went missing anyway is a ``StreamGapError``, never an endless wait.
Cursor, filters and telemetry: docs/rollouts.md.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import filelock
import pyarrow.parquet as pq

from et_hpc.errors import UserError
from et_hpc.record import EpisodeRecord, records_from_table
from et_hpc.rollouts.queue import WorkQueue, slot_name
from et_hpc.rollouts.versions import PolicyVersion, VersionReader, publish_version, version_step
from et_hpc.runs.groups import group_of_records, untrainable
from et_hpc.runs.shards import read_run_config
from et_hpc.util import atomic_write_text


@dataclass
class RolloutGroup:
    """One complete group: the episodes of one task in one epoch under one policy version."""

    seq: int
    group_id: str
    task_id: str
    policy_version: str | None
    records: list[EpisodeRecord]
    committed_at: float  # when the slot appeared (its file's mtime)
    received_at: float = field(default_factory=time.time)
    position: int | None = None  # its place in the run's version log (its oldest member's), None: not placed

    @property
    def rewards(self) -> list[float | None]:
        return [r.reward for r in self.records]

    @property
    def reward_rule(self) -> str | None:
        """The rule the rewards follow (``binary`` or ``fraction``; None in records before schema 6)."""
        return next((r.reward_rule for r in self.records if r.reward_rule), None)

    @property
    def version(self) -> int | None:
        """The number its version label names (``version_step``: the trainer's integer, a step), for
        display; staleness counts places in the version log (``position``)."""
        return version_step(self.policy_version)

    def scored_data(self) -> dict[str, Any]:
        """Atropos-shaped: ``tokens``, ``masks`` (-100 off the completions), ``scores``,
        ``inference_logprobs`` per ok member, plus ``group_id`` and ``dropped_no_tokens``.

        A group is never handed out with tokens it does not have: when an ok member has no exact
        token ids (absent, or drifting from the server's tokenization) the whole group is dropped
        (empty lists) and ``dropped_no_tokens`` counts those members; a trainer skips it.
        """
        out: dict[str, Any] = {
            "tokens": [],
            "masks": [],
            "scores": [],
            "inference_logprobs": [],
            "group_id": self.group_id,
            "reward_rule": self.reward_rule,
            "dropped_no_tokens": 0,
        }
        ok = [r for r in self.records if r.status == "ok"]
        missing = sum(not r.has_tokens for r in ok)
        if missing:
            out["dropped_no_tokens"] = missing
            return out
        for r in ok:
            tokens, masks, lps = r.token_sequence()
            out["tokens"].append(tokens)
            out["masks"].append(masks)
            out["scores"].append(float(r.reward or 0.0))
            out["inference_logprobs"].append(lps)
        return out


def run_endpoint(run_dir: Path) -> tuple[str | None, str | None]:
    """``policy.endpoint_file`` and ``policy.endpoint_dir`` of the run's ``run.json`` (None, None without)."""
    try:
        pol = ((read_run_config(run_dir) or {}).get("config") or {}).get("policy") or {}
    except (OSError, UserError, AttributeError):
        return None, None
    return pol.get("endpoint_file"), pol.get("endpoint_dir")


# the cursor's counts: every slot read is exactly one of them
COUNTS = ("delivered", "discarded_stale", "discarded_masked", "discarded_incomplete", "discarded_no_tokens")


class StreamGapError(UserError):
    """The consumer's next stream slot is gone while later ones exist (removed by hand, or by an
    older et-hpc's compaction): the stream cannot go on in order."""


def fresh_telemetry() -> dict[str, Any]:
    """A consumer's telemetry before its first ``next_batch`` (see the module docstring)."""
    return {"calls": 0, "wait_s": 0.0, "first_call_at": None, "last_return_at": None, "staleness": {}}


class RolloutStream:
    """Complete groups of a run for one consumer (see the module docstring)."""

    def __init__(
        self,
        run_dir: Path | str,
        consumer: str = "trainer-0",
        *,
        auto_commit: bool = True,
        poll_s: float = 0.2,
        endpoint_file: Path | str | None = None,
        endpoint_dir: Path | str | None = None,
    ):
        self.run_dir = Path(run_dir)
        if endpoint_file is None and endpoint_dir is None:
            endpoint_file, endpoint_dir = run_endpoint(self.run_dir)
        self._versions = VersionReader(self.run_dir, endpoint_file=endpoint_file, endpoint_dir=endpoint_dir)
        if not consumer or "/" in consumer or consumer.startswith("."):
            raise UserError(f"consumer name {consumer!r}: use letters, digits, '-', '_' and '.'")
        self.consumer = consumer
        self.auto_commit = auto_commit
        self.poll_s = poll_s
        self.queue = WorkQueue(self.run_dir)
        cdir = self.run_dir / "consumers"
        cdir.mkdir(parents=True, exist_ok=True)
        self.cursor_path = cdir / f"{consumer}.json"
        self._lock = filelock.FileLock(str(cdir / f".{consumer}.lock"))
        try:
            self._lock.acquire(timeout=0)
        except filelock.Timeout:
            raise UserError(
                f"consumer {consumer!r} of {self.run_dir} is open in another process: use another consumer name, or stop that process"
            ) from None
        saved = self._read_cursor()
        self.committed: dict[str, Any] = saved
        self.next_seq = int(saved["next_seq"])
        self.counts = {k: int(saved.get(k, 0)) for k in COUNTS}
        self.state: Any = saved.get("state")
        self.telemetry = fresh_telemetry()
        self.telemetry.update(saved.get("telemetry") or {})
        self._dirty = False

    def close(self) -> None:
        if self._lock.is_locked:
            self._lock.release()

    def __enter__(self) -> RolloutStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------ cursor
    def _read_cursor(self) -> dict[str, Any]:
        try:
            d = json.loads(self.cursor_path.read_text())
            int(d["next_seq"])
            return d
        except FileNotFoundError:
            return {"next_seq": 0}
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(
                f"cursor {self.cursor_path} is unreadable ({e}): delete it to start this consumer from the first group"
            ) from None

    def commit(self, state: Any = None) -> None:
        """Persist the cursor (and ``state``, JSON): groups handed out so far are never handed out again."""
        if state is not None:
            self.state = state
        data = {
            "consumer": self.consumer,
            "next_seq": self.next_seq,
            **self.counts,
            "state": self.state,
            "telemetry": self.telemetry,
            "committed_at": time.time(),
        }
        atomic_write_text(self.cursor_path, json.dumps(data) + "\n")
        self.committed = data
        self._dirty = False

    # ------------------------------------------------------------ reading
    def _read_slot(self, seq: int) -> RolloutGroup | None:
        p = self.run_dir / slot_name(seq)
        try:
            mtime = os.stat(p).st_mtime
            table = pq.read_table(p)
        except FileNotFoundError:
            self._check_gap(seq)
            return None
        recs = records_from_table(table)
        recs.sort(key=lambda r: r.sample)
        first = recs[0]
        return RolloutGroup(
            seq=seq, group_id=first.group_id, task_id=first.task_id, policy_version=first.policy_version, records=recs, committed_at=mtime
        )

    def _check_gap(self, seq: int) -> None:
        """Slot ``seq`` is absent: fine while it is still to come; a ``StreamGapError`` when the
        publishers are past it (the head hint, or a later slot, exists: slots are gapless)."""
        if self.queue.read_head() <= seq and not (self.run_dir / slot_name(seq + 1)).exists():
            return
        if (self.run_dir / slot_name(seq)).exists():
            return  # published between the two looks
        raise StreamGapError(
            f"stream slot {slot_name(seq)} of {self.run_dir} is missing while later groups exist "
            f"(published: {self.queue.read_head()}): it was removed; consumer {self.consumer!r} cannot go on in order. "
            f"Restore the file, or set next_seq in {self.cursor_path} past it to skip it"
        )

    def current_version(self) -> PolicyVersion | None:
        """The run's current version: the trainer's ``version.json``, else the server's endpoint file."""
        return self._versions.current()

    def next_batch(
        self,
        n_groups: int,
        timeout_s: float | None = None,
        max_staleness: int | None = None,
        on_error: str = "mask",
        require_tokens: bool = True,
    ) -> list[RolloutGroup]:
        """Up to ``n_groups`` trainable groups, oldest first; waits up to ``timeout_s`` (None: until
        there are ``n_groups``, or the run stopped and the stream is drained). May return fewer.
        ``require_tokens=False`` also delivers groups without exact token ids (for evaluation)."""
        if on_error not in ("mask", "keep-ok"):
            raise UserError(f"on_error {on_error!r}: use mask or keep-ok")
        if n_groups < 1:
            raise UserError(f"n_groups {n_groups}: ask for at least 1")
        if self.auto_commit and self._dirty:
            self.commit()
        called = time.time()
        try:
            out = self._next(n_groups, timeout_s, max_staleness, on_error, require_tokens)
        finally:
            self._record_call(called, time.time())
        self._record_staleness(out)
        return out

    def _record_call(self, called: float, returned: float) -> None:
        tm = self.telemetry
        tm["calls"] += 1
        tm["wait_s"] += max(0.0, returned - called)
        if tm["first_call_at"] is None:
            tm["first_call_at"] = called
        tm["last_return_at"] = returned

    def _record_staleness(self, groups: list[RolloutGroup]) -> None:
        if not groups:
            return
        cur = self.current_version()
        hist = self.telemetry["staleness"]
        for g in groups:
            k = "unknown" if cur is None or cur.position is None or g.position is None else str(max(0, cur.position - g.position))
            hist[k] = hist.get(k, 0) + 1

    def _place(self, g: RolloutGroup) -> int | None:
        """The group's place in the version log: its oldest member's (a member that cannot be placed: None)."""
        places = [self._versions.place(r.policy_version) for r in g.records]
        return None if any(p is None for p in places) else min(p for p in places if p is not None)

    def _stale(self, g: RolloutGroup, max_staleness: int) -> bool:
        """More than ``max_staleness`` publishes behind the newest, or a version that cannot be placed
        while the run has versions (refused, never fresh)."""
        cur = self.current_version()
        if cur is None or cur.position is None:
            return False
        return g.position is None or cur.position - g.position > max_staleness

    def _next(
        self, n_groups: int, timeout_s: float | None, max_staleness: int | None, on_error: str, require_tokens: bool
    ) -> list[RolloutGroup]:
        end = None if timeout_s is None else time.monotonic() + timeout_s
        out: list[RolloutGroup] = []
        while len(out) < n_groups:
            g = self._read_slot(self.next_seq)
            if g is None:
                if end is not None and time.monotonic() >= end:
                    break
                if end is None and self.queue.stopped() and not self._producing():
                    break
                time.sleep(self.poll_s if end is None else max(0.0, min(self.poll_s, end - time.monotonic())))
                continue
            self.next_seq += 1
            self._dirty = True
            g.position = self._place(g)
            why = self._discard(g, max_staleness, on_error, require_tokens)
            if why is not None:
                self.counts[f"discarded_{why}"] += 1
                continue
            if any(r.status != "ok" for r in g.records):  # keep-ok: its ok members only
                g.records = [r for r in g.records if r.status == "ok"]
            self.counts["delivered"] += 1
            out.append(g)
        return out

    def _discard(self, g: RolloutGroup, max_staleness: int | None, on_error: str, require_tokens: bool) -> str | None:
        """Why ``g`` is not delivered (a ``COUNTS`` suffix), or None."""
        if max_staleness is not None and self._stale(g, max_staleness):
            return "stale"
        why = untrainable(group_of_records(g.records), on_error, require_tokens)
        return None if why is None else str(why)

    def _producing(self) -> bool:
        """Leased units may still commit after a stop request was written."""
        return self.queue.count()["leased"] > 0

    def stats(self) -> dict[str, Any]:
        return {
            "consumer": self.consumer,
            "next_seq": self.next_seq,
            **self.counts,
            "published": self.queue.published(),
            "reward_rule": self.reward_rule(),
            "telemetry": self.telemetry,
        }

    def reward_rule(self) -> str | None:
        """The run's reward rule (``reward`` of run.json's config: binary or fraction)."""
        try:
            return ((read_run_config(self.run_dir) or {}).get("config") or {}).get("reward")
        except (UserError, AttributeError):
            return None

    # ------------------------------------------------------------ talking to producers
    def publish_version(self, version: int | None = None, *, model: str | None = None, checkpoint: str | None = None) -> PolicyVersion:
        """A new checkpoint (trainer-owned switch): groups started from now on carry it."""
        return publish_version(self.run_dir, version, model=model, checkpoint=checkpoint)

    def request_stop(self, reason: str = "the trainer has enough") -> None:
        """Ask the run to stop: workers give their units back, the controller ends the run."""
        self.queue.request_stop(f"{self.consumer}: {reason}")
