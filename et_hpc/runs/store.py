"""The run store: episode records as parquet shards in one directory per run, on a shared filesystem.

Layout::

    <root>/<run_name>/
        run.json                                   run config and plan, written at plan time
        part-<utc time>-<host>-<pid>-<rand>.parquet  one finished episode or a small batch each
        .tmp-part-...parquet                       a shard being written (never read)

Writing needs no lock, so any number of processes on any number of nodes can write into one run
at once: each shard is written under a hidden ``.tmp-`` name in the run directory, fsynced, then
renamed to its ``part-`` name (rename within a directory is atomic, also on NFS/Lustre). Readers
list only ``part-*.parquet``, so they never see a half-written file. Because names start with
``.``/``_`` or ``part-``, plain ``pyarrow.dataset.dataset(run_dir)``, ``pandas.read_parquet(run_dir)``
and ``datasets.load_dataset("parquet", data_files=".../part-*.parquet")`` read a run as-is.

Duplicates are expected and handled by readers, not prevented by writers:

- a process that crashed after writing its shard but before recording progress redoes the unit,
  so a unit ``(task_id, sample)`` can have several records;
- ``compact`` writes the merged shard first and deletes its inputs afterwards, so a reader that
  lists files between the two steps sees some episodes twice (same ``episode_id``).

``RunStore.read()`` therefore returns one row per unit by default: an ``ok`` record beats an error
record, and among equals the newest ``created_at`` wins (which also collapses exact duplicates).

Groups (the one place they are defined; exports and ``store summary`` use it): a group is what
was sampled together, key ``(run_name, group_id)``: a batch run's samples of one task
(``group_id = task_id``), one unit of a continuous run (``<task_id>@e<epoch>``), one
``collect_trajectories`` call of the Atropos environment (``<task_id>@s<first sample>``). Rows
written before schema version 4 whose ``group_id`` is just their ``task_id`` keep the older rule,
key ``(run_name, task_id, policy_version)`` (``policy_version`` None when the server names none):
those writers did not tell groups apart (``legacy_group``). GRPO-style trainers
normalise rewards within a group, so a member that failed for reasons outside the agent's reach
(any non-``ok`` status) biases the rest. ``select_groups`` decides what a trainer gets:

- ``on_error="mask"`` (default): a group with any error member is left out whole;
- ``on_error="keep-ok"``: its ``ok`` members are kept (the group is shorter);
- ``drop_zero_variance=True``: groups whose kept scores are all equal (no signal) are left out.

Counts (``GroupCounts``): ``complete`` groups have only ``ok`` members, ``masked`` groups have at
least one error member, ``zero_variance`` groups are complete with all scores equal.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, get_args

import filelock
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from pydantic import BaseModel

from et_hpc.errors import InfraError, UserError
from et_hpc.paths import store_dir
from et_hpc.record import EPISODE_SCHEMA, STATUSES, EpisodeRecord, records_to_table, write_failed_record
from et_hpc.record import solved as is_solved
from et_hpc.util import atomic_open, atomic_write_text, fsync_dir, progress_bar

log = logging.getLogger(__name__)

RUN_CONFIG = "run.json"
PART_PREFIX = "part-"
TMP_PREFIX = ".tmp-"
STALE_TMP_S = 3600.0
DEFAULT_TARGET_ROWS = 16384
# lz4 reads about twice as fast as zstd here (shards are read far more often than written);
# dictionary encoding only for the repetitive columns (not transcripts, ids or token lists).
COMPRESSION = "lz4"
_DICT_COLS = [
    n for n in EPISODE_SCHEMA.names
    if n not in ("episode_id", "messages", "prompt_token_ids", "token_ids", "logprobs", "error", "created_at")
]
_UNIT_COLS = ["task_id", "sample", "status"]
_UNIT_SCHEMA = pa.schema([EPISODE_SCHEMA.field(c) for c in _UNIT_COLS])
_DEDUPE_COLS = ("task_id", "sample", "status", "created_at", "episode_id")
WRITE_ATTEMPTS = 3  # tries of one shard write before it is reported as failed
WRITE_RETRY_S = 0.2  # pause before the 2nd try (twice that before the 3rd)


class StoreWriteError(InfraError):
    """Records could not be written to the run store, after retries; the message says why."""


def _shard_name() -> str:
    now = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    host = socket.gethostname().split(".")[0].replace("-", "_") or "host"
    return f"{PART_PREFIX}{now}-{host}-{os.getpid()}-{secrets.token_hex(4)}.parquet"


def write_table_atomic(directory: Path, table: pa.Table, name: str | None = None) -> Path:
    """Write ``table`` as a new shard in ``directory``: hidden temp name, fsync, atomic rename."""
    name = name or _shard_name()
    final = directory / name
    with atomic_open(final, tmp_name=f"{TMP_PREFIX}{name}") as f:
        pq.write_table(table, f, compression=COMPRESSION, use_dictionary=_DICT_COLS)
    return final


OnError = Literal["mask", "keep-ok"]
ON_ERROR: tuple[str, ...] = get_args(OnError)
GROUP_COLS = ["run_name", "group_id", "task_id", "policy_version", "schema_version"]
_GROUP_READ_COLS = GROUP_COLS + ["sample", "status", "reward"]
GROUP_ID_SCHEMA = 4  # rows written with this schema version or later are grouped by group_id


class GroupCounts(BaseModel):
    """How many groups a run (or a selection) has, and what a trainer gets of them."""

    total: int = 0
    complete: int = 0  # every member ok
    masked: int = 0  # at least one member with an error status
    zero_variance: int = 0  # complete, all scores equal
    selected: int = 0  # groups kept by the selection
    episodes: int = 0  # ok episodes in the kept groups
    dropped_masked: int = 0  # groups left out because of an error member (on_error="mask")
    dropped_zero_variance: int = 0  # groups left out for equal scores (drop_zero_variance)
    dropped_error_episodes: int = 0  # error members of kept groups (on_error="keep-ok"): never exported
    dropped_no_tokens: int = 0  # exports: groups left out because a member has no exact token ids (absent, drifted)


class Group(BaseModel):
    """One group: its key, and the deduped members' row indices (sample order) and statuses."""

    run_name: str
    task_id: str
    policy_version: str | None  # of the first member (members may differ: see crossed_version)
    rows: list[int]  # indices into the table the group was computed from, by sample
    samples: list[int]
    statuses: list[str]
    rewards: list[float | None]
    group_id: str = ""  # the sampled group; "" for a legacy group (see legacy_group)

    @property
    def key(self) -> tuple[str, ...]:
        return group_key(self.run_name, self.task_id, self.policy_version, self.group_id or None)

    @property
    def masked(self) -> bool:
        return any(s != "ok" for s in self.statuses)

    def ok_rows(self) -> list[int]:
        return [r for r, s in zip(self.rows, self.statuses) if s == "ok"]

    def ok_scores(self) -> list[float]:
        return [float(w) for w, s in zip(self.rewards, self.statuses) if s == "ok" and w is not None]


def legacy_group(group_id: str | None, task_id: str, schema_version: int | None) -> bool:
    """True for a row written before groups had their own id (schema < 4, ``group_id == task_id``)."""
    return (schema_version or 1) < GROUP_ID_SCHEMA and (not group_id or group_id == task_id)


def group_key(run_name: str, task_id: str, policy_version: str | None = None,
              group_id: str | None = None) -> tuple[str, ...]:
    """The key of the group an episode belongs to: ``(run_name, "g", group_id)``; without a
    ``group_id`` (a legacy row) ``(run_name, "t", task_id, policy_version)``."""
    if group_id:
        return (run_name, "g", group_id)
    return (run_name, "t", task_id, policy_version or None)


def groups_of(table: pa.Table) -> list[Group]:
    """Groups of a deduped table (needs ``run_name, group_id, task_id, policy_version,
    schema_version, sample, status, reward``).

    Order: by first appearance of the key in the table; members in sample order.
    """
    missing = [c for c in _GROUP_READ_COLS if c not in table.column_names]
    if missing:
        raise ValueError(f"groups_of needs columns {missing}")
    cols = {c: table.column(c).to_pylist() for c in _GROUP_READ_COLS}
    by_key: dict[tuple, list[int]] = {}
    for i, (run, gid, task, version, sv) in enumerate(zip(cols["run_name"], cols["group_id"], cols["task_id"],
                                                         cols["policy_version"], cols["schema_version"])):
        key = group_key(run, task, version, None if legacy_group(gid, task, sv) else gid)
        by_key.setdefault(key, []).append(i)
    out = []
    for key, idx in by_key.items():
        idx.sort(key=lambda i: cols["sample"][i])
        first = idx[0]
        out.append(Group(
            run_name=key[0], task_id=cols["task_id"][first], policy_version=cols["policy_version"][first] or None,
            group_id=key[2] if key[1] == "g" else "", rows=idx,
            samples=[cols["sample"][i] for i in idx],
            statuses=[cols["status"][i] for i in idx],
            rewards=[cols["reward"][i] for i in idx],
        ))
    return out


def count_groups(groups: list[Group]) -> GroupCounts:
    """``total``, ``complete``, ``masked``, ``zero_variance`` of a list of groups."""
    c = GroupCounts(total=len(groups))
    for g in groups:
        if g.masked:
            c.masked += 1
        else:
            c.complete += 1
            if len(set(g.ok_scores())) <= 1:
                c.zero_variance += 1
    return c


def select_groups(groups: list[Group], on_error: str = "mask",
                  drop_zero_variance: bool = False) -> tuple[list[Group], GroupCounts]:
    """The groups a trainer may get, each reduced to its ``ok`` members, and the counts.

    ``on_error``: ``"mask"`` leaves out every group with an error member; ``"keep-ok"`` keeps its
    ok members. ``drop_zero_variance`` leaves out groups whose kept scores are all equal.
    Error members are never selected (they carry no reward).
    """
    if on_error not in ON_ERROR:
        raise UserError(f"on_error {on_error!r}: use one of {', '.join(ON_ERROR)}")
    counts = count_groups(groups)
    kept: list[Group] = []
    for g in groups:
        if g.masked and on_error == "mask":
            counts.dropped_masked += 1
            continue
        okg = g.model_copy(update={
            "rows": g.ok_rows(),
            "samples": [s for s, st in zip(g.samples, g.statuses) if st == "ok"],
            "rewards": [w for w, st in zip(g.rewards, g.statuses) if st == "ok"],
            "statuses": [st for st in g.statuses if st == "ok"],
        })
        if not okg.rows:
            counts.dropped_masked += 1
            continue
        if drop_zero_variance and len(set(okg.ok_scores())) <= 1:
            counts.dropped_zero_variance += 1
            continue
        counts.dropped_error_episodes += len(g.rows) - len(okg.rows)
        counts.selected += 1
        counts.episodes += len(okg.rows)
        kept.append(okg)
    return kept, counts


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
    groups: GroupCounts | None = None  # sampled groups (group_id); see the module doc


class CompactResult(BaseModel):
    inputs: int
    outputs: int
    rows: int
    removed_tmp: int
    shards_after: int


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
                log.warning("run store %s: writing %d record(s) failed (attempt %d of %d): %s: %s",
                            self.path, len(records), i + 1, attempts, type(e).__name__, e)
        raise StoreWriteError(f"{type(last).__name__}: {last}") from last

    def write_or_error(self, records: list[Any]) -> tuple[Path | None, str | None]:
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
        self.path.mkdir(parents=True, exist_ok=True)
        p = self.path / RUN_CONFIG
        atomic_write_text(p, json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
        return p

    def config(self) -> dict[str, Any] | None:
        p = self.path / RUN_CONFIG
        try:
            return json.loads(p.read_text())
        except FileNotFoundError:
            return None
        except json.JSONDecodeError as e:
            raise UserError(f"{p} is not valid JSON ({e}); rewrite it or delete it") from e

    # --- reading -------------------------------------------------------------------------------
    def shards(self) -> list[Path]:
        """Finished shards, oldest name first (names start with the UTC write time)."""
        try:
            names = [
                e.name
                for e in os.scandir(self.path)
                if e.name.startswith(PART_PREFIX) and e.name.endswith(".parquet")
            ]
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
        extra = [c for c in _DEDUPE_COLS if c not in want]
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
                        return f.name, pf.read(columns=_UNIT_COLS, use_threads=False)
                except FileNotFoundError:
                    return f.name, None
                except (OSError, pa.ArrowException) as e:
                    raise UserError(f"shard {f} is not a readable parquet file ({str(e).splitlines()[0][:200]}); "
                                    f"move it out of the run directory") from e

            with ThreadPoolExecutor(max_workers=min(16, max(1, len(todo)))) as ex:
                for name, t in ex.map(one, todo):
                    if t is None:
                        missing = True
                    else:
                        cache[name] = t.cast(_UNIT_SCHEMA)
            if not missing:
                parts = [cache[f.name] for f in files]
                return pa.concat_tables(parts) if parts else _UNIT_SCHEMA.empty_table()
            time.sleep(0.05 * (attempt + 1))  # a compaction replaced shards under us: relist
        raise RuntimeError(f"shards of {self.path} kept vanishing while reading")

    def records(self) -> list[EpisodeRecord]:
        """The deduped records as ``EpisodeRecord`` objects (convenient for small runs)."""
        return [EpisodeRecord.from_row(r) for r in self.read().to_pylist()]

    def units(self) -> dict[tuple[str, int], str]:
        """Status of every unit that has a record: ``{(task_id, sample): status}``; ``ok`` wins."""
        t = self._unit_keys()
        out: dict[tuple[str, int], str] = {}
        for task, sample, status in zip(
            t.column("task_id").to_pylist(), t.column("sample").to_pylist(), t.column("status").to_pylist()
        ):
            key = (task, sample)
            if out.get(key) != "ok":
                out[key] = status
        return out

    def groups(self) -> tuple[pa.Table, list[Group]]:
        """The deduped table (all columns) and its groups (``Group.rows`` index into it)."""
        table = self.read()
        return table, groups_of(table)

    def select(self, on_error: str = "mask", drop_zero_variance: bool = False,
               columns: list[str] | None = None) -> tuple[pa.Table, list[Group], GroupCounts]:
        """What a trainer may train on: ok episodes of the selected groups (see ``select_groups``).

        Returns the table of those episodes (grouped, groups in first-seen order, members by
        sample), the selected groups (``rows`` index into the returned table) and the counts.
        """
        want = list(columns) if columns is not None else list(EPISODE_SCHEMA.names)
        table = self.read(list(dict.fromkeys(want + _GROUP_READ_COLS)))
        kept, counts = select_groups(groups_of(table), on_error, drop_zero_variance)
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
        raw = self._read_raw(list(dict.fromkeys(list(_DEDUPE_COLS) + _GROUP_READ_COLS + ["passed", "total"])))
        t = dedupe_units(raw)
        statuses = t.column("status").to_pylist()
        by_status = {s: 0 for s in STATUSES}
        for s in statuses:
            by_status[s] = by_status.get(s, 0) + 1
        ok_mask = pc.equal(t.column("status"), "ok")
        ok_t = t.filter(ok_mask)
        rewards = [r for r in ok_t.column("reward").to_pylist() if r is not None]
        fracs = [
            p / n
            for p, n in zip(ok_t.column("passed").to_pylist(), ok_t.column("total").to_pylist())
            if p is not None and n
        ]
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
            raise UserError(f"shard {f} is not a readable parquet file ({str(e).splitlines()[0][:200]}); "
                            f"move it out of the run directory") from e
    raise err


def dedupe_units(table: pa.Table) -> pa.Table:
    """One row per ``(task_id, sample)``: ``ok`` first, then newest ``created_at``, then ``episode_id``."""
    return _first_per_key(table, ["task_id", "sample"])


def _first_per_key(table: pa.Table, keys: list[str]) -> pa.Table:
    """The best row of each key (``ok`` first, newest ``created_at`` next), in storage order."""
    if table.num_rows <= 1:
        return table
    not_ok = pc.cast(pc.not_equal(table.column("status"), "ok"), pa.int8())
    keyed = table.select(list(dict.fromkeys(keys + ["created_at", "episode_id"]))).append_column("__not_ok", not_ok)
    order = pc.sort_indices(
        keyed,
        sort_keys=[(k, "ascending") for k in keys]
        + [("__not_ok", "ascending"), ("created_at", "descending"), ("episode_id", "ascending")],
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


def compact(run: RunStore | Path | str, target_rows: int = DEFAULT_TARGET_ROWS, progress: bool = False) -> CompactResult:
    """Merge small shards into shards of about ``target_rows`` rows, safely while others read/write.

    Each merged shard is written atomically *before* its inputs are deleted, so a reader never
    misses an episode (it may briefly see one twice; ``read()`` dedupes). Shards that writers
    add meanwhile are left for the next compaction. Exact duplicates (same ``episode_id``) are
    dropped while merging; other records of the same unit are kept. Stale ``.tmp-*`` files
    (older than an hour: a killed writer) are removed. Two compactions of one run do not overlap:
    the second fails with a ``UserError``.
    """
    rs = run if isinstance(run, RunStore) else RunStore(run)
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
        files = rs.shards()
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
    return _first_per_key(table, ["episode_id"])


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
