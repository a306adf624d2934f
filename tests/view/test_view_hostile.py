"""The viewer's data hold no raw control character, whatever the store holds: every string of
every data file (run index, episode chunks, the page's manifest) is shown through the one
sanitizer. Positive control: the shard the viewer reads holds the hostile text raw."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
from hypothesis import HealthCheck, example, given, settings

from et_hpc.runs.view import build_site
from helpers.hostile import RAW, hostile_text, raw_store


def _strings(v):
    if isinstance(v, str):
        return [v]
    if isinstance(v, dict):
        return [s for k, x in v.items() for s in _strings(k) + _strings(x)]
    return [s for x in v for s in _strings(x)] if isinstance(v, list) else []


def _data(site: Path) -> list:
    """The JSON arguments of every ``ETV.*(...)`` call the site's data files make."""
    out = []
    for f in sorted((site / "data").rglob("*.js")):
        text = f.read_text(encoding="utf-8")
        out.append(json.loads("[" + text[text.index("(") + 1 : text.rindex(")")] + "]"))
    return out


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(hostile="\x1b]0;pwned\x07\x1b[2J\x9b31m\r")
@given(hostile=hostile_text(max_size=16).map(lambda s: s.encode("utf-8", "replace").decode("utf-8")).filter(RAW.search))
def test_viewer_data_hold_no_raw_control(hostile: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        run, shard = raw_store(Path(d), hostile)
        assert RAW.search(pq.read_table(shard).column("score_note").to_pylist()[1])  # positive control
        build_site([run], Path(d) / "site")
        data = _data(Path(d) / "site")
        strings = [s for call in data for s in _strings(call)]
        assert any("\\x" in s or "\\u" in s for s in strings)  # the hostile text is there, shown
        assert not [s for s in strings if RAW.search(s)]
