"""Nothing an agent writes can lose its episode: the record writer takes any Python string, and a
store write that fails is retried, then stored as an error record naming the cause.

- hypothesis over arbitrary text (lone surrogates included, and bytes decoded with
  ``surrogateescape`` as a stand-in for invalid UTF-8) in every free-text part of a record, written
  as real parquet through ``RunStore.write`` and read back;
- a record that cannot be serialised at all (an int32 column overflowing) is retried, then
  stored as ``infra_error`` with the cause; the local executor's thread goes on to the next unit;
- end to end: ``et-hpc run --policy replay`` whose command holds a lone surrogate stores its
  episode (status ok), with the transcript exactly as replayed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from et_hpc.record import ESCAPED_EVENT, SHOWN_EVENT, EpisodeRecord, TestResult, escape_text
from et_hpc.runs.store import RunStore, StoreWriteError
from et_hpc.text import hidden_count, visible

# Every code point, surrogates included (categories=() would exclude nothing either way).
ANY_CHAR = st.characters(blacklist_categories=())
ANY_TEXT = st.one_of(
    st.text(ANY_CHAR, max_size=40),
    st.binary(max_size=40).map(lambda b: b.decode("utf-8", "surrogateescape")),  # invalid UTF-8 as Python holds it
)


def _record(text: str, other: str, sample: int = 0, **kw) -> EpisodeRecord:
    base = dict(
        run_name="fuzz",
        task_id="t",
        sample=sample,
        status="ok",
        reward=0.0,
        messages=[{"role": "assistant", "content": f"<command>{text}</command>"}, {"role": "tool", "content": other, text: other}],
        sampling_params={text: other},
        versions={"x": text},
        error=text,
        score_note=other,
        stop_reason=text,
        events=[text, other],
        tests=[TestResult(name=other, outcome="failed")],
    )
    base.update(kw)
    return EpisodeRecord(**base)


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=ANY_TEXT, other=ANY_TEXT)
def test_any_text_is_stored_and_read_back(text: str, other: str) -> None:
    rec = _record(text, other)
    with tempfile.TemporaryDirectory() as d:
        shard = RunStore(Path(d) / "run").write([rec])
        assert shard is not None and shard.exists()
        (back,) = RunStore(Path(d) / "run").records()
    # JSON columns are lossless: the very same strings come back
    assert back.messages == rec.messages
    assert back.sampling_params == rec.sampling_params and back.versions == rec.versions
    # plain columns hold the text with what UTF-8 cannot encode escaped; the texts that quote a
    # sandbox (error, score_note, events) are shown: controls and surrogates as visible escapes
    assert back.error == visible(text) and back.stop_reason == escape_text(text)
    assert back.score_note == visible(other) and back.tests[0].name == escape_text(other)
    assert back.events[:2] == [visible(text), visible(other)]
    escaped = [e for e in back.events[2:] if e.startswith(ESCAPED_EVENT)]
    shown = [e for e in back.events[2:] if e.startswith(SHOWN_EVENT)]
    assert len(back.events) == 2 + len(escaped) + len(shown) and len(escaped) <= 1 and len(shown) <= 1
    assert bool(escaped) == (not (_encodable(text) and _encodable(other)))  # the fact is recorded
    assert bool(shown) == bool(hidden_count(text) or hidden_count(other)), back.events
    if not escaped and not shown:
        assert back.events == rec.events


def test_escaping_is_visible_and_clean_records_are_unchanged(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "run")
    store.write([_record("plain", "é💥", sample=0), _record("a\udc80b", "\ud800", sample=1)])
    recs = {r.sample: r for r in store.records()}
    assert recs[0].events == ["plain", "é💥"] and recs[0].error == "plain"
    assert recs[1].error == "a\\udc80b" and recs[1].score_note == "\\ud800"
    assert recs[1].messages[0]["content"] == "<command>a\udc80b</command>"
    assert recs[1].events[-2:] == [
        f"{ESCAPED_EVENT} messages, sampling_params, stop_reason, tests, versions",
        f"{SHOWN_EVENT} score_note, events, error",
    ]


def test_write_that_keeps_failing_is_retried_then_stored_as_an_error(tmp_path: Path, caplog) -> None:
    store = RunStore(tmp_path / "run")
    bad = _record("x", "y", turns=2**40)  # int32 column: pyarrow refuses it, on every attempt
    with pytest.raises(StoreWriteError, match="ArrowInvalid|ArrowTypeError|overflow|out of bounds"):
        store.write([bad])
    assert sum("attempt 3 of 3" in r.message for r in caplog.records) == 1  # really retried
    assert store.records() == []
    shard, cause = store.write_or_error([bad])
    assert shard is not None and cause
    (rec,) = store.records()
    assert (rec.status, rec.reward, rec.episode_id, rec.sample) == ("infra_error", None, bad.episode_id, 0)
    assert cause in rec.error and "could not write" in rec.error
    assert "ended with status ok, reward 0.0" in rec.events[0]


def _runner(task, sample: int, cfg, image, stop: threading.Event) -> EpisodeRecord:
    """Unit runner: sample 0 cannot be serialised, sample 1 holds lone surrogates, sample 2 is plain."""
    kw: dict = {"run_name": cfg.run_name(), "task_id": task.id, "sample": sample}
    if sample == 0:
        return _record("x", "y", turns=2**40, **kw)
    if sample == 1:
        return _record("echo \udcff", "out \ud83d", **kw)
    return _record("echo ok", "ok", **kw)


def test_local_executor_survives_a_record_it_cannot_write(tmp_path: Path) -> None:
    import helpers.units as U
    from et_hpc.runner.config import RunConfig
    from et_hpc.runner.local import run_local
    from et_hpc.runner.plan import make_plan, open_store

    tasks = U.make_tasks(tmp_path, 1, sleep_s=0)
    cfg = RunConfig(name="w", store=tmp_path / "store", samples=3, concurrency=1, unit_runner="helpers.units:work_runner")
    plan = make_plan(cfg, tasks=tasks, image_lookup=U.image_lookup)
    res = run_local(plan, runner=_runner, progress=False, handle_signals=False)
    recs = {r.sample: r for r in open_store(plan.run_dir).records()}
    assert sorted(recs) == [0, 1, 2], res  # one thread did all three: it outlived the failing write
    assert recs[0].status == "infra_error" and "could not write" in (recs[0].error or "")
    assert recs[1].status == "ok" and recs[1].messages[0]["content"] == "<command>echo \udcff</command>"
    assert recs[1].events[-2].startswith(ESCAPED_EVENT) and recs[1].events[-1].startswith(SHOWN_EVENT)
    assert recs[2].status == "ok" and recs[2].events == ["echo ok", "ok"]
    assert (res.ok, res.errors, res.crashed) == (2, 1, 0)


@pytest.mark.apptainer
def test_replayed_lone_surrogate_keeps_its_episode(demo_image, tmp_path: Path) -> None:
    from et_hpc.runs.store import open_run
    from helpers.demo import DEMO, TASK

    # The replayed command holds a lone surrogate (a JSON \udc80 escape) and prints a byte that is
    # not UTF-8; the shell runs it (the surrogate goes to bash as the byte 0x80 it stands for).
    command = "echo 'x\udc80y'; printf 'a\\377b\\n'"
    replay = tmp_path / "replay_summary.json"
    replay.write_text(
        json.dumps({"results": [{"success": False, "messages": [{"role": "assistant", "content": f"<command>{command}</command>"}]}]})
    )
    (tmp_path / "cwd").mkdir()
    cmd = [
        sys.executable,
        "-m",
        "et_hpc.cli",
        "run",
        str(DEMO),
        "--set",
        f"tasks.ids=[{TASK}]",
        "--run-name",
        "sur",
        "--store",
        str(tmp_path / "store"),
        "--concurrency",
        "1",
        "--json",
        "--policy",
        "replay",
        "--set",
        f"policy.replay_file={replay}",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path / "cwd", env=os.environ.copy())
    assert r.returncode == 0, r.stderr[-3000:]
    recs = open_run(tmp_path / "store" / "sur").records()
    assert len(recs) == 1, r.stderr[-3000:]  # the episode is there, not "missing"
    rec = recs[0]
    assert (rec.status, rec.reward) == ("ok", 0.0), (rec.status, rec.error)
    sent = [m["content"] for m in rec.messages if m["role"] == "assistant"]
    assert sent[0] == f"<command>{command}</command>"  # stored exactly (lossless JSON escapes)
    seen = "".join(m["content"] for m in rec.messages if m["role"] != "assistant")
    assert "a\\udcffb" in seen and "x\\udc80y" in seen  # the bytes the shell printed, each shown as its escape
