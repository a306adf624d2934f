"""Exports never fail on a stored string: ATIF, Atropos and SkyRL write every other episode when
one holds lone surrogates (escaped as ``\\udcHH``, counted) and when one cannot be read at all
(skipped, counted). Positive controls: the stored transcript holds the surrogate (the plain JSON
encoding the exports used raises on it), and the unreadable row really does not load."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, example, given, settings

from et_hpc.record import EpisodeRecord
from et_hpc.runs.atif import export_atif
from et_hpc.runs.export import export_atropos, export_skyrl
from et_hpc.runs.store import RunStore
from helpers.hostile import hostile_text
from runs.test_export import ep


def _store(root: Path, text: str) -> RunStore:
    recs = [ep(t, s, float(s), tokens=True) for t in ("a", "b", "c") for s in (0, 1)]
    recs[0] = recs[0].model_copy(update={"messages": [*recs[0].messages[:3], {"role": "user", "content": f"out {text}"}]})
    store = RunStore(root / "run")
    store.write(recs)
    (shard,) = store.shards()
    t = pq.read_table(shard)
    msgs = t.column("messages").to_pylist()
    tasks = t.column("task_id").to_pylist()
    msgs = [m if task != "c" else "{not json" for m, task in zip(msgs, tasks)]  # task c: unreadable rows
    t = t.set_column(t.column_names.index("messages"), t.schema.field("messages"), pa.array(msgs, pa.string()))
    pq.write_table(t, shard)
    return store


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(text="\udcff\x1b[2J\ud800")
@given(text=hostile_text())
def test_exports_write_every_other_episode(text: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        store = _store(root, text)
        raw = store.read(columns=["task_id", "messages"]).to_pylist()
        held = json.loads(next(r["messages"] for r in raw if r["task_id"] == "a" and "out " in r["messages"]))
        back = json.loads(json.dumps(f"out {text}"))  # as JSON gives it back (a surrogate pair joins)
        assert held[-1]["content"] == back  # positive control: the store gives back the text as it was
        lone = any(0xD800 <= ord(c) <= 0xDFFF for c in back)
        if lone:
            with pytest.raises(UnicodeEncodeError):
                json.dumps(held, ensure_ascii=False).encode("utf-8")
        with pytest.raises(ValueError):
            EpisodeRecord.from_row(next(r for r in store.read().to_pylist() if r["task_id"] == "c"))

        atif = export_atif(store, root / "atif")
        assert atif.documents == 4 and len(atif.skipped) == 2, atif
        docs = {p.name: json.loads(p.read_bytes().decode("utf-8")) for p in (root / "atif").glob("*.json")}
        assert sorted(docs) == ["a.0.json", "a.1.json", "b.0.json", "b.1.json"]
        assert ("escaped_text" in docs["a.0.json"]["extra"]) == lone and atif.escaped == int(lone)
        assert "skipped" in atif.line()

        at = export_atropos(store, root / "a.jsonl", drop_zero_variance=False)
        lines = [json.loads(x) for x in (root / "a.jsonl").read_bytes().decode("utf-8").splitlines()]
        assert len(lines) == 2 and at.groups == 2 and at.skipped_episodes == 2 and at.escaped_episodes == 2 * lone, at
        assert "2 episodes skipped" in at.line()

        sk = export_skyrl(store, root / "s.parquet")
        table = pq.read_table(root / "s.parquet")
        assert table.num_rows == 4 and sk.skipped_episodes == 2 and sk.escaped_episodes == int(lone), sk
        assert sorted(table.column("extra_info").to_pylist(), key=lambda x: (x["task_id"], x["sample"]))[0]["task_id"] == "a"
