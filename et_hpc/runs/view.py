"""``et-hpc view``: a static, self-contained site to read what the agents did in one or more runs.

Writes ``OUT/index.html`` (the page of ``viewer.html`` beside this module, with the list of runs)
and ``OUT/data/`` (per run, one compact row per deduped episode and the details in chunks loaded
on demand) as JavaScript calls, so the site opens from ``file://``, any web space or
``--serve`` with no network. Guarantees: the page never parses agent data as HTML (every string
reaches it as a text node), and every string in the data went through ``et_hpc.text.visible``
(control characters shown as escapes), so an episode's output stays inert text. Layout: docs/reports.md.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds

from et_hpc import __version__
from et_hpc.errors import UserError
from et_hpc.record import EPISODE_SCHEMA, TIMING_FIELDS
from et_hpc.runs.store import RunStore, open_run
from et_hpc.text import visible, visible_all

PAGE = Path(__file__).with_name("viewer.html")
MARKER = '<meta name="generator" content="et-hpc view">'
# episode details per chunk file: a chunk closes after this many episodes or bytes
CHUNK_EPISODES = 64
CHUNK_BYTES = 2_000_000

# the compact row of every episode (run page), in this order; strings are dictionary-encoded
INDEX_COLS = [
    "episode_id",
    "task_id",
    "sample",
    "group_id",
    "status",
    "reward",
    "passed",
    "total",
    "stop_reason",
    "score_note",
    "policy_version",
    "turns",
    "prompt_tokens",
    "completion_tokens",
    "timings",
    "peak_mem_mb",
    "error",
    "created_at",
]
_DICT_FIELDS = ("task", "group", "status", "stop", "note", "pv", "error")
_TIME_FIELDS = ("queue_s", "setup_s", "agent_s", "model_s", "exec_s", "score_s", "teardown_s", "total_s")
# the details of an episode (episode page); JSON columns are copied into the data file as they are
DETAIL_COLS = [
    "episode_id",
    "messages",
    "tests",
    "events",
    "timings",
    "prompt_token_ids",
    "token_ids",
    "logprobs",
    "tokens_source",
    "token_drift",
    "policy_version",
    "policy_versions",
    "crossed_version",
    "model",
    "policy_kind",
    "sampling_params",
    "split",
    "host",
    "worker",
    "slurm_job_id",
    "slurm_array_task_id",
    "image_digest",
    "image_path",
    "peak_mem_mb",
    "peak_pids",
    "interpreter",
    "versions",
    "error",
    "score_note",
    "created_at",
    "turn_s",
]
_RAW_JSON = ("messages", "sampling_params", "versions")


@dataclass
class RunSite:
    key: str
    name: str
    path: str
    episodes: int
    chunks: int
    data_bytes: int


@dataclass
class Site:
    out: Path
    runs: list[RunSite] = field(default_factory=list)

    @property
    def index(self) -> Path:
        return self.out / "index.html"


def _js(value: object) -> str:
    """``value`` as a JSON text that is also a safe JavaScript expression (ASCII only: lone
    surrogates and line separators cannot break it)."""
    return json.dumps(value, ensure_ascii=True, separators=(",", ":"), allow_nan=False)


def _num(v: Any, nd: int = 3) -> float | None:
    if v is None:
        return None
    f = float(v)
    return round(f, nd) if f == f and f not in (float("inf"), float("-inf")) else None


class _Dict:
    """Dictionary encoding of a string column: values once, then small integer codes."""

    def __init__(self) -> None:
        self.values: list[str | None] = []
        self._code: dict[str | None, int] = {}
        self.codes: list[int] = []

    def add(self, v: str | None) -> None:
        v = None if v is None else visible(v)
        c = self._code.get(v)
        if c is None:
            c = self._code[v] = len(self.values)
            self.values.append(v)
        self.codes.append(c)

    def out(self) -> dict[str, list]:
        return {"values": self.values, "codes": self.codes}


def _index(rs: RunStore) -> tuple[dict[str, Any], list[str]]:
    """The run page's data: one compact entry per deduped episode, columnar; and the episode ids."""
    table = rs.read(columns=INDEX_COLS)
    cols = {c: table.column(c).to_pylist() for c in INDEX_COLS if c != "timings"}
    timings = table.column("timings").to_pylist()
    order = sorted(range(table.num_rows), key=lambda i: (cols["task_id"][i], cols["sample"][i]))
    dicts = {k: _Dict() for k in _DICT_FIELDS}
    out: dict[str, list] = {
        k: []
        for k in (
            "id",
            "sample",
            "reward",
            "passed",
            "total",
            "turns",
            "ptok",
            "ctok",
            "mem",
            "start",
            *(f"t_{t.removesuffix('_s')}" for t in _TIME_FIELDS),
        )
    }
    for i in order:
        out["id"].append(cols["episode_id"][i])
        dicts["task"].add(cols["task_id"][i])
        group = cols["group_id"][i]
        dicts["group"].add(None if group == cols["task_id"][i] else group)
        dicts["status"].add(cols["status"][i])
        dicts["stop"].add(cols["stop_reason"][i])
        dicts["note"].add(cols["score_note"][i])
        dicts["pv"].add(cols["policy_version"][i])
        err = cols["error"][i]
        dicts["error"].add(err[:300] if err else None)
        out["sample"].append(cols["sample"][i])
        out["reward"].append(_num(cols["reward"][i], 6))
        for k, c in (
            ("passed", "passed"),
            ("total", "total"),
            ("turns", "turns"),
            ("ptok", "prompt_tokens"),
            ("ctok", "completion_tokens"),
        ):
            out[k].append(cols[c][i])
        out["mem"].append(_num(cols["peak_mem_mb"][i], 1))
        t = timings[i] or {}
        out["start"].append(_num(t.get("start_s"), 1))
        for f in _TIME_FIELDS:
            out[f"t_{f.removesuffix('_s')}"].append(_num(t.get(f)))
    data = {**out, **{k: d.out() for k, d in dicts.items()}}
    return data, out["id"]


def _detail_text(row: dict[str, Any]) -> str:
    """One episode's details as a JSON object text, every string through ``visible``."""
    parts = []
    for c in DETAIL_COLS:
        v = row.get(c)
        if c in _RAW_JSON and isinstance(v, str):
            try:  # stored by EpisodeRecord.to_row as JSON; a bad row is shown as its text
                v = json.loads(v)
            except ValueError:
                pass
            parts.append(f"{_js(c)}:{_js(visible_all(v)[0])}")
            continue
        if c in ("logprobs", "turn_s") and v is not None:
            v = [[_num(x, 4) for x in turn] if turn is not None else None for turn in v]
        elif c == "timings" and v is not None:
            v = {k: _num(v.get(k), 3) for k in TIMING_FIELDS}
        elif c == "tests" and v is not None:
            v = [[t["name"], t["outcome"]] for t in v]
        elif c == "created_at" and v is not None:
            v = v.astimezone(timezone.utc).isoformat()
        elif isinstance(v, float):
            v = _num(v, 3)
        parts.append(f"{_js(c)}:{_js(visible_all(v)[0])}")
    return "{" + ",".join(parts) + "}"


def _detail_rows(rs: RunStore, wanted: set[str]) -> Iterable[dict[str, Any]]:
    """Every wanted episode's detail columns once, shard by shard, a batch at a time (a run with
    100k episodes never sits in memory whole)."""
    files = rs.shards()
    if not files:
        return
    dataset = ds.dataset([str(f) for f in files], schema=EPISODE_SCHEMA, format="parquet")
    seen: set[str] = set()
    # little read-ahead: transcripts and token lists are most of a shard's bytes
    scanner = dataset.scanner(columns=DETAIL_COLS, batch_size=256, batch_readahead=1, fragment_readahead=1)
    for batch in scanner.to_batches():
        for row in batch.to_pylist():
            eid = row["episode_id"]
            if eid in wanted and eid not in seen:
                seen.add(eid)
                yield row


def _write(path: Path, text: str) -> int:
    data = text.encode("utf-8", "surrogatepass")
    path.write_bytes(data)
    return len(data)


def _write_run(rs: RunStore, key: str, data_dir: Path) -> RunSite:
    index, ids = _index(rs)
    chunk_of: dict[str, int] = {}
    run_dir = data_dir / key
    run_dir.mkdir(parents=True, exist_ok=True)
    total = 0
    buf: list[str] = []
    size = 0
    n_chunks = 0

    def flush() -> None:
        nonlocal buf, size, n_chunks, total
        if buf:
            total += _write(run_dir / f"c{n_chunks}.js", f"ETV.chunk({_js(key)},{n_chunks},{{" + ",".join(buf) + "});\n")
            n_chunks += 1
            buf, size = [], 0

    for row in _detail_rows(rs, set(ids)):
        text = _detail_text(row)
        buf.append(f"{_js(row['episode_id'])}:{text}")
        size += len(text)
        chunk_of[row["episode_id"]] = n_chunks
        if len(buf) >= CHUNK_EPISODES or size >= CHUNK_BYTES:
            flush()
    flush()
    index["chunk"] = [chunk_of.get(i, -1) for i in ids]
    cfg = rs.config() or {}
    meta = {
        "key": key,
        "name": rs.name,
        "path": str(rs.path),
        "planned_at": cfg.get("planned_at"),
        "units_total": (cfg.get("plan") or {}).get("units_total"),
        "episodes": len(ids),
        "chunks": n_chunks,
    }
    meta = visible_all(meta)[0]
    total += _write(data_dir / f"{key}.js", f"ETV.run({_js(key)},{_js(meta)},{_js(index)});\n")
    return RunSite(key=key, name=rs.name, path=str(rs.path), episodes=len(ids), chunks=n_chunks, data_bytes=total)


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"-o {out} is a file; give a directory for the viewer (it writes index.html and data/)")
    if out.is_dir() and any(out.iterdir()):
        page = out / "index.html"
        ours = page.is_file() and MARKER in page.read_text(encoding="utf-8", errors="replace")[:4000]
        if not ours:
            raise UserError(
                f"-o {out} is a directory holding other files; give an empty or new directory (or one an earlier 'et-hpc view' wrote)"
            )


def page_html(runs: list[RunSite], title: str) -> str:
    """The viewer page with the list of runs written in (as JSON no markup can break out of)."""
    manifest = {
        "title": title,
        "generated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "version": __version__,
        "runs": [{"key": r.key, "name": r.name, "path": r.path, "episodes": r.episodes} for r in runs],
    }
    text = _js(visible_all(manifest)[0]).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    page = PAGE.read_text(encoding="utf-8").replace("/*MANIFEST*/null", text)
    # the page's own script is the only inline script allowed to run (its hash in the page's CSP)
    script = page.split("<script>", 1)[1].split("</script>", 1)[0]
    digest = base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode()
    return page.replace("/*SCRIPT_HASH*/", f"'sha256-{digest}'")


def build_site(run_dirs: Sequence[Path | str], out: Path | str) -> Site:
    """Write the viewer of ``run_dirs`` into ``out`` (replacing an earlier viewer there)."""
    if not run_dirs:
        raise UserError("no run given; pass one or more run folders (e.g. et-hpc-runs/my-run)")
    runs = [open_run(p) for p in run_dirs]
    out = Path(out).expanduser()
    _check_out(out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "data"
    tmp = out / ".data-new"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    site = Site(out=out)
    for i, rs in enumerate(runs):
        site.runs.append(_write_run(rs, f"r{i}", tmp))
    shutil.rmtree(data, ignore_errors=True)
    tmp.rename(data)
    title = ", ".join(r.name for r in runs[:3]) + (f" and {len(runs) - 3} more" if len(runs) > 3 else "")
    _write(site.index, page_html(site.runs, title))
    return site


def default_out(run_dirs: Sequence[Path | str]) -> Path:
    """Where the viewer goes without ``-o``: beside the first run, in a folder the store skips."""
    first = Path(run_dirs[0]).expanduser().resolve()
    name = first.name if len(run_dirs) == 1 else f"{first.name}+{len(run_dirs) - 1}"
    return first.parent / "_view" / name
