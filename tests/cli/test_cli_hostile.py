"""What the CLI prints holds no raw control character, whatever a record holds: ``status``,
``store summary``, the exports' summaries and ``-v`` log lines, run as subprocesses on a store
whose shard holds raw hostile text (written past the record writer, which would show it already:
the positive control reads it back raw); ``rollouts tail`` over a continuous run's stream whose
committed group holds it the same way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
from hypothesis import HealthCheck, example, given, settings

from et_hpc.text import visible
from helpers.hostile import RAW, hostile_text, raw_store

ET_HPC = [sys.executable, "-m", "et_hpc.cli"]


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    return subprocess.run(ET_HPC + list(args), capture_output=True, text=True, errors="surrogateescape", env=env, cwd=cwd, timeout=300)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@example(hostile="\x1b]0;pwned\x07\x1b[2J\x9b31m\r")
@given(hostile=hostile_text(max_size=12).map(lambda s: s.encode("utf-8", "replace").decode("utf-8")).filter(RAW.search))
def test_cli_printers_show_no_raw_control(tmp_path_factory, hostile: str) -> None:
    root = tmp_path_factory.mktemp("cli")
    run, shard = raw_store(root, hostile)
    held = pq.read_table(shard).column("error").to_pylist()[0]
    assert RAW.search(held)  # positive control: the store holds the raw text the printers read
    outs = []
    for args in (
        ["status", str(run)],
        ["store", "summary", str(run)],
        ["-vv", "export", "atif", str(run), "-o", str(root / "atif")],
    ):
        p = _run(*args, cwd=root)
        assert p.returncode == 0, (args, p.stderr[-2000:])
        outs.append(p.stdout + p.stderr)
        assert not RAW.search(p.stdout) and not RAW.search(p.stderr), (args, p.stdout, p.stderr)
    assert "\\x" in outs[0] or "\\u" in outs[0]  # the hostile reason was printed, shown as escapes


def _raw_group(run: Path, hostile: str) -> Path:
    """A continuous run's queue with one committed group (stream slot 0) whose ``group_id``,
    ``error``, ``score_note`` and ``events`` hold ``hostile`` raw, written past the record writer;
    returns the slot's file."""
    import pyarrow as pa

    from et_hpc.record import EpisodeRecord, records_to_table
    from et_hpc.rollouts.queue import WorkQueue, slot_name

    q = WorkQueue(run).init()
    q.enqueue_epoch(["t"], 2)
    lease = q.claim("w")
    assert lease is not None
    recs = [
        EpisodeRecord(
            run_name="live", task_id="t", sample=i, group_id="g", status="ok", reward=1.0, prompt_token_ids=[[1]], token_ids=[[2]]
        )
        for i in range(2)
    ]
    t = records_to_table(recs)
    cols = {
        "group_id": pa.array([hostile] * 2, pa.string()),
        "error": pa.array([hostile] * 2, pa.string()),
        "score_note": pa.array([hostile] * 2, pa.string()),
        "events": pa.array([[hostile]] * 2, pa.list_(pa.string())),
    }
    for name, arr in cols.items():
        t = t.set_column(t.column_names.index(name), t.schema.field(name), arr)
    assert q.commit(lease, t) == 0
    (run / "run.json").write_text(json.dumps({"name": "live", "config": {}}))
    return run / slot_name(0)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@example(hostile="\x1b]0;pwned\x07\x1b[2J\x9b31m\r")
@given(hostile=hostile_text(max_size=12).map(lambda s: s.encode("utf-8", "replace").decode("utf-8")).filter(RAW.search))
def test_rollouts_tail_shows_no_raw_control(tmp_path_factory, hostile: str) -> None:
    root = tmp_path_factory.mktemp("tail")
    slot = _raw_group(root / "live", hostile)
    held = pq.read_table(slot).to_pylist()[0]
    assert all(RAW.search(held[k]) for k in ("group_id", "error", "score_note")) and RAW.search(held["events"][0])  # positive control
    for extra in ([], ["--json"]):
        p = _run("rollouts", "tail", str(root / "live"), "--from-start", "--count", "1", "--timeout", "60", *extra, cwd=root)
        assert p.returncode == 0, (extra, p.stderr[-2000:])
        assert not RAW.search(p.stdout) and not RAW.search(p.stderr), (extra, p.stdout, p.stderr)
        assert "rewards" in p.stdout, p.stdout  # the group was printed
        if not extra:  # the hostile group id was printed, shown as escapes
            assert visible(hostile).strip() in p.stdout, (p.stdout, visible(hostile))


def test_log_lines_through_the_formatter_show_no_raw_control(tmp_path: Path) -> None:
    code = (
        "import logging, sys; from et_hpc.text import configure_logging; configure_logging(logging.INFO);"
        "logging.getLogger('et_hpc.sandbox.watchdog').info('watchdog: emptied %s', sys.argv[1])"
    )
    hostile = "/dev/shm/\x1b]0;title\x07\x1b[2J\x9b1m"
    p = subprocess.run([sys.executable, "-c", code, hostile], capture_output=True, text=True, timeout=120)
    assert "emptied /dev/shm/\\x1b]0;title\\x07\\x1b[2J\\x9b1m" in p.stderr and not RAW.search(p.stderr)
    raw = subprocess.run(
        [sys.executable, "-c", code.replace("configure_logging(logging.INFO)", "logging.basicConfig(level=20)"), hostile],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert RAW.search(raw.stderr)  # positive control: a plain handler prints it raw
