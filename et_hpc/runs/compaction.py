"""Compaction: merge a run's small shards into big ones while others read and write the run.

A merged shard is written before its inputs are deleted, so readers never miss an episode; exact
duplicates (same ``episode_id``) are dropped; stale ``.tmp-`` files are removed; one compaction
of a run at a time (a file lock). A continuous run's stream slots (``part-s<seq>.parquet``, one
group each, read by ``RolloutStream`` by name) are never merged, moved or deleted.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import filelock
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from pydantic import BaseModel

from et_hpc.errors import UserError
from et_hpc.record import EPISODE_SCHEMA
from et_hpc.runs.shards import DEFAULT_TARGET_ROWS, STALE_TMP_S, TMP_PREFIX, first_per_key, is_stream_slot, write_table_atomic
from et_hpc.util import fsync_dir, progress_bar

if TYPE_CHECKING:
    from et_hpc.runs.store import RunStore

log = logging.getLogger(__name__)


class CompactResult(BaseModel):
    inputs: int
    outputs: int
    rows: int
    removed_tmp: int
    shards_after: int


def compact_run(rs: RunStore, target_rows: int = DEFAULT_TARGET_ROWS, progress: bool = False) -> CompactResult:
    """Merge small shards into shards of about ``target_rows`` rows, safely while others read/write.

    Each merged shard is written atomically *before* its inputs are deleted, so a reader never
    misses an episode (it may briefly see one twice; ``read()`` dedupes). Shards that writers
    add meanwhile are left for the next compaction. Exact duplicates (same ``episode_id``) are
    dropped while merging; other records of the same unit are kept. Stale ``.tmp-*`` files
    (older than an hour: a killed writer) are removed. Two compactions of one run do not overlap:
    the second fails with a ``UserError``.
    """
    if not rs.path.is_dir():
        raise UserError(f"run directory {rs.path} does not exist")
    if target_rows < 1:
        raise UserError("target_rows must be at least 1")
    lock = filelock.FileLock(str(rs.path / ".compact.lock"))
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout as e:
        raise UserError(f"another compaction of {rs.path} is running (lock {lock.lock_file}); wait for it") from e
    try:
        removed_tmp = _remove_stale_tmp(rs.path)
        files = [f for f in rs.shards() if not is_stream_slot(f.name)]
        sizes = _row_counts(files)
        small = [f for f in files if sizes.get(f, 0) < target_rows // 2 or sizes.get(f, 0) == 0]
        batches = _plan_batches(small, sizes, target_rows)
        batches = [b for b in batches if len(b) > 1]
        rows = 0
        bar = _progress(sum(len(b) for b in batches), progress)
        for batch in batches:
            table = ds.dataset([str(f) for f in batch], schema=EPISODE_SCHEMA, format="parquet").to_table()
            table = _drop_same_episode(table)
            write_table_atomic(rs.path, table)
            for f in batch:
                try:
                    f.unlink()
                except FileNotFoundError:
                    pass
            fsync_dir(rs.path)
            rows += table.num_rows
            bar.update(len(batch))
        bar.close()
        return CompactResult(
            inputs=sum(len(b) for b in batches),
            outputs=len(batches),
            rows=rows,
            removed_tmp=removed_tmp,
            shards_after=len(rs.shards()),
        )
    finally:
        lock.release()


def _progress(total: int, enabled: bool):
    return progress_bar(total=total, desc="compact", unit="shard", show=None if enabled and total else False)


def _remove_stale_tmp(path: Path, max_age_s: float = STALE_TMP_S) -> int:
    cutoff = time.time() - max_age_s
    n = 0
    for e in os.scandir(path):
        if e.name.startswith(TMP_PREFIX):
            try:
                if e.stat().st_mtime < cutoff:
                    os.unlink(e.path)
                    n += 1
                    log.info("removed stale temp shard %s", e.path)
            except FileNotFoundError:
                pass
    return n


def _row_counts(files: Iterable[Path]) -> dict[Path, int]:
    out: dict[Path, int] = {}
    for f in files:
        try:
            out[f] = pq.read_metadata(f).num_rows
        except FileNotFoundError:
            continue
    return out


def _plan_batches(files: list[Path], sizes: dict[Path, int], target_rows: int) -> list[list[Path]]:
    batches: list[list[Path]] = []
    cur: list[Path] = []
    rows = 0
    for f in files:
        if f not in sizes:
            continue
        cur.append(f)
        rows += sizes[f]
        if rows >= target_rows:
            batches.append(cur)
            cur, rows = [], 0
    if cur:
        batches.append(cur)
    return batches


def _drop_same_episode(table: pa.Table) -> pa.Table:
    if pc.count_distinct(table.column("episode_id")).as_py() == table.num_rows:
        return table
    return first_per_key(table, ["episode_id"])
