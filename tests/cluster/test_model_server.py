"""A model server on one node of the rig, found by the other nodes' episodes through its endpoint
file and used there with its key: the scripted server, and `et-hpc model serve` (llama-server)
started by slurm/model-cpu.sbatch, on rig1; a Slurm run kept off rig1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from et_hpc.runs.store import open_run
from helpers import REPO, need, until
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


def _job_id(proc: subprocess.Popen) -> str:
    """The id ``sbatch --parsable --wait`` prints at submission."""
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line, "sbatch printed no job id"
    return line.split(";")[0]


def _command_lines() -> list[str]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return out


def _published(ep: Path, server: subprocess.Popen, out: Path) -> bool:
    """The endpoint file is there; a server job that ended first fails the test with its log."""
    if ep.exists() and json.loads(ep.read_text()).get("port"):
        return True
    if server.poll() is not None:
        pytest.fail(f"the model server's job ended ({server.returncode}):\n{out.read_text()[-3000:] if out.exists() else ''}")
    return False


@pytest.fixture
def model() -> None:
    need("model")  # before the image: with CI=true a missing llama-server or embedded model fails


@pytest.mark.timeout(2400)  # a real model's turns, and jobs that queue behind the rig's other work
def test_et_hpc_model_serve_on_one_node_is_used_from_the_others_with_its_key(model, demo_image, shared: Path) -> None:
    """`et-hpc model serve` (llama-server, the embedded model) started by slurm/model-cpu.sbatch on
    rig1; the other nodes find it through its endpoint file on the shared home and a real episode
    kept off rig1 is answered by it. Its key is made by the server and travels in the endpoint file
    and environments only."""
    server_node, others = NODES[0], NODES[1:]
    ep = shared / "private" / "endpoint.json"
    out = shared / "model-server.out"
    sbatch = ["sbatch", "--parsable", "--wait", "-p", PARTITION, "-w", server_node, "-N", "1", "-c", "2", "--mem=1G"]
    sbatch += ["--time=30", "-o", str(out), str(REPO / "slurm" / "model-cpu.sbatch"), str(ep)]
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "VLLM_API_KEY", "LLAMA_API_KEY")}
    env |= {"ET_HPC": f"{sys.executable} -m et_hpc.cli", "CTX": "4096"}
    server = subprocess.Popen(sbatch, env=env, stdout=subprocess.PIPE, text=True)
    job = _job_id(server)
    try:
        until("the model server's endpoint file", lambda: _published(ep, server, out), 600)
        rec = json.loads(ep.read_text())
        key = rec["api_key"]
        assert rec["host"] == server_node and rec["job_id"] == job, rec  # it names its node, not 127.0.0.1
        assert rec["model_version"].startswith("SmolLM2") and "@sha256-" in rec["model_version"], rec
        assert ep.stat().st_mode & 0o777 == 0o600
        # positive control: from the other nodes, the key is what opens the server
        for n, text in on_nodes({n: python(PROBE, str(ep)) for n in others}, shared).items():
            got = json.loads(text.strip().splitlines()[-1])
            assert got == {"host": n, "with_key": 200, "without": 401}, got
        # the nodes share this machine's process table: llama-server is there, its key on no command line
        lines = _command_lines()
        assert any(rec["model_version"] in c for c in lines), "llama-server's command line not found"
        assert not [c for c in lines if key in c]
        cmd = [sys.executable, "-m", "et_hpc.cli", "run", str(DEMO), "--samples", "1", "--executor", "slurm"]
        cmd += ["--store", str(shared / "store"), "--run-name", "llama", "--policy", "openai"]
        sets = [
            f"tasks.ids=[{TASK}]",
            f"policy.endpoint_file={ep}",
            "policy.max_retries=2",
            "budgets.max_turns=2",
            "budgets.max_tokens_per_turn=64",
            f"slurm.partition={PARTITION}",
            "slurm.cpus_per_task=2",
            "slurm.units_per_task=1",
            "slurm.time_min=20",
            "slurm.poll_s=2",
            f"slurm.additional_parameters={{exclude: {server_node}}}",
        ]
        for s in sets:
            cmd += ["--set", s]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
        assert r.returncode in (0, 1), r.stdout[-2000:] + r.stderr[-3000:]  # 1: the model did not solve it
    finally:
        subprocess.run(["scancel", job], timeout=60)
        server.wait(timeout=120)
    assert not ep.exists()  # the job's end took its endpoint file with it
    recs = open_run(shared / "store" / "llama").records()
    assert len(recs) == 1, recs
    got = recs[0]
    assert got.status == "ok" and got.reward is not None and got.turns >= 1, (got.status, got.error)
    assert got.host in others, got.host  # run on another node ...
    assert got.policy_version == rec["model_version"] and got.version_source == "response"  # ... answered by rig1's model
    written = [p for p in (shared / "store").rglob("*") if p.is_file()] + [out]
    leaked = [str(p) for p in written if key.encode() in p.read_bytes()]
    assert leaked == [], leaked  # the key stayed in the endpoint file and the server's environment
