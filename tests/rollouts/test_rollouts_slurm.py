"""A continuous run through the real Slurm: 4 long-lived workers, oracle episodes on the demo tasks,
a trainer (slurm/train_loop.py) taking 20 batches while one worker is SIGKILLed, one scancelled and
one requeued; the second test also kills the trainer mid-step and starts it again.

Every group must reach the trainer exactly once (its committed state lists stream slots 0..19 in
order), every committed unit must be in the stream exactly once, nothing may stay leased, and the
run must stop cleanly when the trainer says so.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from et_hpc.host import slurm as watch
from et_hpc.rollouts.queue import WorkQueue, slot_name
from et_hpc.runner.slurm import load_jobs
from helpers import REPO, until
from helpers.slurm import array_workers

ET_HPC = [sys.executable, "-m", "et_hpc.cli"]
DEMO = REPO / "defs" / "demo"
TRAIN = [sys.executable, str(REPO / "slurm" / "train_loop.py")]
BATCHES = 20


def _has_children(pid: int) -> bool:
    r = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, timeout=30)
    return bool(r.stdout.strip())


def _restarts(tid: str) -> int:
    out = subprocess.run(["scontrol", "show", "job", tid], capture_output=True, text=True, timeout=30).stdout
    m = re.search(r"Restarts=(\d+)", out)
    return int(m.group(1)) if m else 0


def _start_trainer(run_dir: Path, env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        TRAIN
        + [str(run_dir), "--batches", str(BATCHES), "--groups", "1", "--record-seen", "--step-s", "1", "--timeout", "300", "--stop-at-end"],
        env=env,
        stdout=open(log, "a"),
        stderr=subprocess.STDOUT,
    )


@pytest.mark.slurm
@pytest.mark.apptainer
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kill_trainer", [False, True], ids=["trainer-steady", "trainer-killed"])
def test_continuous_run_survives_worker_faults(base_sif: Path, tmp_path: Path, kill_trainer: bool) -> None:
    env = dict(os.environ, ET_HPC_STORE=str(tmp_path / "store"))
    b = subprocess.run(ET_HPC + ["build", str(DEMO)], env=env, capture_output=True, text=True, timeout=600)
    assert b.returncode == 0, b.stderr[-2000:]
    run = "live-" + ("k" if kill_trainer else "s")
    run_dir = tmp_path / "store" / run
    q = WorkQueue(run_dir)
    args = [
        "run",
        str(DEMO),
        "--policy",
        "oracle",
        "--samples",
        "2",
        "--run-name",
        run,
        "--continuous",
        "--executor",
        "slurm",
        "--workers",
        "4",
        "--concurrency",
        "1",
        "--json",
        "--set",
        "slurm.cpus_per_task=1",
        "--set",
        "slurm.time_min=20",
        "--set",
        "continuous.lease_s=20",
        "--set",
        "continuous.heartbeat_s=2",
        "--set",
        "continuous.poll_s=1",
        "--set",
        "continuous.stop_grace_s=90",
    ]
    ctl_out, ctl_err = open(tmp_path / "ctl.out", "w+"), open(tmp_path / "ctl.err", "w+")
    ctl = subprocess.Popen(ET_HPC + args, env=env, stdout=ctl_out, stderr=ctl_err)
    tlog = tmp_path / "trainer.log"
    trainer = None
    try:
        subs = until("the worker array", lambda: load_jobs(run_dir)["submissions"], 120)
        tids = subs[0]["job_ids"]
        array_id = subs[0]["array_id"]
        assert len(tids) == 4
        trainer = _start_trainer(run_dir, env, tlog)
        until("2 groups in the stream", lambda: q.published() >= 2, 300)

        def victim():  # a worker in the middle of an episode (it holds a lease)
            for tid, pid in array_workers(array_id).items():
                if _has_children(pid) and q.count()["leased"]:
                    return tid, pid
            return None

        killed, pid = until("a busy worker to SIGKILL", victim, 180, every_s=0.2)
        held = {n.split("~")[0] for n in os.listdir(q.leased) if f"-{pid}-" in n}
        os.kill(pid, signal.SIGKILL)
        live = until(
            "two more running workers",
            lambda: (r := [t for t, s in watch.task_states(tids).items() if s == "RUNNING" and t != killed]) and len(r) >= 2 and r,
            120,
        )
        cancelled, requeued = live[0], live[1]
        subprocess.run(["scancel", cancelled], check=True, timeout=30)
        subprocess.run(["scontrol", "requeue", requeued], check=True, timeout=30)

        if kill_trainer:
            # kill it between getting a batch and committing it (during its 1 s "optimizer step")
            def mid_step():
                lines = tlog.read_text().splitlines() if tlog.exists() else []
                got = [ln for ln in lines if ln.startswith("step ")]
                return got if len(got) >= 5 else None

            got = until("the trainer at step 5", mid_step, 300, every_s=0.05)
            trainer.kill()
            trainer.wait(30)
            last_got = got[-1]
            cur = json.loads((run_dir / "consumers" / "trainer-0.json").read_text())
            assert 1 <= cur["state"]["step"] < BATCHES  # killed mid-stream
            trainer = _start_trainer(run_dir, env, tlog)

        rc_t = trainer.wait(timeout=480)
        assert rc_t == 0, tlog.read_text()[-3000:]
        rc = ctl.wait(timeout=240)  # the trainer asked for the stop
    finally:
        for p in (trainer, ctl):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(30)
        jobs = load_jobs(run_dir)["submissions"] if (run_dir / "jobs.json").exists() else []
        ids = [j for s in jobs for j in s["job_ids"]]
        if ids:
            subprocess.run(["scancel", *ids], timeout=30)
    ctl_err.seek(0)
    err = ctl_err.read()
    ctl_out.seek(0)
    assert rc == 0, err[-3000:]
    info = json.loads(ctl_out.read())
    assert "trainer has its batches" in info["stop_reason"]

    # the faults took effect (positive controls)
    states = watch.task_states(tids)
    assert watch.category(states[killed]) == "failed", states
    assert _restarts(requeued) >= 1 or states[requeued] in ("PENDING", "REQUEUED"), states
    assert watch.category(states[cancelled]) == "failed", states
    logs = err + "".join(p.read_text(errors="replace") for p in (run_dir / "slurm").rglob("*_log.*"))
    if held:  # the SIGKILLed worker's lease expired and its unit went back to the queue
        assert any(f"lease {u}~" in logs and "expired" in logs for u in held), sorted(held)

    # the trainer saw slots 0..19 once each, in order, across its restart
    cur = json.loads((run_dir / "consumers" / "trainer-0.json").read_text())
    seen = cur["state"]["seen"]
    assert cur["state"]["step"] == BATCHES and [s for s, _ in seen] == list(range(BATCHES)), seen
    assert len({g for _, g in seen}) == BATCHES
    if kill_trainer:
        lines = tlog.read_text().splitlines()
        resumed = lines.index(next(ln for ln in lines if ln.startswith("resuming at step") and not ln.endswith("(cursor 0)")))
        first_after = next(ln for ln in lines[resumed:] if ln.startswith("step "))
        # the batch it got but never committed is handed out again, to the same step
        assert first_after.split(" got ")[1] == last_got.split(" got ")[1] or int(first_after.split()[1]) == int(last_got.split()[1]) + 1, (
            last_got,
            first_after,
        )

    # every committed unit is in the stream once; nothing stays leased; no unit ran twice to completion
    assert q.count()["leased"] == 0, os.listdir(q.leased)
    done = [n for n in os.listdir(q.done) if n.endswith(".json")]
    by_uid = Counter(n.split("~")[0] for n in done)
    assert by_uid and set(by_uid.values()) == {1}
    n_slots = q.published()
    assert n_slots == len(done) >= BATCHES
    import pyarrow.parquet as pq

    slot_groups = []
    for s in range(n_slots):
        t = pq.read_table(run_dir / slot_name(s), columns=["group_id", "sample", "status"]).to_pylist()
        assert len(t) == 2 and {r["status"] for r in t} == {"ok"}
        slot_groups.append(t[0]["group_id"])
    done_groups = []
    for n in done:
        u = json.loads((q.done / n).read_text())
        done_groups.append(f"{u['task_id']}@e{u['epoch']}")
    assert sorted(slot_groups) == sorted(done_groups) and len(set(slot_groups)) == n_slots
    assert [g for _, g in seen] == slot_groups[:BATCHES]
    assert not [n for n in os.listdir(q.results) if not n.startswith(".tmp-")]
    print(
        f"\ncontinuous fault run ({'trainer killed' if kill_trainer else 'trainer steady'}): {n_slots} groups, "
        f"killed {killed} (held {sorted(held)}), cancelled {cancelled}, requeued {requeued}"
    )
