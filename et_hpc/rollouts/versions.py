"""The policy version of a run, whichever side owns the checkpoint switch, ordered by its log.

Every publish appends to the run's version log (``et_hpc.runs.version_log``): ``publish_version``
(the trainer; it also writes ``<run_dir>/version.json``, versions only go up), and every label an
endpoint file shows (``et-hpc model serve``'s ``NAME@sha256-...``, ``vllm.sbatch``'s ``PATH@step-N``
or ``PATH@files-HASH``), appended by ``VersionReader`` when it first sees it. ``VersionReader.current``
is the log's newest entry; staleness is the distance between places (``staleness``), so labels
need no step to order. ``version_step`` only parses a label for display. Formats: docs/rollouts.md.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from et_hpc.errors import UserError
from et_hpc.runs.version_log import SERVER, SWITCHING, TRAINER, UNVERSIONED, LogEntry, VersionLog, label_of, mark_source
from et_hpc.util import atomic_write_text

__all__ = ["SWITCHING", "UNVERSIONED", "PolicyVersion", "VersionReader", "label_of", "publish_version", "read_version", "version_step"]

log = logging.getLogger(__name__)

VERSION_FILE = "version.json"
RACY_S = 2.0  # a file's stat proves it unchanged only once its mtime is older than this
_STEP = re.compile(r"@step-(\d+)\b")


def version_step(label: int | str | None) -> int | None:
    """The number a label names, for display only (ordering uses the log): an integer, or N of
    ``...@step-N``; during a switch the older one; None otherwise."""
    s = label_of(label)
    if s is None:
        return None
    if s.isdigit():
        return int(s)
    m = _STEP.search(s)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class PolicyVersion:
    version: int  # the trainer's integer; for a server label its place in the log
    model: str | None = None
    checkpoint: str | None = None
    published_at: float | None = None
    label: str | None = None  # what records carry (the trainer's integer as a string, or the endpoint's model_version)
    source: str = TRAINER  # "trainer" (publish_version) or "endpoint" (a server's endpoint file)
    position: int | None = None  # its place in the run's version log: what staleness counts

    @property
    def name(self) -> str:
        return self.label if self.label is not None else str(self.version)

    @classmethod
    def of(cls, e: LogEntry) -> PolicyVersion:
        trainer = e.source == TRAINER
        return cls(
            version=int(e.label) if trainer else e.pos,
            model=e.model,
            checkpoint=e.checkpoint,
            published_at=e.published_at,
            label=e.label,
            source=TRAINER if trainer else "endpoint",
            position=e.pos,
        )


def version_path(run_dir: Path | str) -> Path:
    return Path(run_dir) / VERSION_FILE


def read_version(run_dir: Path | str) -> PolicyVersion | None:
    """The trainer's last publish (``version.json``), None before it."""
    p = version_path(run_dir)
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise UserError(f"{p} is not valid JSON ({e}): publish a version again to rewrite it") from None
    v = int(d["version"])
    return PolicyVersion(version=v, model=d.get("model"), checkpoint=d.get("checkpoint"), published_at=d.get("published_at"), label=str(v))


def publish_version(
    run_dir: Path | str, version: int | None = None, *, model: str | None = None, checkpoint: str | None = None
) -> PolicyVersion:
    """Tell producers about a new checkpoint (the trainer owns the switch). ``version`` default:
    current + 1 (first: 1). Appended to the run's version log; groups started from now on carry
    it. A lower version than the current one is refused (UserError); the same one only updates
    model/checkpoint. The run's ``run.json`` then says ``versions.source: trainer``."""
    cur = read_version(run_dir)
    if version is None:
        version = (cur.version + 1) if cur else 1
    if cur is not None and version < cur.version:
        raise UserError(f"version {version} is older than the run's current version {cur.version}: versions only go up")
    now = time.time()
    e = VersionLog(run_dir).append(int(version), source=TRAINER, published_at=now, model=model, checkpoint=checkpoint, by="publish_version")
    assert e is not None
    pv = PolicyVersion.of(e)
    atomic_write_text(
        version_path(run_dir), json.dumps({"version": pv.version, "model": model, "checkpoint": checkpoint, "published_at": now}) + "\n"
    )
    mark_source(run_dir, TRAINER)
    return pv


def _endpoint_paths(endpoint_file: Path | str | None, endpoint_dir: Path | str | None) -> list[Path]:
    paths: list[Path] = []
    if endpoint_file:
        paths.append(Path(endpoint_file).expanduser())
    if endpoint_dir:
        try:
            paths += sorted(p for p in Path(endpoint_dir).expanduser().glob("*.json") if not p.name.startswith("."))
        except OSError:
            pass
    return paths


class VersionReader:
    """``current()``: the newest entry of the run's version log, after appending every label the
    endpoint file (or a directory of replicas, oldest file first) shows that the log does not
    hold yet. Files are re-read only when their stat changed, so checking before every claim is
    cheap. ``place(label)`` and ``staleness(label)`` count places in the log."""

    def __init__(self, run_dir: Path | str, *, endpoint_file: Path | str | None = None, endpoint_dir: Path | str | None = None):
        self.run_dir = Path(run_dir)
        self.path = version_path(run_dir)
        self.log = VersionLog(run_dir)
        self.endpoint_file = endpoint_file
        self.endpoint_dir = endpoint_dir
        self._seen: dict[Path, tuple[int, int, int]] = {}
        self._warned: set[str] = set()

    def observe(self) -> None:
        """Append the labels the endpoint files show now (a trainer-owned run appends none)."""
        from et_hpc.agent.endpoint import read_endpoint_file

        if not self.log.entries() and self.path.exists():  # a run from before the log: its trainer version first
            old = read_version(self.run_dir)
            if old is not None:
                self.log.append(old.version, source=TRAINER, published_at=old.published_at, model=old.model, by=VERSION_FILE)
        found: list[tuple[float, str, Path, dict]] = []
        for p in _endpoint_paths(self.endpoint_file, self.endpoint_dir):
            try:
                st = os.stat(p)
            except OSError:
                continue
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
            if self._seen.get(p) == key and time.time() - st.st_mtime > RACY_S:
                continue  # unchanged (a file rewritten within RACY_S may reuse inode, size and a coarse mtime: read it)
            try:
                rec = read_endpoint_file(p)
            except (OSError, UserError, ValueError):
                continue
            label = label_of((rec or {}).get("model_version"))
            if rec is None:
                continue  # half-written: look again next time
            self._seen[p] = key
            if label is not None:
                found.append((st.st_mtime, label, p, rec))
        for mtime, label, p, rec in sorted(found, key=lambda x: x[0]):
            if self.log.entry(label) is None:
                self.log.append(label, source=SERVER, published_at=mtime, model=rec.get("model"), checkpoint=label.split("@")[0], by=str(p))

    def current(self) -> PolicyVersion | None:
        self.observe()
        e = self.log.current()
        return None if e is None else PolicyVersion.of(e)

    def place(self, label: int | str | None) -> int | None:
        """The label's place in the log (0: ``unversioned``), None when it cannot be placed (warned once)."""
        p = self.log.place(label)
        if p is None and label is not None:
            self.observe()
            p = self.log.place(label)
        if p is None and str(label) not in self._warned:
            self._warned.add(str(label))
            log.warning("version %r is not in %s: it cannot be placed, so it counts as stale, never as fresh", label, self.log.path)
        return p

    def staleness(self, label: int | str | None) -> int | None:
        """How many publishes the label is behind the newest; None when it cannot be placed or
        nothing was published."""
        cur = self.log.current()
        if cur is None:
            return None
        p = self.place(label)
        return None if p is None else max(0, cur.pos - p)
