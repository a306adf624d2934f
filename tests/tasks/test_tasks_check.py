"""``et-hpc tasks check`` end to end: real images, real sandboxes, real pytest inside them.

The demo tasks must all check OK. Broken copies of a demo task (same image, so no extra build)
must fail at the right stage, and the native fixture whose image already holds the answer must
be flagged as trivially solved. Images go to the default cache, so each is built once per cache.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

DEMO = REPO / "defs" / "demo"
DEMO_IDS = ["demo_csv_sum", "demo_hello_file", "demo_log_filter", "demo_project_setup"]
STAGES = ["load", "build", "start", "initial", "untouched", "solution"]
# Its %post writes /home/user/monitoring/alert_setup.log and the two symlinks the task asks for.
TRIVIAL_NATIVE = "task_000000_9cc1e5be"


def et_hpc(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "et_hpc.cli", *args], capture_output=True, text=True, timeout=timeout)


def check_json(*args: str) -> tuple[int, dict[str, dict], str]:
    r = et_hpc("tasks", "check", *args, "--json")
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    try:
        rows = json.loads(r.stdout)
    except ValueError:
        pytest.fail(f"no JSON on stdout (exit {r.returncode}): {r.stdout[-500:]} {r.stderr[-2000:]}")
    return r.returncode, {row["task_id"]: row for row in rows}, r.stderr


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    r = et_hpc("tasks", "check", str(tmp_path / "nope"))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().startswith("et-hpc: error:") and len(r.stderr.strip().splitlines()) == 1
    r = et_hpc("tasks", "check", str(DEMO), "--jobs", "0")
    assert r.returncode == 2 and "--jobs 0" in r.stderr and "Traceback" not in r.stderr
    r = et_hpc("tasks", "check", str(DEMO), "--ids", "no_such_task")
    assert r.returncode == 2 and "no_such_task" in r.stderr and "Traceback" not in r.stderr


def test_help_teaches() -> None:
    r = et_hpc("tasks", "check", "--help")
    assert r.returncode == 0
    for word in ("trivially solved", "untouched", "solution", "examples:", "--no-build", "--retry-failed"):
        assert word in r.stdout


@pytest.mark.apptainer
def test_demo_tasks_all_ok(base_sif: Path) -> None:
    rc, rows, err = check_json(str(DEMO))
    assert sorted(rows) == DEMO_IDS
    for tid, row in rows.items():
        assert row["ok"] is True and row["stage"] is None, (tid, row)
        assert row["stages"] == {s: "ok" for s in STAGES}, (tid, row["stages"])
    assert rc == 0, err[-2000:]


def _demo_copy(dest: Path, name: str) -> Path:
    d = dest / name
    shutil.copytree(DEMO / "demo_hello_file", d)
    return d


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory, base_sif: Path) -> tuple[int, dict[str, dict], str]:
    """One check over five broken copies of demo_hello_file (three reuse its cached image)."""
    root = tmp_path_factory.mktemp("broken")
    d = _demo_copy(root, "b_trivial")  # the final test checks a file the image already has
    (d / "test_final_state.py").write_text("import os\n\ndef test_readme():\n    assert os.path.isfile('/home/user/README')\n")
    d = _demo_copy(root, "b_wrong_solution")
    (d / "solution" / "solve.sh").write_text("#!/bin/bash\nprintf 'Hello, world\\n' > /home/user/greeting.txt\n")
    d = _demo_copy(root, "b_initial_fails")
    (d / "test_initial_state.py").write_text(
        "import os\n\ndef test_config():\n    assert os.path.isfile('/home/user/config.ini'), 'config.ini missing'\n"
    )
    d = _demo_copy(root, "b_no_bootstrap")
    text = (d / "container.def").read_text()
    (d / "container.def").write_text("\n".join(ln for ln in text.splitlines() if not ln.startswith("Bootstrap:")) + "\n")
    d = _demo_copy(root, "b_build_fails")  # a new image whose %post fails (the failure is cached)
    text = (d / "container.def").read_text()
    (d / "container.def").write_text(
        text.replace("mkdir -p /home/user", "echo 'cannot frobnicate' >&2; exit 3\n    mkdir -p /home/user", 1)
    )
    return check_json(str(root))


def test_broken_copies_fail_the_run(broken) -> None:
    rc, rows, _ = broken
    assert rc == 1
    assert sorted(rows) == ["b_build_fails", "b_initial_fails", "b_no_bootstrap", "b_trivial", "b_wrong_solution"]
    assert not any(r["ok"] for r in rows.values())


def test_trivially_solved_is_flagged(broken) -> None:
    row = broken[1]["b_trivial"]
    assert row["stage"] == "untouched" and row["detail"].startswith("trivially solved"), row
    assert row["stages"] == {"load": "ok", "build": "ok", "start": "ok", "initial": "ok", "untouched": "failed", "solution": "not_run"}


def test_wrong_solution_fails_at_solution(broken) -> None:
    row = broken[1]["b_wrong_solution"]
    assert row["stage"] == "solution" and row["stages"]["untouched"] == "ok", row
    assert "test_greeting_content" in row["detail"] and row["tail"], row


def test_failing_initial_test_fails_at_initial(broken) -> None:
    row = broken[1]["b_initial_fails"]
    assert row["stage"] == "initial" and row["stages"]["start"] == "ok", row
    assert "test_config" in row["detail"] and any("config.ini missing" in ln for ln in row["tail"]), row


def test_def_without_bootstrap_fails_at_load_naming_the_file(broken) -> None:
    row = broken[1]["b_no_bootstrap"]
    assert row["stage"] == "load" and row["stages"]["build"] == "not_run", row
    assert "b_no_bootstrap/container.def" in row["detail"] and "Bootstrap:" in row["detail"], row
    assert "\n" not in row["detail"]


def test_failed_build_fails_at_build_with_the_log_tail(broken) -> None:
    row = broken[1]["b_build_fails"]
    assert row["stage"] == "build" and row["stages"]["start"] == "not_run", row
    assert "exit status 3" in row["detail"] and any("cannot frobnicate" in ln for ln in row["tail"]), row


@pytest.mark.apptainer
def test_table_and_count_line(tmp_path: Path, base_sif: Path) -> None:
    d = _demo_copy(tmp_path, "t_trivial")
    (d / "test_final_state.py").write_text("def test_nothing():\n    assert True\n")
    r = et_hpc("tasks", "check", str(tmp_path))
    assert r.returncode == 1, r.stderr[-2000:]
    assert r.stdout.splitlines()[0].split() == ["task", "result", "stage", "detail"]
    assert "t_trivial" in r.stdout and "TRIVIAL" in r.stdout and "untouched" in r.stdout
    assert "t_trivial: FAILED at untouched: trivially solved" in r.stderr
    assert "0 OK, 1 failed (1 trivially solved) of 1 tasks" in r.stderr


@pytest.mark.apptainer
def test_native_fixture_with_solved_image_is_flagged(tmp_path: Path, fixtures_dir: Path, base_sif: Path) -> None:
    task = shutil.copytree(fixtures_dir / "native" / TRIVIAL_NATIVE, tmp_path / TRIVIAL_NATIVE)
    rc, rows, err = check_json(str(task))
    row = rows[TRIVIAL_NATIVE]
    assert row["stage"] == "untouched" and row["detail"].startswith("trivially solved"), (row, err[-2000:])
    assert row["stages"]["initial"] == "ok" and row["stages"]["solution"] == "not_run"
    assert rc == 1
