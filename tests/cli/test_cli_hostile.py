"""What the CLI prints holds no raw control character, whatever a record holds: ``status``,
``store summary``, the exports' summaries and ``-v`` log lines, run as subprocesses on a store
whose shard holds raw hostile text (written past the record writer, which would show it already:
the positive control reads it back raw). The same ``VisibleStream`` carries ``rollouts tail``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
from hypothesis import HealthCheck, example, given, settings

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
