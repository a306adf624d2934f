"""Shards of a run: the atomic write of one parquet shard, the one-row-per-unit rule, and run.json.

``write_table_atomic`` writes under a hidden ``.tmp-`` name, fsyncs and renames to ``part-...``.
``dedupe_units`` keeps one row per ``(task_id, sample)``: ``ok`` first, then the newest
``created_at``. ``read_run_config`` and ``write_run_config`` are the only reader and writer of a
run's ``run.json``.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from et_hpc.errors import InfraError, UserError
from et_hpc.record import EPISODE_SCHEMA
from et_hpc.util import atomic_open, atomic_write_text

log = logging.getLogger(__name__)

RUN_CONFIG = "run.json"
PART_PREFIX = "part-"
STREAM_SLOT_PREFIX = "part-s"  # a continuous run's stream slot part-s<seq>.parquet (never compacted)
TMP_PREFIX = ".tmp-"
STALE_TMP_S = 3600.0
DEFAULT_TARGET_ROWS = 16384
# lz4 reads about twice as fast as zstd here (shards are read far more often than written);
# dictionary encoding only for the repetitive columns (not transcripts, ids or token lists).
COMPRESSION = "lz4"
_DICT_COLS = [
    n
    for n in EPISODE_SCHEMA.names
    if n not in ("episode_id", "messages", "prompt_token_ids", "token_ids", "logprobs", "error", "created_at")
]
UNIT_COLS = ["task_id", "sample", "status"]
UNIT_SCHEMA = pa.schema([EPISODE_SCHEMA.field(c) for c in UNIT_COLS])
DEDUPE_COLS = ("task_id", "sample", "status", "created_at", "episode_id")
WRITE_ATTEMPTS = 3  # tries of one shard write before it is reported as failed
WRITE_RETRY_S = 0.2  # pause before the 2nd try (twice that before the 3rd)


class StoreWriteError(InfraError):
    """Records could not be written to the run store, after retries; the message says why."""


def _shard_name() -> str:
    now = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    host = socket.gethostname().split(".")[0].replace("-", "_") or "host"
    return f"{PART_PREFIX}{now}-{host}-{os.getpid()}-{secrets.token_hex(4)}.parquet"


def is_stream_slot(name: str) -> bool:
    """``part-s<digits>.parquet``: a stream slot of a continuous run (other shards start with a date)."""
    return name.startswith(STREAM_SLOT_PREFIX) and name[len(STREAM_SLOT_PREFIX) : -len(".parquet")].isdigit()


def write_table_atomic(directory: Path, table: pa.Table, name: str | None = None) -> Path:
    """Write ``table`` as a new shard in ``directory``: hidden temp name, fsync, atomic rename."""
    name = name or _shard_name()
    final = directory / name
    with atomic_open(final, tmp_name=f"{TMP_PREFIX}{name}") as f:
        pq.write_table(table, f, compression=COMPRESSION, use_dictionary=_DICT_COLS)
    return final


def write_run_config(run_dir: Path, config: dict[str, Any]) -> Path:
    """Store a run's config and plan as ``run.json`` (atomically replaces an earlier one)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    p = run_dir / RUN_CONFIG
    atomic_write_text(p, json.dumps(config, indent=2, default=str) + "\n")
    return p


def read_run_config(run_dir: Path) -> dict[str, Any] | None:
    """A run's ``run.json``, None when it has none; a one-line ``UserError`` when it is not JSON."""
    p = run_dir / RUN_CONFIG
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as e:
        raise UserError(f"{p} is not valid JSON ({e}); rewrite it or delete it") from e


def dedupe_units(table: pa.Table) -> pa.Table:
    """One row per ``(task_id, sample)``: ``ok`` first, then newest ``created_at``, then ``episode_id``."""
    return first_per_key(table, ["task_id", "sample"])


def first_per_key(table: pa.Table, keys: list[str]) -> pa.Table:
    """The best row of each key (``ok`` first, newest ``created_at`` next), in storage order."""
    if table.num_rows <= 1:
        return table
    not_ok = pc.cast(pc.not_equal(table.column("status"), "ok"), pa.int8())
    keyed = table.select(list(dict.fromkeys(keys + ["created_at", "episode_id"]))).append_column("__not_ok", not_ok)
    order = pc.sort_indices(
        keyed,
        sort_keys=[(k, "ascending") for k in keys] + [("__not_ok", "ascending"), ("created_at", "descending"), ("episode_id", "ascending")],
    )
    n = len(order)
    differs = None
    for k in keys:
        col = pc.take(keyed.column(k), order)
        d = pc.not_equal(col.slice(1), col.slice(0, n - 1))
        differs = d if differs is None else pc.or_(differs, d)
    first = pa.concat_arrays([pa.array([True]), pa.chunked_array(differs).combine_chunks()])
    keep = pc.filter(order, first)
    if len(keep) == n:
        return table  # no duplicates: no copy
    return table.take(pc.take(keep, pc.array_sort_indices(keep)))
