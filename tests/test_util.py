"""The shared helpers: output tails, atomic writes with modes, the progress bar, Slurm queries, and
TaskError naming its task."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from et_hpc.errors import TaskError
from et_hpc.host import slurm
from et_hpc.tasks.loader import load_tasks
from et_hpc.util import atomic_open, file_tail, progress_bar, tail_lines

REPO = Path(__file__).resolve().parent.parent


def test_tail_lines_drops_blank_lines_and_cuts() -> None:
    text = "one  \n\n   \ntwo\nINFO: noise\nthree\n"
    assert tail_lines(text) == ["one", "two", "INFO: noise", "three"]
    assert tail_lines(text, 2) == ["INFO: noise", "three"]
    assert tail_lines(text, 2, drop=lambda ln: ln.startswith("INFO:")) == ["two", "three"]
    assert tail_lines(text, 3, raw=True) == ["two", "INFO: noise", "three"]
    assert tail_lines(text, raw=True)[:3] == ["one  ", "", "   "]
    assert tail_lines("abcdef\nxy", width=3) == ["abc", "xy"]
    assert tail_lines(b"ok \xff\nend") == ["ok \ufffd", "end"]
    assert tail_lines(None) == []


def test_file_tail_reads_or_gives_nothing(tmp_path: Path) -> None:
    p = tmp_path / "log"
    p.write_bytes(b"a\n\nb\xfe\nc\n")
    assert file_tail(p, 2) == ["b\ufffd", "c"]
    assert file_tail(p, 3, raw=True) == ["", "b\ufffd", "c"]
    assert file_tail(tmp_path / "missing", 5) == []
    assert file_tail(None, 5) == []


def test_atomic_open_sets_the_file_and_new_directory_modes(tmp_path: Path) -> None:
    target = tmp_path / "new" / "ep.json"
    with atomic_open(target, mode=0o600, dir_mode=0o700) as f:
        f.write(b"{}\n")
    assert target.read_bytes() == b"{}\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert stat.S_IMODE(target.parent.stat().st_mode) == 0o700
    assert [p.name for p in target.parent.iterdir()] == ["ep.json"]  # no temp file left


def test_progress_bar_show() -> None:
    assert progress_bar(range(3), desc="t", unit="x", show=False).disable
    bar = progress_bar(total=3, desc="t", unit="x", show=True)
    assert not bar.disable and bar.total == 3
    bar.close()


def test_slurm_query_answers_or_says_none(tmp_path: Path) -> None:
    assert slurm.query(["echo", "a|b"]) == "a|b\n"
    assert slurm.query(["false"]) is None
    assert slurm.query([str(tmp_path / "no-such-command")]) is None
    assert slurm.query(["sleep", "5"], timeout=0.2) is None
    gone = tmp_path / "squeue"
    gone.write_text("#!/bin/sh\necho 'slurm_load_jobs error: Invalid job id specified' >&2\nexit 1\n")
    gone.chmod(0o755)
    assert slurm.query([str(gone), "-j", "1"]) == ""


def test_task_error_names_its_task(tmp_path: Path) -> None:
    assert TaskError("bad", task_id="t1").task_id == "t1" and TaskError("bad").task_id is None
    good = REPO / "defs" / "demo"
    src = next(p for p in sorted(good.iterdir()) if (p / "task.json").exists())
    shutil.copytree(src, tmp_path / "tasks" / "fine")
    broken = tmp_path / "tasks" / "broken"
    shutil.copytree(src, broken)
    (broken / "task.json").write_text("{not json")
    res = load_tasks(tmp_path / "tasks")
    assert [t.source.name for t in res.tasks] == ["fine"]
    assert [e.task_id for e in res.errors] == ["broken"]
    assert "invalid JSON" in str(res.errors[0])
    assert os.fspath(broken / "task.json") in str(res.errors[0])
