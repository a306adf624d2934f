"""A run's version log: every policy version in the order it was published, one place per label.

``<run_dir>/versions.jsonl`` holds one JSON object per line (``pos``, ``label``, ``source``,
``published_at``, ``model``, ``checkpoint``, ``by``). ``VersionLog.append`` adds a label under a
lock file (``filelock``: fcntl locks, which NFS serves) and rewrites the file by temp file + rename,
so readers on any node see the old log or the new one, never part of one. A label already in the
log keeps its place. Staleness counts places, so hashes, paths, aliases, steps and integers all
order; ``place`` of a label the log does not hold is None (a caller refuses it: never fresh).
Once the trainer published (source ``trainer``) the run is trainer-owned and server labels are no
longer appended. Format and rules: docs/rollouts.md ("Policy versions").
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import filelock

from et_hpc.errors import UserError
from et_hpc.util import atomic_write_text

VERSION_LOG = "versions.jsonl"
UNVERSIONED = "unversioned"  # before the trainer's first publish: place 0, older than every entry
SWITCHING = "switching "  # vllm.sbatch's label while it switches: "switching OLD -> NEW"
TRAINER, SERVER = "trainer", "server"
LOCK_WAIT_S = 60.0


@dataclass(frozen=True)
class LogEntry:
    pos: int  # 1, 2, 3, ...: its place in the log
    label: str
    source: str  # "trainer" (publish_version, et-hpc rollouts publish) or "server" (an endpoint file)
    published_at: float
    model: str | None = None
    checkpoint: str | None = None
    by: str | None = None  # who appended it: "publish_version", or the endpoint file observed


def label_of(label: int | str | None) -> str | None:
    """The label a record carries, as the log keys it: integers as their decimal string; during a
    switch (``switching OLD -> NEW``) the older one; None for None or an empty label."""
    if label is None:
        return None
    if isinstance(label, bool):
        raise TypeError("a version label is an integer or a string, not a bool")
    s = str(label).strip()
    if s.startswith(SWITCHING):
        s = s[len(SWITCHING) :].split(" -> ")[0].strip()
    return s or None


def log_path(run_dir: Path | str) -> Path:
    return Path(run_dir) / VERSION_LOG


class VersionLog:
    """The version log of one run directory (see the module docstring); re-read only when its stat changed."""

    def __init__(self, run_dir: Path | str):
        self.run_dir = Path(run_dir)
        self.path = log_path(run_dir)
        self._key: tuple[int, int, int] | None = None
        self._entries: list[LogEntry] = []
        self._by_label: dict[str, LogEntry] = {}

    # ------------------------------------------------------------ reading
    def entries(self) -> list[LogEntry]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._key, self._entries, self._by_label = None, [], {}
            return []
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        if key != self._key:
            self._entries = self._parse(self.path.read_text(encoding="utf-8"))
            self._by_label = {e.label: e for e in reversed(self._entries)}  # the first place wins
            self._key = key
        return self._entries

    def _parse(self, text: str) -> list[LogEntry]:
        out: list[LogEntry] = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                out.append(LogEntry(**{k: d.get(k) for k in LogEntry.__dataclass_fields__}))
            except (ValueError, TypeError) as e:
                raise UserError(f"{self.path} line {n} is not a version entry ({e}): restore the file from its last good state") from None
        return out

    def current(self) -> LogEntry | None:
        """The newest entry (None: nothing published yet)."""
        es = self.entries()
        return es[-1] if es else None

    def entry(self, label: int | str | None) -> LogEntry | None:
        key = label_of(label)
        self.entries()
        return None if key is None else self._by_label.get(key)

    def place(self, label: int | str | None) -> int | None:
        """The label's place: its entry's ``pos``, 0 for ``unversioned``, None when the log holds no such label."""
        key = label_of(label)
        if key == UNVERSIONED:
            return 0
        e = self.entry(key)
        return None if e is None else e.pos

    def owner(self) -> str | None:
        """``trainer`` once the trainer published, ``server`` with only endpoint labels, None when empty."""
        es = self.entries()
        if not es:
            return None
        return TRAINER if any(e.source == TRAINER for e in es) else SERVER

    # ------------------------------------------------------------ writing
    def append(
        self,
        label: int | str,
        *,
        source: str,
        published_at: float | None = None,
        model: str | None = None,
        checkpoint: str | None = None,
        by: str | None = None,
    ) -> LogEntry | None:
        """Add ``label`` at the end, unless the log holds it (then its entry, with ``model`` and
        ``checkpoint`` updated for a trainer label). A server label in a trainer-owned log is not
        added (None). A trainer label must be an integer above the trainer's last one and not a
        server's label (UserError)."""
        key = label_of(label)
        if key is None or key == UNVERSIONED:
            raise UserError(f"version label {label!r} cannot be published: give a non-empty label")
        if source == TRAINER and not key.lstrip("-").isdigit():
            raise UserError(f"trainer version {label!r}: give an integer")
        known = self.entry(key)
        if (
            known is not None
            and known.source == source
            and not (source == TRAINER and (model, checkpoint) != (known.model, known.checkpoint))
        ):
            return known
        if known is not None and source == SERVER:
            return known
        if source == SERVER and self.owner() == TRAINER:
            return None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(str(self.run_dir / f".{VERSION_LOG}.lock"))
        try:
            with lock.acquire(timeout=LOCK_WAIT_S):
                return self._append_locked(key, source, published_at, model, checkpoint, by)
        except filelock.Timeout:
            raise UserError(f"{self.path}: its lock was held for {LOCK_WAIT_S:g} s: is a publisher stuck?") from None

    def _append_locked(
        self, key: str, source: str, published_at: float | None, model: str | None, checkpoint: str | None, by: str | None
    ) -> LogEntry | None:
        self._key = None  # read afresh under the lock
        es = list(self.entries())
        known = self._by_label.get(key)
        if source == SERVER and (known is not None or any(e.source == TRAINER for e in es)):
            return known
        if source == TRAINER and known is not None and known.source != TRAINER:
            raise UserError(f"version {key} is already in {self.path} as a server's label: publish a higher version")
        if source == TRAINER:
            last = max((int(e.label) for e in es if e.source == TRAINER), default=None)
            if known is None and last is not None and int(key) < last:
                raise UserError(f"version {key} is older than the run's current version {last}: versions only go up")
        if known is not None:  # a trainer label again: new model/checkpoint, same place
            new = LogEntry(**{**asdict(known), "model": model, "checkpoint": checkpoint})
            es[known.pos - 1] = new
        else:
            new = LogEntry(len(es) + 1, key, source, published_at or time.time(), model, checkpoint, by)
            es.append(new)
        atomic_write_text(self.path, "".join(json.dumps(asdict(e)) + "\n" for e in es))
        self._key = None
        return new


def run_versions(run_dir: Path | str, endpoint_file: object = None, endpoint_dir: object = None) -> dict[str, str]:
    """``run.json``'s ``versions``: the log's name and the run's source, ``trainer`` once the
    trainer published, else ``server`` when the policy names an endpoint file or directory."""
    owner = VersionLog(run_dir).owner()
    return {"log": VERSION_LOG, "source": owner or (SERVER if endpoint_file or endpoint_dir else TRAINER)}


def mark_source(run_dir: Path | str, source: str) -> None:
    """Set ``versions.source`` in the run's ``run.json`` (when it has one and says otherwise)."""
    from et_hpc.runs.shards import read_run_config, write_run_config

    try:
        data = read_run_config(Path(run_dir))
    except UserError:
        return
    if not isinstance(data, dict) or (data.get("versions") or {}).get("source") == source:
        return
    data["versions"] = {**(data.get("versions") or {}), "log": VERSION_LOG, "source": source}
    write_run_config(Path(run_dir), data)
