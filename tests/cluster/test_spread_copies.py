"""What only several nodes show, part 1: an array run spreads over the nodes with each unit run once,
and each node makes its own node-local image copy (or unpacked tree) once, under its own lock."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from collections import Counter
from pathlib import Path

import pytest

from et_hpc.runner.plan import open_store
from helpers import until
from helpers.demo import DEMO, TASK
from helpers.rig import NODES, PARTITION, on_nodes, python

pytestmark = [pytest.mark.slurm, pytest.mark.apptainer]

SAMPLES = 6


def _sacct_nodes(array_id: str) -> dict[int, str]:
    """The node each array task of ``array_id`` ran on, by task index, as Slurm accounted it."""
    out = subprocess.run(
        ["sacct", "-n", "-P", "-X", "-j", array_id, "-o", "JobID,NodeList"], capture_output=True, text=True, timeout=60
    ).stdout
    got = {}
    for line in out.splitlines():
        jid, _, node = line.partition("|")
        if "_" in jid and jid.split("_")[1].isdigit():
            got[int(jid.split("_")[1])] = node.strip()
    return got


def test_array_run_spreads_over_nodes_each_unit_once_each_node_copies_once(demo_image, shared: Path) -> None:
    scratch = f"/tmp/et-rig-{uuid.uuid4().hex[:8]}"  # the same path on each node, a different disk
    cfg = shared / "run.yaml"
    cfg.write_text(
        textwrap.dedent(f"""\
            name: spread
            tasks: {{source: {DEMO}, ids: [{TASK}]}}
            samples: {SAMPLES}
            executor: slurm
            store: {shared / "store"}
            slurm: {{partition: {PARTITION}, units_per_task: 1, cpus_per_task: 2, time_min: 20, poll_s: 2}}
            sandbox: {{local_copy: always}}
            """)
    )
    env = {**os.environ, "ET_HPC_SCRATCH": scratch}
    r = subprocess.run(
        [sys.executable, "-m", "et_hpc.cli", "run", "--config", str(cfg), "--policy", "oracle"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    store = open_store(shared / "store" / "spread")
    rows = store.read(dedupe=False).to_pylist()
    counts = Counter((row["task_id"], row["sample"]) for row in rows)
    assert counts == Counter({(TASK, s): 1 for s in range(SAMPLES)}), counts  # each unit once, none twice
    assert {row["status"] for row in rows} == {"ok"} and {row["reward"] for row in rows} == {1.0}
    hosts = {row["host"] for row in rows}
    # 2-core array tasks on 2-core nodes: the first three run at once, one per node
    assert hosts == set(NODES), hosts
    for row in rows:
        assert row["worker"].startswith(row["host"] + ":"), row["worker"]
    # Slurm's own accounting agrees with where each record says it ran
    array_ids = {row["slurm_job_id"] for row in rows}
    assert len(array_ids) == 1
    array_id = array_ids.pop()
    want = {row["slurm_array_task_id"] for row in rows}
    # accounting learns of a task's end after the task has stored its result: wait for it

    def all_placed() -> dict[int, str] | None:
        got = _sacct_nodes(array_id)
        return got if got.keys() >= want else None

    placed = until(f"accounting to place every task of array {array_id}", all_placed, 120, every_s=2)
    for row in rows:
        assert placed[row["slurm_array_task_id"]] == row["host"], (placed, row["slurm_array_task_id"], row["host"])

    # each node holds exactly one copy of the image, made by one of that node's own workers
    lister = textwrap.dedent("""\
        import json, pathlib, socket, sys
        d = pathlib.Path(sys.argv[1]) / f"et-hpc-{__import__('getpass').getuser()}" / "images"
        print(json.dumps({"host": socket.gethostname(), "copies": [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))],
                          "ino": [p.stat().st_ino for p in sorted(d.glob("*.sif"))]}))
        """)
    outs = on_nodes({n: python(lister, scratch) for n in NODES}, shared)
    workers = {(row["host"], int(row["worker"].split(":")[1])) for row in rows}
    for node, text in outs.items():
        got = json.loads(text.strip().splitlines()[-1])
        assert got["host"] == node
        assert len(got["copies"]) == 1, got  # one copy per node, however many episodes used it
        assert (node, got["copies"][0]["pid"]) in workers, (node, got["copies"][0], workers)
    assert not (shared / "store" / "images").exists()


RACE = textwrap.dedent("""\
    # K processes on this node ask for the node-local copy (or tree) of one SIF at once
    import json, multiprocessing as mp, socket, sys, time
    from pathlib import Path
    from et_hpc.images.local_copy import local_image, local_tree
    sif, scratch, kind, k, go = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), Path(sys.argv[5])

    def one(_):
        while not go.exists():  # every node's racers start together
            time.sleep(0.05)
        got = (local_tree if kind == "tree" else local_image)(sif, None, scratch=scratch)
        try:
            return {"copied": got.copied, "path": str(got.path), "ino": got.path.stat().st_ino}
        finally:
            got.release()

    with mp.Pool(k) as pool:
        res = pool.map(one, range(k))
    print(json.dumps({"host": socket.gethostname(), "results": res}))
    """)


@pytest.mark.parametrize("kind", ["copy", "tree"])
def test_each_node_copies_or_unpacks_once_under_its_own_lock(demo_image, shared: Path, kind: str) -> None:
    scratch = f"/tmp/et-rig-race-{uuid.uuid4().hex[:8]}"
    go = shared / "go"
    procs = {}
    import threading

    from helpers.rig import on_node

    for n in NODES:
        procs[n] = on_node(n, python(RACE, str(demo_image.path), scratch, kind, "3", str(go)), shared / f"{n}.out")
    threading.Timer(3.0, go.touch).start()  # the racers on every node wait for this file
    outs = {}
    for n, p in procs.items():
        assert p.wait(timeout=600) == 0, (shared / f"{n}.out").read_text()[-3000:]
        outs[n] = json.loads((shared / f"{n}.out").read_text().strip().splitlines()[-1])
    for n, got in outs.items():
        assert got["host"] == n
        copied = [r for r in got["results"] if r["copied"]]
        assert len(copied) == 1, got  # one racer made the node's copy, the others waited for it and used it
        assert len({r["ino"] for r in got["results"]}) == 1, got  # all racers on the node use that one copy
    # three nodes, three copies: the same path on each node, three different files (node-local disks)
    assert len({got["results"][0]["path"] for got in outs.values()}) == 1
    assert not go.with_name("images").exists()
