"""slurm/nightly.sbatch with SERVER=cpu: the nightly path on a real model without a GPU. Each night's
"checkpoint" (a model name, then a GGUF path) is served by slurm/model-cpu.sbatch (llama-server)
through real Slurm, scored on a demo task in real apptainer, and the trend report covers both."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from helpers import REPO, need
from helpers.demo import built_validation_set


def _gone(job: str) -> bool:
    for _ in range(60):
        q = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True)
        if not q.stdout.strip():
            return True
        time.sleep(1)
    return False


@pytest.mark.slurm
@pytest.mark.apptainer
def test_nightly_on_a_cpu_model_server(base_sif: Path, tmp_path: Path) -> None:
    need("model")
    from et_hpc.model.catalog import prepare
    from et_hpc.runs.report import build_report
    from et_hpc.runs.store import open_run

    tasks, et_hpc = built_validation_set(tmp_path)
    gguf = prepare("smollm2-135m")[0].path
    store = tmp_path / "store"
    for day, ckpt in (("20261205", "smollm2-135m"), ("20261206", str(gguf))):  # a name, then a path
        env = dict(
            os.environ,
            SERVER="cpu",
            CKPT=ckpt,
            TASKS=str(tasks),
            ET_HPC_STORE=str(store),
            ET_HPC=et_hpc,
            NIGHTLY_DATE=day,
            ENDPOINT_WAIT_S="600",
            CTX="4096",
            VLLM_SBATCH_ARGS=f"--mem=1G -c 2 --time=15 --output={tmp_path}/server-%j.log",
            ET_HPC_RUN_ARGS="--executor local --concurrency 1 --set budgets.max_turns=2 --set budgets.max_tokens_per_turn=48",
        )
        r = subprocess.run(
            ["bash", str(REPO / "slurm" / "nightly.sbatch")], env=env, capture_output=True, text=True, timeout=1200, cwd=tmp_path
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        job = r.stdout.split("model server job ")[1].split()[0]
        assert f"cancelling model server job {job}" in r.stdout
        assert _gone(job), f"the model server's job {job} outlived the nightly script"
        assert not list((store / ".nightly").glob("endpoint-*.json"))
    runs = ["nightly-20261205-smollm2-135m", f"nightly-20261206-{gguf.name}"]
    rep = build_report(store, "nightly-*")
    assert [x.run for x in rep.runs] == runs
    for name in runs:
        [rec] = open_run(store / name).records()
        assert rec.status == "ok" and rec.reward is not None, (rec.status, rec.error)
        assert "@sha256-" in rec.policy_version  # answered by llama-server, named by its weights
    page = (store / "nightly-report.html").read_text()
    assert "<svg" in page and all(n in page for n in runs)
