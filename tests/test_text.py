"""The one sanitizer (``et_hpc.text``): hostile text comes out printable, escaped where it was
raw, unchanged where it was clean; and the paths that use it, in process (the record, the
exports, the viewer's data, log lines). Subprocess CLI printers: tests/cli/test_cli_hostile.py;
the real shell, guard and watchdog: tests/sandbox/test_hostile_notes.py.
"""

from __future__ import annotations

import io
import json
import logging
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from et_hpc.record import SHOWN_EVENT, EpisodeRecord, records_to_table
from et_hpc.runs.store import RunStore
from et_hpc.text import VisibleFormatter, VisibleStream, hidden_count, storable, visible, visible_all
from helpers.hostile import RAW, SEQUENCES, hostile_text

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(s=hostile_text())
def test_visible_leaves_nothing_raw_and_is_idempotent(s: str) -> None:
    assert RAW.search(s)  # positive control: the input holds what a terminal acts on
    out = visible(s)
    assert not RAW.search(out)
    out.encode("utf-8")  # printable on any UTF-8 stream: no lone surrogate left
    assert visible(out) == out and hidden_count(out) == 0
    assert hidden_count(s) == len(RAW.findall(s)) > 0
    one_line = visible(s, newlines=False)
    assert "\n" not in one_line and "\t" not in one_line and not RAW.search(one_line)


@FAST
@given(s=st.text(st.characters(blacklist_categories=("Cc", "Cs"))))
def test_clean_text_is_unchanged(s: str) -> None:
    assert visible(s) == s and hidden_count(s) == 0
    assert visible(s + "\n\tx") == s + "\n\tx"


def test_sequences_are_shown_whole_as_text() -> None:
    assert visible("F\x9b31m") == "F\\x9b31m"  # 8-bit CSI, which the old cleaner kept
    assert visible("\x1b]0;pwned\x07x") == "\\x1b]0;pwned\\x07x"
    assert visible("a\udcffb\ud800") == "a\\udcffb\\ud800"
    assert visible("\r\x00\x7f\x85") == "\\x0d\\x00\\x7f\\x85"
    for seq in SEQUENCES:
        assert not RAW.search(visible(seq))


@FAST
@given(value=st.recursive(hostile_text(), lambda c: st.lists(c, max_size=3) | st.dictionaries(hostile_text(), c, max_size=3)))
def test_visible_all_reaches_every_string(value) -> None:
    def strings(v):
        if isinstance(v, str):
            return [v]
        if isinstance(v, dict):
            return [s for k, x in v.items() for s in strings(k) + strings(x)]
        return [s for x in v for s in strings(x)] if isinstance(v, list) else []

    out, n = visible_all(value)
    assert n == sum(len(RAW.findall(s)) for s in strings(value))
    assert not any(RAW.search(s) for s in strings(out))


def test_stream_and_log_formatter() -> None:
    buf = io.StringIO()
    VisibleStream(buf).write("title\x1b]0;x\x07 \x9b2J \udcff\n")
    assert buf.getvalue() == "title\\x1b]0;x\\x07 \\x9b2J \\udcff\n"
    rec = logging.LogRecord("et_hpc.x", logging.INFO, __file__, 1, "note %s", ("\x1b[2J\x9b",), None)
    assert VisibleFormatter("%(message)s").format(rec) == "note \\x1b[2J\\x9b"
    assert logging.Formatter("%(message)s").format(rec) == "note \x1b[2J\x9b"  # positive control


def _rec(note: str, sample: int = 0, **kw) -> EpisodeRecord:
    base = dict(run_name="r", task_id="t", sample=sample, status="ok", reward=0.0, score_note=note, events=[note], error=None)
    base.update(kw)
    return EpisodeRecord(**base)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(note=hostile_text())
def test_record_shows_note_and_events_and_says_so(note: str) -> None:
    rec = _rec(note)
    assert RAW.search(rec.score_note or "") and RAW.search(rec.events[0])  # in memory: raw, as scoring made it
    with tempfile.TemporaryDirectory() as d:
        RunStore(Path(d) / "run").write([rec])
        (back,) = RunStore(Path(d) / "run").records()
    assert back.score_note == visible(note) and back.events[0] == visible(note)
    assert back.events[-1] == f"{SHOWN_EVENT} score_note, events"
    assert not RAW.search(json.dumps(back.model_dump(mode="json"), ensure_ascii=False))
    again = records_to_table([back]).to_pylist()[0]  # stored again: no second event
    assert json.loads(json.dumps(again["events"])) == back.events


def test_invalid_utf8_in_a_shard_is_read_as_escapes(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "run")
    store.write([_rec("fine", 0), _rec("fine", 1)])
    (shard,) = store.shards()
    table = pq.read_table(shard)
    col = table.column("stop_reason")
    data, off = pa.py_buffer(b"ab\xffc"), pa.array([0, 4, 4], pa.int32()).buffers()[1]
    bad = pa.Array.from_buffers(pa.string(), 2, [None, off, data])  # invalid UTF-8, unchecked
    table = table.set_column(table.column_names.index("stop_reason"), pa.field("stop_reason", col.type), bad)
    pq.write_table(table, shard)
    try:
        pq.read_table(shard).to_pylist()
        raise AssertionError("positive control: the shard should not convert")
    except UnicodeDecodeError:
        pass
    recs = {r.sample: r for r in store.records()}
    assert recs[0].stop_reason == "ab\udcffc" and recs[1].stop_reason == ""


def test_storable_escapes_only_what_utf8_cannot_encode() -> None:
    assert storable({"a\udcff": ["x\ud800", 1, "é"]}) == ({"a\\udcff": ["x\\ud800", 1, "é"]}, True)
    assert storable(["é", "\x1b"]) == (["é", "\x1b"], False)
