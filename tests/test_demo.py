"""The README's demo command, end to end: images, local and Slurm episodes, store, summary."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.apptainer
@pytest.mark.slurm
def test_demo_end_to_end(base_sif, tmp_path):
    store = tmp_path / "store"
    r = subprocess.run(
        [sys.executable, "-m", "et_hpc.cli", "demo", "--store", str(store), "--samples", "1", "--base-source", "debian"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    table = r.stdout.split("==> summary", 1)[1]
    rows = [ln.split() for ln in table.splitlines() if ln.startswith("demo-") and not ln.startswith("demo-model-")]
    # the real-model rows (the solving tier, token-in with the protocol's grammar): every episode ok,
    # whatever the pass rate; tools mode locally on all 4 demo tasks, text mode and Slurm on 2
    model_rows = [ln.split() for ln in table.splitlines() if ln.startswith("demo-model-")]
    assert {(row[2], row[3]) for row in model_rows} == {("tools", "local"), ("text", "local"), ("tools", "slurm")}, table
    for row in model_rows:
        want = "4" if (row[2], row[3]) == ("tools", "local") else "2"
        assert row[1].startswith("qwen2.5-coder-1.5b") and row[-2] == "ok" and row[5] == row[4] == want and row[6] == "0", row
    assert {(row[1], row[2]) for row in rows} == {("local", "oracle"), ("local", "null"), ("slurm", "oracle")}
    for row in rows:
        assert row[-2:] == ["as", "expected"], row
    from et_hpc.runs.store import RunStore

    assert "viewer: " + str(store / "_view") in r.stdout
    # _view: the viewer; -model-: the real-model runs, checked by their rows above
    runs = sorted(p for p in store.iterdir() if p.is_dir() and not p.name.startswith("_") and "-model-" not in p.name)
    assert len(runs) == 3
    for run in runs:
        s = RunStore(run).summary()
        assert s.units == 4 and s.ok == 4
        assert s.solved == (4 if "-oracle-" in run.name else 0)
