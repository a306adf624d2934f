"""A few tasks without an image never stop a run: the others run, the broken ones are no_image.

Real task folders, the real image store lookup, the real CLI in a subprocess and a real store;
the last test builds a task that fails to build with real apptainer and runs real oracle
episodes on the demo tasks beside it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow.compute as pc
import pytest

import helpers.units as U
from et_hpc.errors import UserError
from et_hpc.runner.config import RunConfig
from et_hpc.runner.plan import make_plan, open_store
from helpers import REPO


def _task(root: Path, name: str, *, sif: bool = False, def_text: str | None = None) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "task.json").write_text(json.dumps({"description": f"task {name}", "truth": "t"}))
    if sif:
        (d / "container.sif").write_text("stand-in")  # the test unit runner never opens it
    if def_text is not None:
        (d / "container.def").write_text(def_text)
    return d


def _folder(root: Path) -> Path:
    tasks = root / "tasks"
    for i in range(3):
        _task(tasks, f"good_{i}", sif=True)
    _task(tasks, "empty_def", def_text="")
    _task(tasks, "bad_base", def_text="Bootstrap: localimage\nFrom: ./no_such_base.sif\n%post\n    true\n")
    (root / "log").mkdir()
    return tasks


def _env(root: Path) -> dict[str, str]:
    return U.cli_env(root, sleep_s=0, ET_HPC_CACHE=str(root / "cache"))


def _no_image_rows(run_dir: Path) -> int:
    raw = open_store(run_dir).read(columns=["status"], dedupe=False)
    return pc.sum(pc.equal(raw.column("status"), "no_image")).as_py() or 0


def test_broken_tasks_are_no_image_and_the_others_run(tmp_path: Path) -> None:
    src = _folder(tmp_path)
    env = _env(tmp_path)
    args = ["run", str(src), "--run-name", "mixed", "--samples", "2", "--json", *U.RUNNER]
    r = U.et_hpc(args, env)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["units"] == 10 and info["ok"] == 6 and info["no_image"] == 4 and info["missing"] == 0
    assert set(info["no_image_tasks"]) == {"empty_def", "bad_base"}
    assert "no 'Bootstrap:' header" in info["no_image_tasks"]["empty_def"]
    # the table: one row per broken task with its one-line reason
    rows = [ln for ln in r.stderr.splitlines() if ln.startswith(("empty_def ", "bad_base "))]
    assert len(rows) == 2 and "unknown base image './no_such_base.sif'" in " ".join(rows)
    assert len(U.starts(tmp_path)) == 6  # only the good tasks ran
    run_dir = tmp_path / "store" / "mixed"
    assert _no_image_rows(run_dir) == 4
    recs = {(x.task_id, x.sample): x for x in open_store(run_dir).records()}
    assert recs[("empty_def", 1)].status == "no_image" and recs[("empty_def", 1)].reward is None
    assert recs[("empty_def", 1)].error.startswith("no image: ")

    st = json.loads(U.et_hpc(["status", "mixed", "--json"], env).stdout)
    assert st["no_image"] == 4 and st["ok"] == 6 and set(st["no_image_tasks"]) == {"empty_def", "bad_base"}
    table = U.et_hpc(["status", "mixed"], env).stdout
    assert "empty_def" in table and "no_image" in table
    summary = U.et_hpc(["store", "summary", str(run_dir)], env).stdout
    assert "no_image" in summary

    # rerun with the images still missing: nothing runs, no new rows
    again = U.et_hpc(args, env)
    assert again.returncode == 0, again.stderr
    assert "nothing to do" in again.stderr and "empty_def" in again.stderr
    assert len(U.starts(tmp_path)) == 6 and _no_image_rows(run_dir) == 4

    # fix one task: its units are planned again without --retry-errors and run
    (src / "empty_def" / "container.def").unlink()
    (src / "empty_def" / "container.sif").write_text("stand-in")
    fixed = U.et_hpc(args, env)
    assert fixed.returncode == 0, fixed.stderr
    info = json.loads(fixed.stdout)
    assert info["ok"] == 8 and info["no_image"] == 2 and set(info["no_image_tasks"]) == {"bad_base"}
    assert sorted(s[:2] for s in U.starts(tmp_path)[6:]) == [["empty_def", "0"], ["empty_def", "1"]]
    assert _no_image_rows(run_dir) == 4  # the old rows stay; the ok records win for those units
    assert json.loads(U.et_hpc(["status", "mixed", "--json"], env).stdout)["no_image"] == 2

    # --strict keeps the refusal: one line naming the task and the build command
    strict = U.et_hpc([*args, "--strict"], env)
    assert strict.returncode == 2
    assert len(strict.stderr.strip().splitlines()) == 1 and "bad_base" in strict.stderr
    assert "et-hpc build" in strict.stderr and "Traceback" not in strict.stderr


def test_run_with_no_image_at_all_refuses(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks"
    _task(tasks, "empty_def", def_text="")
    _task(tasks, "no_bootstrap", def_text="From: ubuntu:22.04\n")
    (tmp_path / "log").mkdir()
    r = U.et_hpc(["run", str(tasks), "--run-name", "none", *U.RUNNER], _env(tmp_path))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "no selected task has an image" in r.stderr and "empty_def" in r.stderr
    assert not (tmp_path / "store" / "none").exists()  # nothing written


def test_retried_error_whose_image_broke_becomes_no_image(tmp_path: Path) -> None:
    from types import SimpleNamespace

    tasks = U.make_tasks(tmp_path, 2, error_samples=[0])
    cfg = RunConfig(name="re", store=tmp_path / "store", samples=1, unit_runner="helpers.units:work_runner")
    from et_hpc.runner.local import run_local

    run_local(make_plan(cfg, tasks=tasks, image_lookup=U.image_lookup), progress=False)
    assert set(open_store(cfg.run_dir()).units().values()) == {"infra_error"}

    def lookup(t):  # t001's image build has failed since
        if t.id == "t001":
            return SimpleNamespace(status="failed", path=None, reason="build failed: exit 1\nlog tail")
        return U.image_lookup(t)

    plain = make_plan(cfg, tasks=tasks, image_lookup=lookup)  # without --retry-errors: errors stay
    assert plain.units == [] and plain.no_image == {} and plain.done_error == 2
    retry = make_plan(cfg.model_copy(update={"retry_errors": True}), tasks=tasks, image_lookup=lookup)
    assert retry.units == [("t000", 0)] and retry.no_image == {"t001": "build failed: exit 1"}
    assert retry.done_error == 1  # t000's error; t001 is counted as no_image now
    units = open_store(cfg.run_dir()).units()
    assert units[("t001", 0)] == "no_image" and units[("t000", 0)] == "infra_error"
    with pytest.raises(UserError, match="t001"):
        make_plan(cfg.model_copy(update={"retry_errors": True, "strict": True}), tasks=tasks, image_lookup=lookup)


@pytest.mark.apptainer
def test_unbuildable_task_beside_demo_tasks_real_episodes(tmp_path: Path, base_sif: Path) -> None:
    """Done-when of the issue: one task fails its real build; a real oracle run does the others."""
    src = tmp_path / "tasks"
    for name in ("demo_hello_file", "demo_csv_sum"):
        shutil.copytree(REPO / "defs" / "demo" / name, src / name)
    broken = shutil.copytree(REPO / "defs" / "demo" / "demo_hello_file", src / "broken_build")
    (broken / "container.def").write_text(
        "Bootstrap: localimage\nFrom: ./ubuntu_22.04.sif\n\n%post\n    echo 'et-hpc test: this recipe cannot be built' >&2\n    exit 7\n"
    )
    env = dict(os.environ, ET_HPC_STORE=str(tmp_path / "store"))
    b = U.et_hpc(["build", str(src)], env, timeout=900)
    assert "broken_build" in b.stdout + b.stderr
    r = U.et_hpc(["run", str(src), "--policy", "oracle", "--run-name", "demo-broken", "--concurrency", "2", "--json"], env, timeout=900)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["ok"] == 2 and info["passed"] == 2 and info["no_image"] == 1
    assert list(info["no_image_tasks"]) == ["broken_build"]
    assert any(ln.startswith("broken_build ") for ln in r.stderr.splitlines())
