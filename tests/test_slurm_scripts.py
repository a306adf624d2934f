"""The sbatch scripts: shell syntax, and vllm.sbatch's endpoint file life cycle with a stand-in server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from helpers import REPO
from helpers.servers import vllm_shim, wait_for

SCRIPTS = sorted((REPO / "slurm").glob("*.sbatch"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_sbatch_syntax(script: Path) -> None:
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "#SBATCH --job-name=" in script.read_text()


def _get(url: str, key: str | None) -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _body(url: str, key: str) -> bytes:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read()


def _answers(url: str, key: str) -> bool:
    try:
        return _get(url, key) == 200
    except OSError:
        return False


def test_vllm_script_writes_and_removes_endpoint(tmp_path: Path) -> None:
    shim = vllm_shim(tmp_path, {"hi": ["hello"]})
    ep = tmp_path / "shared" / "endpoint.json"
    env = dict(os.environ, VLLM=str(shim), HEALTH_EVERY_S="1", SLURM_JOB_ID="4242")
    env.pop("VLLM_API_KEY", None)
    proc = subprocess.Popen(
        ["bash", str(REPO / "slurm" / "vllm.sbatch"), "my-model", str(ep)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(ep.exists, proc, "the endpoint file")
        data = json.loads(ep.read_text())
        assert set(data) == {
            "host",
            "port",
            "base_url",
            "model",
            "api_key",
            "model_version",
            "served_model",
            "job_id",
            "started_at",
            "written_at",
        }
        assert data["model"] == "my-model" and data["job_id"] == "4242" and data["model_version"] == "my-model"
        assert data["served_model"] is None  # one set of weights for the job's life: no versioned alias
        assert data["base_url"] == f"http://{data['host']}:{data['port']}/v1"
        assert ep.stat().st_mode & 0o777 == 0o600 and ep.parent.stat().st_mode & 0o777 == 0o700
        key = data["api_key"]
        assert isinstance(key, str) and len(key) >= 32
        url = f"http://127.0.0.1:{data['port']}/v1/models"
        assert _get(url, key) == 200  # the key from the file opens the server ...
        assert _get(url, None) == 401 and _get(url, "EMPTY") == 401  # ... and nothing else does
        assert not list(ep.parent.glob(".endpoint.*"))  # no temp file left beside it
        cmdline = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert "scripted_server" in cmdline and key not in cmdline  # not on any command line
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    assert proc.returncode != 0 and not ep.exists(), out
    assert key not in out  # nor in the job's log
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=3)


def test_vllm_script_refuses_a_shared_directory(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    r = subprocess.run(
        ["bash", str(REPO / "slurm" / "vllm.sbatch"), "m", str(shared / "ep.json")],
        env=dict(os.environ, VLLM="/bin/false"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "must be yours alone" in r.stderr and "chmod 700" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (shared / "ep.json").exists()


@pytest.mark.parametrize("switch", ["restart", "reload"])
def test_vllm_script_switches_checkpoints(tmp_path: Path, switch: str) -> None:
    shim = vllm_shim(tmp_path, {"hi": ["hello"]})
    ckpts = tmp_path / "ckpts"
    (ckpts / "step-10").mkdir(parents=True)
    (ckpts / "step-10" / "model.safetensors").write_text("weights 10")
    (ckpts / "step-20").mkdir()
    (ckpts / "step-20" / "model.safetensors").write_text("weights 20")
    ep = tmp_path / "private" / "endpoint.json"
    reloads = tmp_path / "reloads.log"
    reload_cmd = tmp_path / "reload"
    reload_cmd.write_text(f'#!/bin/bash\necho "$1 port=$ET_VLLM_PORT" >> {reloads}\n')
    reload_cmd.chmod(0o755)
    env = dict(os.environ, VLLM=str(shim), POLL_S="1", HEALTH_EVERY_S="1", SWITCH=switch, RELOAD_CMD=str(reload_cmd))
    proc = subprocess.Popen(
        ["bash", str(REPO / "slurm" / "vllm.sbatch"), "--checkpoint-dir", str(ckpts), "policy", str(ep)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        time.sleep(1.5)
        assert not ep.exists() and proc.poll() is None  # no pointer yet: waits for the trainer's first one
        (ckpts / "latest").write_text("step-10 10\n")
        wait_for(ep.exists, proc, "the endpoint file")
        first = json.loads(ep.read_text())
        assert first["model"] == "policy" and first["model_version"] == f"{ckpts}/step-10@step-10"
        # restart serves the weights' own alias first (answers name it); reload keeps its names: none
        alias = f"policy@{ckpts}/step-10@step-10" if switch == "restart" else None
        assert first["served_model"] == alias
        names = [m["id"] for m in json.loads(_body(f"http://127.0.0.1:{first['port']}/v1/models", first["api_key"]))["data"]]
        assert names == ([alias] if alias else []) + ["policy"]
        tmp = ckpts / ".latest.tmp"  # the trainer's atomic pointer update
        tmp.write_text("step-20\n")
        tmp.rename(ckpts / "latest")
        wait_for(
            lambda: (
                json.loads(ep.read_text())["model_version"] != first["model_version"]
                and not json.loads(ep.read_text())["model_version"].startswith("switching ")
            ),
            proc,
            "the republished endpoint",
        )  # reload publishes "switching OLD -> NEW" first
        second = json.loads(ep.read_text())
        assert second["model_version"].startswith(f"{ckpts}/step-20@files-")  # no step: a listing hash
        assert second["served_model"] == (f"policy@{second['model_version']}" if switch == "restart" else None)
        assert second["port"] == first["port"] and second["api_key"] == first["api_key"]
        assert ep.stat().st_mode & 0o777 == 0o600
        # restart publishes the new version before the new server answers (clients retry meanwhile)
        wait_for(
            lambda: _answers(f"http://127.0.0.1:{second['port']}/v1/models", second["api_key"]), proc, "the server on the new checkpoint"
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    served = [ln.split()[-1] for ln in out.splitlines() if ln.startswith("shim serving")]
    if switch == "restart":
        assert served == [str(ckpts / "step-10"), str(ckpts / "step-20")], out
    else:  # one server process; the reload command got the new checkpoint and the port
        assert served == [str(ckpts / "step-10")], out
        assert reloads.read_text().split() == [str(ckpts / "step-20"), f"port={first['port']}"]
    assert "switched (" + switch + ")" in out and first["api_key"] not in out
