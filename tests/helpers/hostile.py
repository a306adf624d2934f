"""Hostile text for the "nothing raw reaches a terminal or a model" properties.

``RAW`` finds what must never be printed or observed (C0 but newline and tab, DEL, C1, lone
surrogates); it is the tests' own oracle, written independently of ``et_hpc.text``. The strategies
build text and bytes an agent can put in output, file names, argv and mount points.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import strategies as st

RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")

# whole sequences a terminal acts on, 7- and 8-bit
SEQUENCES = [
    "\x1b[2J",  # clear screen
    "\x1b[31m",  # colour
    "\x1b]0;pwned\x07",  # window title (OSC, BEL-terminated)
    "\x1b]8;;http://x\x1b\\",  # hyperlink (OSC, ST-terminated)
    "\x1bP1$r\x1b\\",  # DCS
    "\x9b31m",  # 8-bit CSI
    "\x9d0;pwned\x9c",  # 8-bit OSC .. ST
    "\x1bc",  # reset
    "\x07",  # bell
    "\x7f",
    "\r",
    "\x00",
]
_CONTROLS = st.characters(min_codepoint=0, max_codepoint=0x9F).filter(lambda c: c < " " or c >= "\x7f")
_SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, categories=["Cs"])
_PLAIN = st.characters(min_codepoint=0x20, max_codepoint=0x2FF, categories=["L", "N", "P", "S", "Zs"])


def hostile_text(min_size: int = 1, max_size: int = 40) -> st.SearchStrategy[str]:
    """Text mixing plain characters, controls, whole escape sequences and lone surrogates, with at
    least one character ``RAW`` finds."""
    piece = st.one_of(_PLAIN, _CONTROLS, _SURROGATES, st.sampled_from(SEQUENCES))
    return st.lists(piece, min_size=min_size, max_size=max_size).map("".join).filter(lambda s: bool(RAW.search(s)))


def hostile_bytes(min_size: int = 1, max_size: int = 30) -> st.SearchStrategy[bytes]:
    """Bytes an agent can print or put in a name: controls (7- and 8-bit), sequences, non-UTF-8
    bytes; never NUL or ``/`` (so they also make a file name), ending with a control that stays
    one however the bytes are decoded."""
    seq = st.sampled_from([s.encode("utf-8") for s in SEQUENCES if "\x00" not in s and "/" not in s])
    one = st.integers(1, 255).filter(lambda b: b != 0x2F).map(lambda b: bytes([b]))
    raw = st.sampled_from([b"\x1b[2J", b"\xc2\x9b31m", b"\x07", b"\x1b]0;t\x07"])
    return st.tuples(st.lists(st.one_of(one, seq), min_size=min_size - 1, max_size=max_size), raw).map(lambda t: b"".join(t[0]) + t[1])


def as_text(b: bytes) -> str:
    """What the host makes of agent bytes: UTF-8 with ``surrogateescape``."""
    return b.decode("utf-8", "surrogateescape")


def raw_store(root: Path, hostile: str) -> tuple[Path, Path]:
    """A run (run.json and one shard) whose ``error``, ``score_note`` and ``events`` hold
    ``hostile`` raw: written past the record writer, which would show it; returns (run, shard)."""
    from et_hpc.record import EpisodeRecord
    from et_hpc.runs.store import RunStore

    run = root / "run"
    recs = [
        EpisodeRecord(run_name="h", task_id="t", sample=0, status="no_image", error="placeholder"),
        EpisodeRecord(run_name="h", task_id="u", sample=0, status="ok", reward=0.0, score_note="x", events=["x"]),
    ]
    RunStore(run).write(recs)
    (run / "run.json").write_text(json.dumps({"name": "h", "config": {}, "plan": {"units_total": 2}}))
    (shard,) = RunStore(run).shards()
    t = pq.read_table(shard)
    cols = {
        "error": pa.array([f"no image: {hostile}", None], pa.string()),
        "score_note": pa.array([None, hostile], pa.string()),
        "events": pa.array([[], [hostile]], pa.list_(pa.string())),
    }
    for name, arr in cols.items():
        t = t.set_column(t.column_names.index(name), t.schema.field(name), arr)
    pq.write_table(t, shard)
    return run, shard
