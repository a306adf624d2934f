"""The demo tasks under defs/demo: they load, and (with apptainer) their tests and solutions agree."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from et_hpc.tasks.loader import load_tasks
from et_hpc.tasks.recipe import normalise
from helpers import REPO

DEMO = REPO / "defs" / "demo"
IDS = ["demo_csv_sum", "demo_hello_file", "demo_log_filter", "demo_project_setup"]


def test_demos_load_and_normalise():
    res = load_tasks(DEMO, validate=True, base_map={"ubuntu_22.04.sif": Path("/b/base.sif")})
    assert res.errors == []
    assert [t.id for t in res.tasks] == IDS
    for t in res.tasks:
        assert t.source_kind == "native" and t.truth and t.solution and t.initial_tests and t.final_tests
        n = normalise(t, base_map={"ubuntu_22.04.sif": Path("/b/base.sif")})
        assert n.base == Path("/b/base.sif") and "%post -c /bin/bash" in n.text
        post = n.text.split("%post", 1)[1]
        assert "chmod -R a+rwX /home/user" in post
        for banned in ("apt", "pip", "curl", "wget"):  # must build offline on the bare base
            assert f"{banned} " not in post, (t.id, banned)


STEPS = r"""
set -u
export PYTHONDONTWRITEBYTECODE=1
cd /home/user
py() { python3 -m pytest -q -p no:cacheprovider "$@" >/dev/null 2>&1; echo $?; }
echo "initial=$(py /task/test_initial_state.py)"
echo "final_before=$(py /task/test_final_state.py)"
bash /task/solution/solve.sh && echo solve1=ok
bash /task/solution/solve.sh && echo solve2=ok
echo "final_after=$(py /task/test_final_state.py)"
"""


def _remove_sandbox(box: Path, base_sif: Path) -> None:
    """A fakeroot sandbox holds files of sub-uids that the user cannot delete; delete them as fakeroot."""
    if box.exists():
        subprocess.run(
            ["apptainer", "exec", "--fakeroot", "-B", f"{box}:/sandbox", str(base_sif), "find", "/sandbox", "-mindepth", "1", "-delete"],
            capture_output=True,
            timeout=300,
        )
        box.rmdir()


@pytest.mark.parametrize("task_id", IDS)
@pytest.mark.apptainer
def test_demo_solution_round_trip(base_sif: Path, tmp_path: Path, task_id: str):
    task = load_tasks(DEMO / task_id).tasks[0]
    n = normalise(task, base_map={"ubuntu_22.04.sif": base_sif})
    (tmp_path / "t.def").write_text(n.text)
    box = tmp_path / "box"
    try:
        r = subprocess.run(
            ["apptainer", "build", "--fakeroot", "--sandbox", str(box), str(tmp_path / "t.def")],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        r = subprocess.run(
            ["apptainer", "exec", "--containall", "--writable-tmpfs", "-B", f"{task.source}:/task:ro", str(box), "bash", "-c", STEPS],
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        _remove_sandbox(box, base_sif)
    got = dict(ln.split("=", 1) for ln in r.stdout.split() if "=" in ln)
    assert got == {"initial": "0", "final_before": "1", "solve1": "ok", "solve2": "ok", "final_after": "0"}, r.stderr[-2000:]
