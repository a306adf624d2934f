"""The "Training session" of slurm/README.md, command by command, with the scripted server standing in
for vLLM: the controller as a batch job (slurm/run.sbatch ... --continuous), continuous workers as
a Slurm array, et-hpc status and rollouts tail, the trainer loop switching checkpoints
(trainer-owned versions, one served model name per version), rollouts publish by hand, and
rollouts stop. Groups carry exact token ids; versions and model names follow the trainer's switches.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from et_hpc.host import slurm as watch
from et_hpc.rollouts.queue import WorkQueue
from et_hpc.runner.slurm import load_jobs
from helpers import REPO, until

ET_HPC = [sys.executable, "-m", "et_hpc.cli"]
DEMO = REPO / "defs" / "demo"
SOLVE = "printf 'Hello, et-hpc!\\n' > /home/user/greeting.txt"


@pytest.mark.slurm
@pytest.mark.apptainer
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_training_session_from_the_slurm_readme(base_sif: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    env = dict(os.environ, ET_HPC_STORE=str(store), ET_HPC=shutil.which("et-hpc") or "et-hpc")
    b = subprocess.run(ET_HPC + ["build", str(DEMO)], env=env, capture_output=True, text=True, timeout=600)
    assert b.returncode == 0, b.stderr[-2000:]
    # the stand-in for 'sbatch -p gpu slurm/vllm.sbatch MODEL endpoint.json': same endpoint file
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"greeting.txt": [{"command": SOLVE}, "All done."]}))
    ep = tmp_path / "endpoint.json"
    srv = subprocess.Popen(
        [sys.executable, "-m", "et_hpc.scripted_server", "--script", str(script), "--port", "0", "--endpoint-file", str(ep)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    ctl_job = None
    try:
        until("the endpoint file", ep.exists, 60)
        cfg = tmp_path / "train.yaml"
        cfg.write_text(f"""\
name: grpo-live
tasks: {{source: {DEMO}, ids: [demo_hello_file]}}
samples: 2
policy: {{kind: openai, endpoint_file: {ep}, logprobs: true, return_token_ids: true}}
executor: slurm
concurrency: 1
slurm: {{cpus_per_task: 1, time_min: 30}}
continuous: {{workers: 2, lease_s: 30, heartbeat_s: 2, poll_s: 1, on_version_change: finish}}
""")
        # the controller as a batch job
        sb = subprocess.run(
            ["sbatch", "--parsable", str(REPO / "slurm" / "run.sbatch"), str(cfg), "--continuous"],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert sb.returncode == 0, sb.stderr
        ctl_job = sb.stdout.strip().split(";")[0]
        run_dir = store / "grpo-live"
        q = WorkQueue(run_dir)
        until("the first group", lambda: q.exists() and q.published() >= 1, 300)

        st = subprocess.run(ET_HPC + ["status", "grpo-live"], env=env, capture_output=True, text=True, timeout=60)
        assert st.returncode == 0 and "queue.pending" in st.stdout and "queue.workers_live" in st.stdout, st.stdout
        tail = subprocess.run(
            ET_HPC + ["rollouts", "tail", "grpo-live", "--from-start", "--count", "1"], env=env, capture_output=True, text=True, timeout=120
        )
        assert tail.returncode == 0 and "demo_hello_file@e" in tail.stdout and "rewards [1 1]" in tail.stdout, tail

        # the trainer: 4 steps of 1 group, a new checkpoint after each step (served as ckpt-<step>)
        tr = subprocess.run(
            [
                sys.executable,
                str(REPO / "slurm" / "train_loop.py"),
                str(run_dir),
                "--batches",
                "4",
                "--groups",
                "1",
                "--max-staleness",
                "1",
                "--publish-every",
                "1",
                "--model-prefix",
                "ckpt-",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=480,
        )
        assert tr.returncode == 0, tr.stdout[-2000:] + tr.stderr[-2000:]
        assert "published version 4" in tr.stdout
        pub = subprocess.run(
            ET_HPC + ["rollouts", "publish", "grpo-live", "--model", "ckpt-final"], env=env, capture_output=True, text=True, timeout=60
        )
        assert pub.returncode == 0 and "published version 5" in pub.stdout, pub
        from et_hpc.rollouts import RolloutStream

        with RolloutStream(run_dir, "check") as s:
            late = s.next_batch(1, timeout_s=300)  # wait for a group started under version 5
            while late and late[0].version != 5:
                late = s.next_batch(1, timeout_s=300)
            assert late, "no group under version 5"
            assert {r.model for r in late[0].records} == {"ckpt-final"}
            data = late[0].scored_data()
            assert len(data["tokens"]) == 2 and all(len(t) == len(m) for t, m in zip(data["tokens"], data["masks"]))
            assert all(any(x != -100 for x in m) for m in data["masks"])
            assert {r.tokens_source for r in late[0].records} == {"server-exact"}
        stop = subprocess.run(ET_HPC + ["rollouts", "stop", "grpo-live"], env=env, capture_output=True, text=True, timeout=60)
        assert stop.returncode == 0, stop.stderr
        states, ended = watch.wait_tasks([ctl_job], poll_s=2, timeout_s=240)
        assert ended and states[ctl_job] == "COMPLETED", states
    finally:
        if ctl_job:
            subprocess.run(["scancel", ctl_job], timeout=30)
        for s in load_jobs(store / "grpo-live")["submissions"] if (store / "grpo-live" / "jobs.json").exists() else []:
            subprocess.run(["scancel", *s["job_ids"]], timeout=30)
        srv.terminate()
        srv.wait(30)
    # every group of the run: one version per group, served by the model of that version
    with RolloutStream(run_dir, "audit") as s:
        groups = s.next_batch(10_000, timeout_s=1)
    assert max(g.version or 0 for g in groups) == 5
    for g in groups:
        assert len({r.policy_version for r in g.records}) == 1
        if g.version:
            assert {r.model for r in g.records} == {f"ckpt-{g.version}" if g.version < 5 else "ckpt-final"}
    assert q.count()["leased"] == 0
    log = next(tmp_path.glob("et-run-*.log")).read_text()
    assert "continuous run grpo-live" in log and "stopped by hand" in log
