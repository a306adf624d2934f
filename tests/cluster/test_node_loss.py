"""Node loss on the rig: a node dies mid-run (its slurmd and every process of the node, SIGKILL).
Slurm marks it down and requeues its array task elsewhere; no unit is lost or run twice, the other
nodes' units run once, untouched; the node comes back afterwards. Prints the time to recover."""

from __future__ import annotations

import os
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

import helpers.units as U
from et_hpc.host import slurm as watch
from et_hpc.runner.config import RunConfig, SlurmConfig
from et_hpc.runner.plan import make_plan, open_store
from et_hpc.runner.slurm import submit, task_ids
from helpers import until, with_tests_on_path
from helpers.rig import NODES, PARTITION, UP, node_states, rig

pytestmark = pytest.mark.slurm

UNITS = 6
VICTIM = NODES[1]


def _placement(array_id: str) -> dict[str, tuple[str, str]]:
    """``<array>_<i>`` -> (state, node) of each array task squeue lists."""
    out = subprocess.run(["squeue", "-h", "-r", "-j", array_id, "-o", "%i|%T|%N"], capture_output=True, text=True, timeout=60).stdout
    got = {}
    for line in out.splitlines():
        jid, state, node = (line.split("|") + ["", ""])[:3]
        got[jid.strip()] = (state.strip(), node.strip())
    return got


def test_node_loss_requeues_its_work_and_loses_or_repeats_no_unit(shared: Path, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", with_tests_on_path(os.environ)["PYTHONPATH"])  # array tasks import helpers.units
    tasks = U.make_tasks(shared, UNITS, sleep_s=25)  # long enough to be mid-unit when the node dies
    cfg = RunConfig(
        name="loss",
        store=shared / "store",
        samples=1,
        concurrency=1,
        executor="slurm",
        unit_runner="helpers.units:work_runner",
        slurm=SlurmConfig(partition=PARTITION, time_min=15, cpus_per_task=2, units_per_task=1, poll_s=1.0),
    )
    plan = make_plan(cfg, tasks=tasks, image_lookup=U.image_lookup)
    subs = submit(plan)
    array_id = subs[0]["array_id"]
    ids = task_ids(subs)
    # the first three array tasks run at once, one per node (2-core tasks on 2-core nodes)
    running = until("an array task running on every node", lambda: _on_every_node(array_id), 300)
    victim_task = next(t for t, (_, node) in running.items() if node == VICTIM)
    until("the victim's unit to start", lambda: len(U.starts(shared)) >= len(NODES), 120)
    try:
        t0 = time.monotonic()
        killed = rig("kill", VICTIM)
        assert killed.returncode == 0, killed.stderr
        until(f"Slurm to mark {VICTIM} down", lambda: node_states()[VICTIM].startswith("down"), 300, every_s=1)
        t_down = time.monotonic() - t0
        moved = until(
            f"{victim_task} to run again on another node",
            lambda: (lambda p: p if p.get(victim_task, ("", ""))[0] == "RUNNING" and p[victim_task][1] != VICTIM else None)(
                _placement(array_id)
            ),
            600,
            every_s=1,
        )
        t_rerun = time.monotonic() - t0
        states, ended = watch.wait_tasks(ids, poll_s=1.0, timeout_s=900)
        t_done = time.monotonic() - t0
        assert ended, states
    finally:
        back = rig("up", VICTIM)
    assert back.returncode == 0, back.stdout + back.stderr
    assert node_states()[VICTIM] in UP, node_states()

    assert set(states.values()) == {"COMPLETED"}, states
    counts = U.record_counts(open_store(plan.run_dir))
    assert counts == Counter({(t.id, 0): 1 for t in tasks}), counts  # no unit lost, none stored twice
    starts = Counter(s[0] for s in U.starts(shared))
    victim_unit = f"t{int(victim_task.split('_')[1]):03d}"
    # the lost node's unit ran again (on another node); every other unit ran exactly once
    assert starts[victim_unit] == 2, starts
    assert all(n == 1 for u, n in starts.items() if u != victim_unit), starts
    recs = {r.task_id: r for r in open_store(plan.run_dir).records()}
    assert recs[victim_unit].versions["restart"] != "0"  # Slurm requeued that array task
    assert {recs[u].versions["restart"] for u in recs if u != victim_unit} == {"0"}
    print(
        f"\nnode loss: {VICTIM} down after {t_down:.0f} s, its unit running again on {moved[victim_task][1]} after "
        f"{t_rerun:.0f} s, all {UNITS} units done after {t_done:.0f} s"
    )


def _on_every_node(array_id: str) -> dict[str, tuple[str, str]] | None:
    p = {t: v for t, v in _placement(array_id).items() if v[0] == "RUNNING"}
    return p if {node for _, node in p.values()} == set(NODES) else None
