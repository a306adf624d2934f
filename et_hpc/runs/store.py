"""The run store: episode records as parquet shards in one directory per run, on a shared filesystem.

``<root>/<run_name>/`` holds ``run.json`` (config and plan) and ``part-*.parquet`` shards. Writing
needs no lock: a shard is written under a hidden ``.tmp-`` name, fsynced and renamed (atomic, also
on NFS/Lustre), so any number of writers may share a run and readers never see half a file;
pyarrow, pandas and ``datasets`` read a run directory as-is. Duplicates (a unit redone after a
crash, a compaction between its two steps) are resolved by readers: ``RunStore.read()`` returns
one row per unit, ``ok`` before errors, then the newest ``created_at``. Shards and ``run.json``:
``shards.py``; groups: ``groups.py``; compaction: ``compaction.py``; the layout: docs/store.md.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from pydantic import BaseModel

from et_hpc.errors import UserError
from et_hpc.paths import store_dir
from et_hpc.record import EPISODE_SCHEMA, STATUSES, EpisodeRecord, records_from_table, records_to_table, write_failed_record
from et_hpc.record import solved as is_solved
from et_hpc.runs.compaction import CompactResult, compact_run
from et_hpc.runs.groups import GROUP_COLS as GROUP_COLS  # the names' old home: re-exported
from et_hpc.runs.groups import (
    GROUP_EXTRA_COLS,
    GROUP_READ_COLS,
    Group,
    GroupCounts,
    count_groups,
    groups_of,
    select_groups,
)
from et_hpc.runs.groups import GROUP_ID_SCHEMA as GROUP_ID_SCHEMA
from et_hpc.runs.groups import ON_ERROR as ON_ERROR
from et_hpc.runs.groups import OnError as OnError
from et_hpc.runs.groups import group_key as group_key
from et_hpc.runs.groups import legacy_group as legacy_group
from et_hpc.runs.passk import Evaluation, evaluate
from et_hpc.runs.shards import (  # noqa: F401  (re-exported: the names' old home)
    COMPRESSION,
    DEDUPE_COLS,
    DEFAULT_TARGET_ROWS,
    PART_PREFIX,
    RUN_CONFIG,
    STALE_TMP_S,
    TMP_PREFIX,
    UNIT_COLS,
    UNIT_SCHEMA,
    WRITE_ATTEMPTS,
    WRITE_RETRY_S,
    StoreWriteError,
    dedupe_units,
    first_per_key,
    read_run_config,
    write_run_config,
    write_table_atomic,
)

log = logging.getLogger(__name__)


class RunSummary(BaseModel):
    """Counts of one run after dedupe (one row per unit)."""

    run_name: str
    path: str
    shards: int
    rows: int  # before dedupe
    units: int  # after dedupe
    by_status: dict[str, int]
    ok: int
    solved: int  # ok with reward >= 1
    pass_rate: float | None  # solved / ok
    mean_reward: float | None  # over ok units
    mean_test_fraction: float | None  # mean passed/total over ok units with tests
    planned_units: int | None = None  # ``plan.units_total`` of run.json, when present
    groups: GroupCounts | None = None  # sampled groups (group_id); see docs/store.md ("Groups")
    evaluation: Evaluation | None = None  # pass@1 with its 95% interval and pass@k (et_hpc.runs.passk)


class RunStore:
    """One run's directory. Cheap to create; touches the filesystem only when used."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.name = self.path.name
        self._keys_cache: dict[str, pa.Table] = {}  # shard name -> its unit keys (shards never change)
        self._keys_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RunStore({str(self.path)!r})"

    # --- writing -------------------------------------------------------------------------------
    def write(self, records: list[EpisodeRecord], attempts: int = WRITE_ATTEMPTS) -> Path | None:
        """Write ``records`` as one new shard; returns its path (``None`` for an empty list).

        A failing write (a full or flaky filesystem, a record that does not serialise) is tried
        ``attempts`` times, with a short pause between; then ``StoreWriteError`` says why."""
        if not records:
            return None
        last: BaseException | None = None
        for i in range(max(1, attempts)):
            if i:
                time.sleep(WRITE_RETRY_S * i)
            try:
                self.path.mkdir(parents=True, exist_ok=True)
                return write_table_atomic(self.path, records_to_table(list(records)))
            except Exception as e:  # noqa: BLE001 - any cause is retried, then reported with it
                last = e
                log.warning(
                    "run store %s: writing %d record(s) failed (attempt %d of %d): %s: %s",
                    self.path,
                    len(records),
                    i + 1,
                    attempts,
                    type(e).__name__,
                    e,
                )
        raise StoreWriteError(f"{type(last).__name__}: {last}") from last

    def write_or_error(self, records: list[EpisodeRecord]) -> tuple[Path | None, str | None]:
        """Write ``records``; when that fails after its retries, write one ``infra_error`` record
        per episode instead (``write_failed_record``: the unit is then visible and redone on
        resume). Returns (the shard, the cause of the failure or None). Raises StoreWriteError
        only when even the error records cannot be written."""
        try:
            return self.write(records), None
        except StoreWriteError as e:
            cause = str(e)
        log.error("run store %s: %s; writing error records instead", self.path, cause)
        return self.write([write_failed_record(r, cause) for r in records]), cause

    def write_config(self, config: dict[str, Any]) -> Path:
        """Store the run config (atomically replaces an earlier one)."""
        return write_run_config(self.path, config)

    def config(self) -> dict[str, Any] | None:
        return read_run_config(self.path)

    # --- reading -------------------------------------------------------------------------------
    def shards(self) -> list[Path]:
        """Finished shards, oldest name first (names start with the UTC write time)."""
        try:
            names = [e.name for e in os.scandir(self.path) if e.name.startswith(PART_PREFIX) and e.name.endswith(".parquet")]
        except FileNotFoundError:
            return []
        return [self.path / n for n in sorted(names)]

    def _read_raw(self, columns: list[str] | None) -> pa.Table:
        """All rows of all shards; retries when a shard vanishes under us (a concurrent compact)."""
        last: Exception | None = None
        for attempt in range(20):
            files = self.shards()
            if not files:
                return EPISODE_SCHEMA.empty_table().select(columns or EPISODE_SCHEMA.names)
            try:
                dataset = ds.dataset([str(f) for f in files], schema=EPISODE_SCHEMA, format="parquet")
                return dataset.to_table(columns=columns)
            except (FileNotFoundError, OSError, pa.ArrowInvalid) as e:
                if all(f.exists() for f in files):
                    _raise_bad_shard(files, e)
                last = e
                log.debug("shard vanished while reading %s (attempt %d), relisting", self.path, attempt)
                time.sleep(0.05 * (attempt + 1))
        raise RuntimeError(f"shards of {self.path} kept vanishing while reading: {last}")

    def read(self, columns: list[str] | None = None, dedupe: bool = True) -> pa.Table:
        """The run's records as an Arrow table with ``EPISODE_SCHEMA`` (or the chosen ``columns``).

        With ``dedupe`` (default) there is one row per unit ``(task_id, sample)``: the newest ``ok``
        record, else the newest error record. Rows keep storage order (shard by shard).
        ``dedupe=False`` returns every row of every shard, including copies a concurrent
        ``compact`` may briefly expose.
        """
        if columns is not None:
            unknown = [c for c in columns if c not in EPISODE_SCHEMA.names]
            if unknown:
                raise UserError(f"unknown column(s) {unknown}; known: {', '.join(EPISODE_SCHEMA.names)}")
        if not dedupe:
            return self._read_raw(columns)
        want = list(columns) if columns is not None else list(EPISODE_SCHEMA.names)
        extra = [c for c in DEDUPE_COLS if c not in want]
        table = self._read_raw(want + extra)
        return dedupe_units(table).select(want)

    def _unit_keys(self) -> pa.Table:
        """``task_id, sample, status`` of every row, reading each shard once per process.

        Shards never change after their rename, so their keys are cached by name; a long-lived
        process polling ``units()`` only reads new shards. Tiny per-shard reads run in a thread
        pool (on a shared filesystem they wait on I/O, not CPU).
        """
        with self._keys_lock:
            return self._unit_keys_locked()

    def _unit_keys_locked(self) -> pa.Table:
        cache = self._keys_cache
        for attempt in range(20):
            files = self.shards()
            names = {f.name for f in files}
            for gone in [n for n in cache if n not in names]:
                del cache[gone]
            todo = [f for f in files if f.name not in cache]
            missing = False

            def one(f: Path) -> tuple[str, pa.Table | None]:
                try:
                    with pq.ParquetFile(f) as pf:
                        return f.name, pf.read(columns=UNIT_COLS, use_threads=False)
                except FileNotFoundError:
                    return f.name, None
                except (OSError, pa.ArrowException) as e:
                    raise UserError(
                        f"shard {f} is not a readable parquet file ({str(e).splitlines()[0][:200]}); move it out of the run directory"
                    ) from e

            with ThreadPoolExecutor(max_workers=min(16, max(1, len(todo)))) as ex:
                for name, t in ex.map(one, todo):
                    if t is None:
                        missing = True
                    else:
                        cache[name] = t.cast(UNIT_SCHEMA)
            if not missing:
                parts = [cache[f.name] for f in files]
                return pa.concat_tables(parts) if parts else UNIT_SCHEMA.empty_table()
            time.sleep(0.05 * (attempt + 1))  # a compaction replaced shards under us: relist
        raise RuntimeError(f"shards of {self.path} kept vanishing while reading")

    def records(self) -> list[EpisodeRecord]:
        """The deduped records as ``EpisodeRecord`` objects (convenient for small runs)."""
        return records_from_table(self.read())

    def units(self) -> dict[tuple[str, int], str]:
        """Status of every unit that has a record: ``{(task_id, sample): status}``; ``ok`` wins."""
        t = self._unit_keys()
        out: dict[tuple[str, int], str] = {}
        for task, sample, status in zip(t.column("task_id").to_pylist(), t.column("sample").to_pylist(), t.column("status").to_pylist()):
            key = (task, sample)
            if out.get(key) != "ok":
                out[key] = status
        return out

    def groups(self) -> tuple[pa.Table, list[Group]]:
        """The deduped table (all columns) and its groups (``Group.rows`` index into it)."""
        table = self.read()
        return table, groups_of(table)

    def select(
        self,
        on_error: str = "mask",
        drop_zero_variance: bool = False,
        columns: list[str] | None = None,
        require_tokens: bool = False,
        exclude_cancelled: bool = False,
    ) -> tuple[pa.Table, list[Group], GroupCounts]:
        """What a trainer may train on: ok episodes of the selected groups (see ``select_groups``).

        Returns the table of those episodes (grouped, groups in first-seen order, members by
        sample), the selected groups (``rows`` index into the returned table) and the counts.
        """
        want = list(columns) if columns is not None else list(EPISODE_SCHEMA.names)
        table = self.read(list(dict.fromkeys(want + GROUP_READ_COLS + GROUP_EXTRA_COLS)))
        kept, counts = select_groups(groups_of(table), on_error, drop_zero_variance, require_tokens, exclude_cancelled)
        order = [r for g in kept for r in g.rows]
        out = table.take(pa.array(order, type=pa.int64())).select(want)
        pos = 0
        renumbered = []
        for g in kept:
            n = len(g.rows)
            renumbered.append(g.model_copy(update={"rows": list(range(pos, pos + n))}))
            pos += n
        return out, renumbered, counts

    def summary(self) -> RunSummary:
        raw = self._read_raw(list(dict.fromkeys(list(DEDUPE_COLS) + GROUP_READ_COLS + GROUP_EXTRA_COLS + ["passed", "total"])))
        t = dedupe_units(raw)
        statuses = t.column("status").to_pylist()
        by_status = {s: 0 for s in STATUSES}
        for s in statuses:
            by_status[s] = by_status.get(s, 0) + 1
        ok_mask = pc.equal(t.column("status"), "ok")
        ok_t = t.filter(ok_mask)
        rewards = [r for r in ok_t.column("reward").to_pylist() if r is not None]
        fracs = [p / n for p, n in zip(ok_t.column("passed").to_pylist(), ok_t.column("total").to_pylist()) if p is not None and n]
        n_solved = sum(1 for r in rewards if is_solved(r))
        plan = (self.config() or {}).get("plan")
        planned = plan.get("units_total") if isinstance(plan, dict) else None
        return RunSummary(
            run_name=self.name,
            path=str(self.path),
            shards=len(self.shards()),
            rows=raw.num_rows,
            units=t.num_rows,
            by_status=by_status,
            ok=ok_t.num_rows,
            solved=n_solved,
            pass_rate=(n_solved / ok_t.num_rows) if ok_t.num_rows else None,
            mean_reward=(sum(rewards) / len(rewards)) if rewards else None,
            mean_test_fraction=(sum(fracs) / len(fracs)) if fracs else None,
            planned_units=planned,
            groups=count_groups(groups_of(t)),
            evaluation=evaluate(zip(t.column("task_id").to_pylist(), statuses, t.column("reward").to_pylist())),
        )

    def compact(self, target_rows: int = DEFAULT_TARGET_ROWS, progress: bool = False) -> CompactResult:
        return compact(self, target_rows=target_rows, progress=progress)


def _raise_bad_shard(files: list[Path], err: Exception) -> None:
    """Name the shard that cannot be read (a user can move it away), else re-raise ``err``."""
    for f in files:
        try:
            pq.read_metadata(f).schema.to_arrow_schema()
        except FileNotFoundError:
            continue
        except (OSError, pa.ArrowException) as e:
            raise UserError(
                f"shard {f} is not a readable parquet file ({str(e).splitlines()[0][:200]}); move it out of the run directory"
            ) from e
    raise err


def compact(run: RunStore | Path | str, target_rows: int = DEFAULT_TARGET_ROWS, progress: bool = False) -> CompactResult:
    """Merge small shards of ``run`` into shards of about ``target_rows`` rows (see ``compaction.py``)."""
    return compact_run(run if isinstance(run, RunStore) else RunStore(run), target_rows=target_rows, progress=progress)


class Store:
    """The store root: one directory per run (default ``$ET_HPC_STORE`` or ``./et-hpc-runs``)."""

    def __init__(self, root: Path | str | None = None) -> None:
        self.root = Path(root) if root is not None else store_dir()

    def run(self, name: str) -> RunStore:
        if not name or "/" in name or name.startswith((".", "_")) or name in (".", ".."):
            raise UserError(f"bad run name {name!r}: use letters, digits, '-', '_' (not starting with '.' or '_')")
        return RunStore(self.root / name)

    def runs(self) -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(self.root) if e.is_dir() and not e.name.startswith((".", "_")))
        except FileNotFoundError:
            return []


def open_run(path: Path | str) -> RunStore:
    """A ``RunStore`` for an existing run directory given by the user, or a one-line ``UserError``."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"run directory {p} does not exist; pass a run folder inside the store (e.g. et-hpc-runs/<run>)")
    if not p.is_dir():
        raise UserError(f"{p} is not a directory; pass a run folder inside the store (e.g. et-hpc-runs/<run>)")
    rs = RunStore(p)
    if not rs.shards() and not (p / RUN_CONFIG).exists():
        runs = Store(p).runs()
        hint = f" (it holds runs: {', '.join(runs[:5])}; pass one of them)" if runs else ""
        raise UserError(f"{p} is not a run directory: no part-*.parquet or {RUN_CONFIG}{hint}")
    return rs
