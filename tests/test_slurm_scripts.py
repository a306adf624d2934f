"""The sbatch scripts: shell syntax, and vllm.sbatch's endpoint file life cycle with a stand-in server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((REPO / "slurm").glob("*.sbatch"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_sbatch_syntax(script: Path) -> None:
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "#SBATCH --job-name=" in script.read_text()


def test_vllm_script_writes_and_removes_endpoint(tmp_path: Path) -> None:
    script = tmp_path / "s.json"
    script.write_text(json.dumps({"hi": ["hello"]}))
    shim = tmp_path / "vllm"  # stands in for 'vllm serve MODEL ... --port P': same flags, same API
    shim.write_text(f"""#!/bin/bash
model=$2; port=""
while [ $# -gt 0 ]; do [ "$1" = --port ] && port=$2; shift; done
exec {sys.executable} -m et_hpc.scripted_server --script {script} --port "$port" --model "$model"
""")
    shim.chmod(0o755)
    ep = tmp_path / "shared" / "endpoint.json"
    env = dict(os.environ, VLLM=str(shim), HEALTH_EVERY_S="1", SLURM_JOB_ID="4242")
    proc = subprocess.Popen(["bash", str(REPO / "slurm" / "vllm.sbatch"), "my-model", str(ep)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(300):
            if ep.exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert ep.exists(), proc.stdout.read() if proc.poll() is not None else "no endpoint file"
        data = json.loads(ep.read_text())
        assert set(data) == {"host", "port", "model", "job_id", "base_url", "started_at"}
        assert data["model"] == "my-model" and data["job_id"] == "4242"
        assert data["base_url"] == f"http://{data['host']}:{data['port']}/v1"
        url = f"http://127.0.0.1:{data['port']}/v1/models"
        with urllib.request.urlopen(url, timeout=10) as r:
            assert "my-model" in r.read().decode()
        assert not list(ep.parent.glob(".endpoint.*"))  # no temp file left beside it
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    assert proc.returncode != 0 and not ep.exists(), out
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=3)
