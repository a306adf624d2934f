"""``sandbox.warm``/``sandbox.local_copy`` "auto": the fast path where it pays, explicit settings win,
the choice and the binds land in run.json and ``et-hpc status`` shows them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from et_hpc.errors import UserError
from et_hpc.runner.config import RunConfig, load_config, parse_set
from et_hpc.runner.fastpath import choose
from et_hpc.runner.plan import make_plan

TASKS = [f"t{i}" for i in range(4)]


@pytest.fixture
def images(tmp_path: Path) -> dict:
    """Four 90 MB (sparse) image files, as big as the demo tasks' SIFs."""
    out = {}
    for tid in TASKS:
        p = tmp_path / f"{tid}.sif"
        with open(p, "wb") as f:
            f.truncate(90 * 2**20)
        out[tid] = SimpleNamespace(status="ok", path=p, digest=None, reason=None)
    return out


def _cfg(**sets) -> RunConfig:
    return load_config(None, parse_set([f"{k}={v}" for k, v in sets.items()]))


def _units(samples: int) -> list[tuple[str, int]]:
    return [(t, s) for t in TASKS for s in range(samples)]


def test_groups_get_unpack_and_warm_one_episode_per_image_does_not_unpack(images: dict, tmp_path: Path) -> None:
    groups = choose(_cfg(concurrency=1), _units(4), images, scratch=tmp_path)
    assert (groups["warm"], groups["local_copy"]) == (2, "unpack"), groups
    assert groups["unpack"]["saved_s"] > groups["unpack"]["cost_s"]
    evaluation = choose(_cfg(concurrency=1), _units(1), images, scratch=tmp_path)
    assert (evaluation["warm"], evaluation["local_copy"]) == (2, "auto"), evaluation
    assert "cost" in evaluation["why"]["local_copy"]


def test_explicit_settings_win(images: dict, tmp_path: Path) -> None:
    c = choose(_cfg(concurrency=1, **{"sandbox.warm": 0, "sandbox.local_copy": "never"}), _units(4), images, scratch=tmp_path)
    assert (c["warm"], c["local_copy"]) == (0, "never")
    c = choose(_cfg(concurrency=1, **{"sandbox.warm": 5, "sandbox.local_copy": "unpack"}), _units(1), images, scratch=tmp_path)
    assert (c["warm"], c["local_copy"]) == (5, "unpack")


def test_what_the_plan_knows_turns_the_fast_path_off(images: dict, tmp_path: Path, monkeypatch) -> None:
    cores = len(os.sched_getaffinity(0))
    busy = choose(_cfg(concurrency=cores + 1), _units(4), images, scratch=tmp_path)
    assert busy["warm"] == 0 and "cores" in busy["why"]["warm"]
    single = choose(_cfg(concurrency=1), [("t0", 0)], images, scratch=tmp_path)
    assert single["warm"] == 0 and single["local_copy"] == "auto"
    # a Slurm array task of one unit each: one episode per image on a node
    spread = choose(_cfg(executor="slurm", **{"slurm.units_per_task": 1, "slurm.cpus_per_task": 2}), _units(4), images, scratch=tmp_path)
    assert spread["local_copy"] == "auto" and spread["warm"] == 0
    chunked = choose(
        _cfg(executor="slurm", concurrency=1, **{"slurm.units_per_task": 16, "slurm.cpus_per_task": 2}), _units(4), images, scratch=tmp_path
    )
    assert (chunked["warm"], chunked["local_copy"]) == (2, "unpack")
    small = choose(_cfg(concurrency=1, **{"sandbox.local_copy_budget_gb": 0.5}), _units(4), images, scratch=tmp_path)
    assert small["local_copy"] == "auto" and "budget" in small["why"]["local_copy"]
    monkeypatch.setenv("PATH", str(tmp_path))  # no unsquashfs
    assert choose(_cfg(concurrency=1), _units(4), images, scratch=tmp_path)["local_copy"] == "auto"


def test_plan_records_the_choice_and_binds_and_status_shows_them(images: dict, tmp_path: Path) -> None:
    from helpers.units import make_tasks

    tasks = make_tasks(tmp_path / "u", 4)
    data = tmp_path / "data"
    data.mkdir()
    cfg = _cfg(concurrency=1, samples=4, store=str(tmp_path / "store"), name="fp", **{"sandbox.binds": f"[{data}:/data, {data}:/out:rw]"})
    plan = make_plan(cfg, tasks=tasks, image_lookup=lambda t: images[TASKS[int(t.id[1:])]])
    assert plan.cfg.sandbox.warm == 2 and plan.cfg.sandbox.local_copy == "unpack"
    meta = json.loads((plan.run_dir / "run.json").read_text())
    assert meta["plan"]["sandbox"]["binds"] == [f"{data}:/data", f"{data}:/out:rw"]
    assert meta["plan"]["sandbox"]["local_copy"] == "unpack" and meta["plan"]["sandbox"]["why"]["warm"]
    r = subprocess.run(
        [sys.executable, "-m", "et_hpc.cli", "status", "fp", "--store", str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert f"{data}:/data, {data}:/out:rw" in r.stdout and "warm 2, local_copy unpack" in r.stdout

    with pytest.raises(UserError, match="does not exist"):
        make_plan(_cfg(**{"sandbox.binds": f"[{tmp_path}/nope:/data]"}), tasks=tasks, image_lookup=lambda t: images["t0"], write=False)


@pytest.mark.parametrize("bad", ["relative:/data", "/a:/.et-pristine", "/a:/b:rw:x", "/a,/b:/c", "/a:/proc/x"])
def test_a_bad_bind_is_one_line(bad: str, tmp_path: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "et_hpc.cli",
            "run",
            "defs/demo",
            "--policy",
            "oracle",
            "--store",
            str(tmp_path),
            "--set",
            f"sandbox.binds=['{bad}']",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert r.returncode == 2 and "sandbox.binds" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
