"""et-hpc report on a real store of three synthetic nightly runs: order, rates, deltas, task changes, outputs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from et_hpc.cli import main
from et_hpc.record import EpisodeRecord
from et_hpc.runs.report import build_report, newcombe, wilson
from et_hpc.runs.store import RunStore
from helpers import REPO
from helpers.demo import built_validation_set

T0 = datetime(2025, 3, 1, 2, 0, tzinfo=timezone.utc)
TASKS = [f"task_{i:02d}" for i in range(10)]


def _write_run(
    root: Path,
    name: str,
    solved: set[str],
    day: int,
    planned: bool,
    errors: set[str] = frozenset(),
    model: str = "ckpt",
    split: str = "validation",
) -> None:
    """Two samples per task; a solved task passes sample 0 only; tasks in ``errors`` have sample 1 as an error."""
    rs = RunStore(root / name)
    when = T0 + timedelta(days=day)
    recs = []
    for t in TASKS:
        for s in (0, 1):
            if t in errors and s == 1:
                recs.append(
                    EpisodeRecord(
                        run_name=name,
                        task_id=t,
                        sample=s,
                        status="infra_error",
                        model=model,
                        split=split,
                        error="node lost",
                        created_at=when,
                    )
                )
                continue
            ok = t in solved and s == 0
            recs.append(
                EpisodeRecord(
                    run_name=name,
                    task_id=t,
                    sample=s,
                    status="ok",
                    reward=1.0 if ok else 0.0,
                    passed=4 if ok else 1,
                    total=4,
                    model=model,
                    split=split,
                    created_at=when + timedelta(minutes=s),
                )
            )
    # an extra training-split episode that --split validation must ignore
    recs.append(
        EpisodeRecord(
            run_name=name,
            task_id="train_only",
            sample=0,
            status="ok",
            reward=1.0,
            passed=1,
            total=1,
            model=model,
            split="train",
            created_at=when,
        )
    )
    rs.write(recs[:7])
    rs.write(recs[7:])
    if planned:
        rs.write_config(
            {
                "name": name,
                "planned_at": when.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "config": {"policy": {"kind": "openai", "model": f"/ckpts/{model}"}},
            }
        )


@pytest.fixture()
def store(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    # names sort in a different order than their dates, so ordering by name would be wrong
    _write_run(root, "nightly-c", {"task_00", "task_01", "task_02"}, day=0, planned=True, model="step100")
    _write_run(
        root,
        "nightly-a",
        {"task_00", "task_01", "task_03", "task_04", "task_05"},
        day=1,
        planned=False,
        errors={"task_09"},
        model="step200",
    )
    _write_run(
        root,
        "nightly-b",
        {"task_00", "task_03", "task_04", "task_05", "task_06", "task_07", "task_08"},
        day=2,
        planned=True,
        model="step300",
    )
    _write_run(root, "other-run", set(TASKS), day=3, planned=True)
    return root


def test_order_rates_and_deltas(store: Path) -> None:
    rep = build_report(store, "nightly-*", split="validation")
    assert [r.run for r in rep.runs] == ["nightly-c", "nightly-a", "nightly-b"]
    c, a, b = rep.runs
    assert (c.time_source, a.time_source) == ("planned_at", "created_at")
    assert c.model == "/ckpts/step100" and a.model == "step200"  # run.json first, else the records
    assert (c.episodes, c.ok, c.errors, c.solved) == (20, 20, 0, 3)
    assert (a.episodes, a.ok, a.errors, a.solved) == (20, 19, 1, 5)  # the error is not a failure
    assert c.pass_rate == pytest.approx(3 / 20) and a.pass_rate == pytest.approx(5 / 19)
    assert b.pass_rate == pytest.approx(7 / 20)
    assert c.mean_reward == pytest.approx(3 / 20)
    assert c.mean_test_fraction == pytest.approx((3 * 1.0 + 17 * 0.25) / 20)
    assert c.delta is None and c.delta_ci is None
    assert a.delta == pytest.approx(5 / 19 - 3 / 20) and b.delta == pytest.approx(7 / 20 - 5 / 19)
    for r in (c, a, b):
        lo, hi = r.pass_rate_ci
        assert 0 <= lo < r.pass_rate < hi <= 1
    for r in (a, b):
        assert r.delta_ci[0] < r.delta < r.delta_ci[1]
        assert r.significant is False  # 20 episodes cannot tell these apart
    # without the split filter the train episode counts too
    all_splits = build_report(store, "nightly-*")
    assert all_splits.runs[0].episodes == 21 and all_splits.runs[0].solved == 4


def test_task_changes_between_last_two(store: Path) -> None:
    ch = build_report(store, "nightly-*", split="validation").changes
    assert (ch.previous, ch.last) == ("nightly-a", "nightly-b")
    assert ch.newly_solved == ["task_06", "task_07", "task_08"]
    assert ch.newly_failed == ["task_01"]
    assert ch.still_solved == 4 and ch.still_failed == 2  # task_02 and task_09
    assert ch.only_previous == [] and ch.only_last == []


def test_intervals() -> None:
    lo, hi = wilson(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-3) and hi == pytest.approx(0.7634, abs=1e-3)
    assert wilson(0, 0) is None and wilson(0, 10)[0] == 0.0
    # Newcombe (1998) example: 56/70 vs 48/80 -> difference 0.2 in [0.0524, 0.3339]
    lo, hi = newcombe(48, 80, 56, 70)
    assert lo == pytest.approx(0.0524, abs=1e-3) and hi == pytest.approx(0.3339, abs=1e-3)
    big = newcombe(300, 1000, 400, 1000)  # a real 10-point change on 1000 episodes each
    assert big[0] > 0 and math.isclose(sum(big) / 2, 0.1, abs_tol=0.01)


def test_cli_table_html_json(store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rep" / "report.html"
    assert main(["report", str(store), "--glob", "nightly-*", "--split", "validation", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0].startswith("run") and "change vs previous" in lines[0]
    assert [ln.split()[0] for ln in lines[2:5]] == ["nightly-c", "nightly-a", "nightly-b"]
    assert "15.0%" in lines[2] and "35.0%" in lines[4] and "+8.7pp" in lines[4]
    assert "3 newly solved, 1 newly failed" in text and "task_01" in text
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "</svg>" in page
    assert page.count("<circle") == 3
    for name in ("nightly-a", "nightly-b", "nightly-c", "task_06", "task_01"):
        assert name in page
    assert "other-run" not in page and "<script" not in page and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")

    assert main(["report", str(store), "--glob", "nightly-*", "--split", "validation", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["run"] for r in data["runs"]] == ["nightly-c", "nightly-a", "nightly-b"]
    assert data["runs"][2]["pass_rate"] == pytest.approx(0.35)
    assert data["runs"][2]["delta"] == pytest.approx(0.35 - 5 / 19)
    assert len(data["runs"][2]["delta_ci"]) == 2
    assert data["changes"]["newly_failed"] == ["task_01"]


@pytest.mark.parametrize("case", ["missing", "file", "run_dir", "no_match"])
def test_bad_store_one_line_exit_2(store: Path, tmp_path: Path, case: str) -> None:
    arg, glob = {
        "missing": (tmp_path / "nope", "*"),
        "file": (store / "nightly-a" / "run.json", "*"),
        "run_dir": (store / "nightly-b", "*"),
        "no_match": (store, "weekly-*"),
    }[case]
    if case == "file":
        arg = next((store / "nightly-a").glob("part-*.parquet"))
    r = subprocess.run([sys.executable, "-m", "et_hpc.cli", "report", str(arg), "--glob", glob], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("et-hpc: error: ") and "Traceback" not in r.stderr
    assert str(arg) in err[0]
    if case == "no_match":
        assert "nightly-a" in err[0]  # names what is there


@pytest.mark.slurm
def test_nightly_script_end_to_end(base_sif: Path, tmp_path: Path) -> None:
    """slurm/nightly.sbatch on two 'checkpoints': the real vllm.sbatch goes through real Slurm with the
    scripted server standing in for 'vllm serve' (same flags, same API); episodes run in real apptainer."""
    tasks, et_hpc = built_validation_set(tmp_path)
    # checkpoint "weak" writes the wrong greeting, "strong" the right one
    scripts = {"weak": "printf 'hello\\n' > /home/user/greeting.txt", "strong": "printf 'Hello, et-hpc!\\n' > /home/user/greeting.txt"}
    for name, cmd in scripts.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({"greeting.txt": [{"command": cmd}]}))
    shim = tmp_path / "vllm"
    shim.write_text(f"""#!/bin/bash
model=$2; port=""
while [ $# -gt 0 ]; do [ "$1" = --port ] && port=$2; shift; done
exec {sys.executable} -m et_hpc.scripted_server --script "{tmp_path}/$(basename "$model").json" --port "$port" --model "$model"
""")
    shim.chmod(0o755)
    store = tmp_path / "store"
    jobs = []
    for day, name in (("20250301", "weak"), ("20250302", "strong")):
        env = dict(
            os.environ,
            CKPT=str(tmp_path / "ckpts" / name),
            TASKS=str(tasks),
            ET_HPC_STORE=str(store),
            ET_HPC=et_hpc,
            VLLM=str(shim),
            NIGHTLY_DATE=day,
            ENDPOINT_WAIT_S="600",
            VLLM_SBATCH_ARGS=f"--gres=none --mem=500M -c 1 --time=15 --output={tmp_path}/vllm-%j.log",
            ET_HPC_RUN_ARGS="--executor local --concurrency 1",
        )
        r = subprocess.run(
            ["bash", str(REPO / "slurm" / "nightly.sbatch")], env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path
        )
        assert r.returncode == 0, r.stdout + r.stderr
        job = r.stdout.split("vLLM job ")[1].split()[0]
        jobs.append(job)
        assert f"cancelling vLLM job {job}" in r.stdout
        assert not (store / ".nightly" / f"endpoint-nightly-{day}-{name}.json").exists()
    rep = build_report(store, "nightly-*")
    assert [r.run for r in rep.runs] == ["nightly-20250301-weak", "nightly-20250302-strong"]
    assert [(r.ok, r.solved) for r in rep.runs] == [(1, 0), (1, 1)]
    assert rep.runs[1].model == str(tmp_path / "ckpts" / "strong")
    assert rep.changes.newly_solved == ["demo_hello_file"]
    page = (store / "nightly-report.html").read_text()
    assert "<svg" in page and "nightly-20250301-weak" in page and "nightly-20250302-strong" in page
    for job in jobs:  # the vLLM jobs did not outlive the script
        for _ in range(30):
            q = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True)
            if not q.stdout.strip():
                break
            time.sleep(1)
        assert not q.stdout.strip(), f"vLLM job {job} still {q.stdout.strip()}"
