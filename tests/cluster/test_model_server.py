"""A model server on one node of the rig, found by the other nodes' episodes through its endpoint
file and used there with its key: the scripted server on rig1, a Slurm run kept off rig1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from et_hpc.runs.store import open_run
from helpers import until
from helpers.demo import DEMO, KEY, SOLVE, TASK
from helpers.rig import NODES, PARTITION, on_node, on_nodes, python

pytestmark = [pytest.mark.slurm, pytest.mark.apptainer]

SECRET = "rig-key-3b1f9c"  # a key that must reach the server and never a file et-hpc writes

PROBE = textwrap.dedent("""\
    # from another node: the server answers its key only
    import json, socket, sys, urllib.error, urllib.request
    ep = json.load(open(sys.argv[1]))
    def get(key):
        req = urllib.request.Request(ep["base_url"] + "/models", headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            return urllib.request.urlopen(req, timeout=20).status
        except urllib.error.HTTPError as e:
            return e.code
    print(json.dumps({"host": socket.gethostname(), "with_key": get(ep["api_key"]), "without": get(None)}))
    """)


def test_model_server_on_one_node_is_used_from_the_others_with_its_key(demo_image, shared: Path) -> None:
    server_node, others = NODES[0], NODES[1:]
    script = shared / "script.json"
    script.write_text(json.dumps({KEY: [{"command": SOLVE}, "done"]}))
    ep = shared / "private" / "endpoint.json"
    argv = [sys.executable, "-m", "et_hpc.testing.scripted_server", "--script", str(script), "--host", "0.0.0.0"]
    argv += ["--endpoint-file", str(ep), "--log-requests"]
    server = on_node(server_node, argv, shared / "server.out", env={"VLLM_API_KEY": SECRET})
    try:
        until("the server's endpoint file", lambda: ep.exists() and json.loads(ep.read_text()).get("port"), 300)
        rec = json.loads(ep.read_text())
        assert rec["host"] == server_node and rec["api_key"] == SECRET  # it names its node, not 127.0.0.1
        # positive control: from the other nodes, the key is what opens the server
        for n, text in on_nodes({n: python(PROBE, str(ep)) for n in others}, shared).items():
            got = json.loads(text.strip().splitlines()[-1])
            assert got == {"host": n, "with_key": 200, "without": 401}, got
        env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "VLLM_API_KEY")}
        cmd = [sys.executable, "-m", "et_hpc.cli", "run", str(DEMO), "--samples", "2", "--executor", "slurm"]
        cmd += ["--store", str(shared / "store"), "--run-name", "served"]
        sets = [
            f"tasks.ids=[{TASK}]",
            "policy.kind=openai",
            f"policy.endpoint_file={ep}",
            f"slurm.partition={PARTITION}",
            "slurm.cpus_per_task=2",
            "slurm.units_per_task=1",
            "slurm.poll_s=2",
            f"slurm.additional_parameters={{exclude: {server_node}}}",
        ]
        for s in sets:
            cmd += ["--set", s]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    finally:
        subprocess.run(["scancel", "--name", "wrap", "-u", str(os.getuid()), "-w", server_node], timeout=60)
        server.wait(timeout=120)
    recs = open_run(shared / "store" / "served").records()
    assert len(recs) == 2 and {r.status for r in recs} == {"ok"} and {r.reward for r in recs} == {1.0}, recs
    assert {r.host for r in recs} <= set(others), {r.host for r in recs}  # run on the other nodes
    assert "served chat" in (shared / "server.out").read_text()  # and answered by the server on rig1
    leaked = [str(p) for p in (shared / "store").rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaked == [], leaked  # the key travelled in the endpoint file and the job's environment only
