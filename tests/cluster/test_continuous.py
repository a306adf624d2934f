"""A continuous run with its workers on several nodes of the rig: oracle episodes on the demo task,
a trainer (slurm/train_loop.py) taking its batches; every group reaches the trainer exactly once,
every committed unit is in the stream once, nothing stays leased, and the groups came from more
than one node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from et_hpc.rollouts.queue import WorkQueue, slot_name
from et_hpc.runner.slurm import load_jobs
from helpers import REPO, until
from helpers.demo import DEMO, TASK
from helpers.rig import NODES, PARTITION

pytestmark = [pytest.mark.slurm, pytest.mark.apptainer]

ET_HPC = [sys.executable, "-m", "et_hpc.cli"]
BATCHES = 6


def test_continuous_run_with_workers_on_several_nodes_is_exactly_once(demo_image, shared: Path) -> None:
    env = dict(os.environ, ET_HPC_STORE=str(shared / "store"))
    run_dir = shared / "store" / "multi"
    sets = {
        "tasks.ids": f"[{TASK}]",
        "slurm.partition": PARTITION,
        "slurm.cpus_per_task": "2",
        "slurm.time_min": "20",
        "continuous.lease_s": "30",
        "continuous.heartbeat_s": "2",
        "continuous.poll_s": "1",
        "continuous.stop_grace_s": "60",
    }
    args = ["run", str(DEMO), "--policy", "oracle", "--samples", "2", "--run-name", "multi", "--continuous"]
    args += ["--executor", "slurm", "--workers", str(len(NODES)), "--concurrency", "1", "--json"]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    ctl = subprocess.Popen(ET_HPC + args, env=env, stdout=open(shared / "ctl.out", "w"), stderr=open(shared / "ctl.err", "w"))
    trainer = None
    try:
        until("the worker array", lambda: load_jobs(run_dir)["submissions"], 180)
        trainer = subprocess.Popen(
            [sys.executable, str(REPO / "slurm" / "train_loop.py"), str(run_dir), "--batches", str(BATCHES), "--groups", "1"]
            + ["--record-seen", "--step-s", "0.5", "--timeout", "600", "--stop-at-end"],
            env=env,
            stdout=open(shared / "trainer.log", "w"),
            stderr=subprocess.STDOUT,
        )
        assert trainer.wait(timeout=900) == 0, (shared / "trainer.log").read_text()[-3000:]
        rc = ctl.wait(timeout=300)
    finally:
        for p in (trainer, ctl):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(30)
        ids = [j for s in load_jobs(run_dir)["submissions"] for j in s["job_ids"]] if (run_dir / "jobs.json").exists() else []
        if ids:
            subprocess.run(["scancel", *ids], timeout=30)
    assert rc == 0, (shared / "ctl.err").read_text()[-3000:]

    q = WorkQueue(run_dir)
    cur = json.loads((run_dir / "consumers" / "trainer-0.json").read_text())
    seen = cur["state"]["seen"]
    assert [s for s, _ in seen] == list(range(BATCHES)) and len({g for _, g in seen}) == BATCHES, seen
    assert q.count()["leased"] == 0
    done = [n for n in os.listdir(q.done) if n.endswith(".json")]
    by_uid = Counter(n.split("~")[0] for n in done)
    assert by_uid and set(by_uid.values()) == {1}, by_uid
    hosts = Counter()
    for s in range(q.published()):
        rows = pq.read_table(run_dir / slot_name(s), columns=["status", "host"]).to_pylist()
        assert {r["status"] for r in rows} == {"ok"}
        hosts.update(r["host"] for r in rows)
    assert set(hosts) <= set(NODES) and len(hosts) >= 2, hosts  # the stream was fed from several nodes


def test_continuous_run_loses_a_node_and_its_leases_expire(demo_image, shared: Path) -> None:
    """A node dies while its worker holds a lease: the lease expires, its unit goes back to the
    queue and is done elsewhere, and the stream still holds every group once."""
    from helpers.rig import UP, node_states, rig

    victim = NODES[1]
    tag = victim.replace("-", "_") + "-"  # worker ids start with the host (et_hpc.rollouts.queue)
    env = dict(os.environ, ET_HPC_STORE=str(shared / "store"))
    run_dir = shared / "store" / "lossy"
    q = WorkQueue(run_dir)
    args = ["run", str(DEMO), "--policy", "oracle", "--samples", "2", "--run-name", "lossy", "--continuous"]
    args += ["--executor", "slurm", "--workers", str(len(NODES)), "--concurrency", "1", "--json"]
    sets = {
        "tasks.ids": f"[{TASK}]",
        "slurm.partition": PARTITION,
        "slurm.cpus_per_task": "2",
        "slurm.time_min": "20",
        "continuous.lease_s": "20",
        "continuous.heartbeat_s": "2",
        "continuous.poll_s": "1",
        "continuous.stop_grace_s": "60",
    }
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    ctl = subprocess.Popen(ET_HPC + args, env=env, stdout=open(shared / "ctl.out", "w"), stderr=open(shared / "ctl.err", "w"))
    trainer = None
    try:
        until("the worker array", lambda: load_jobs(run_dir)["submissions"], 180)
        trainer = subprocess.Popen(
            [sys.executable, str(REPO / "slurm" / "train_loop.py"), str(run_dir), "--batches", str(BATCHES), "--groups", "1"]
            + ["--record-seen", "--step-s", "0.5", "--timeout", "900", "--stop-at-end"],
            env=env,
            stdout=open(shared / "trainer.log", "w"),
            stderr=subprocess.STDOUT,
        )
        held = until(
            f"a lease held on {victim}", lambda: [n for n in os.listdir(q.leased) if worker_of(n).startswith(tag)], 300, every_s=0.1
        )
        killed = rig("kill", victim)
        assert killed.returncode == 0, killed.stderr
        assert trainer.wait(timeout=900) == 0, (shared / "trainer.log").read_text()[-3000:]
        ctl.wait(timeout=300)
    finally:
        for p in (trainer, ctl):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(30)
        ids = [j for s in load_jobs(run_dir)["submissions"] for j in s["job_ids"]] if (run_dir / "jobs.json").exists() else []
        if ids:
            subprocess.run(["scancel", *ids], timeout=30)
        back = rig("up", victim)
    assert back.returncode == 0, back.stdout + back.stderr
    assert node_states()[victim] in UP, node_states()
    logs = (shared / "ctl.err").read_text() + "".join(p.read_text(errors="replace") for p in (run_dir / "slurm").rglob("*_log.*"))
    uids = {n.split("~")[0] for n in held}
    assert any(f"lease {u}~" in logs and "expired" in logs for u in uids), (uids, logs[-3000:])  # the lost node's lease expired
    cur = json.loads((run_dir / "consumers" / "trainer-0.json").read_text())
    seen = cur["state"]["seen"]
    assert [s for s, _ in seen] == list(range(BATCHES)) and len({g for _, g in seen}) == BATCHES, seen
    done = [n for n in os.listdir(q.done) if n.endswith(".json")]
    by_uid = Counter(n.split("~")[0] for n in done)
    assert by_uid and set(by_uid.values()) == {1}, by_uid
    assert uids & set(by_uid) or q.count()["pending"], (uids, by_uid)  # the lost unit was done elsewhere (or is queued again)


def worker_of(name: str) -> str:
    """The worker id in a lease file's name (``<uid>~<worker>.<rand>.json``)."""
    return name.split("~", 1)[1] if "~" in name else ""
