"""Policy versions end to end: ``slurm/vllm.sbatch`` serving a checkpoint directory (the scripted
server standing in for vLLM), a checkpoint switch in the middle of an ``et-hpc run`` on the demo
task's real image, and the store: two policy_versions, and the episode whose turns straddled the
switch flagged ``crossed_version``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from helpers import REPO
from helpers.demo import DEMO, SOLVE, TASK
from helpers.servers import vllm_shim, wait_for


def test_version_fields_from_turns() -> None:
    from et_hpc.episode.run import policy_version_fields

    class P:
        start_version = "a"
        turn_versions: list = []

    p = P()
    assert policy_version_fields(p) == {"policy_version": "a", "policy_versions": ["a"], "crossed_version": False}
    p.turn_versions = [("a", "a"), ("a", "b"), ("b", "b")]  # the second request straddled the switch
    assert policy_version_fields(p) == {"policy_version": "a", "policy_versions": ["a", "b"], "crossed_version": True}
    p.turn_versions = [("b", "b")]  # switched between the policy's start and its first turn: not crossed
    assert policy_version_fields(p)["crossed_version"] is False
    p.start_version, p.turn_versions = None, []
    assert policy_version_fields(p) == {}  # no endpoint file, or a server that names no version


def test_switch_mid_run_is_recorded(demo_image, tmp_path: Path) -> None:
    # the first command leaves the server time to see the new pointer and restart (1 s polls; more under load)
    script = {"greeting.txt": [{"command": "sleep 8"}, {"command": SOLVE}, "All done."]}
    shim = vllm_shim(tmp_path, script, log_requests=True)
    ckpts = tmp_path / "ckpts"
    for step in (10, 20):
        (ckpts / f"step-{step}").mkdir(parents=True)
        (ckpts / f"step-{step}" / "model.safetensors").write_text(f"weights {step}")
    (ckpts / "latest").write_text("step-10 10\n")
    ep = tmp_path / "private" / "endpoint.json"
    env = dict(os.environ, VLLM=str(shim), POLL_S="1", HEALTH_EVERY_S="1")
    server = subprocess.Popen(["bash", str(REPO / "slurm" / "vllm.sbatch"), "--checkpoint-dir", str(ckpts),
                               "policy", str(ep)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    out: list[str] = []
    switched = threading.Event()

    def follow() -> None:  # the trainer: a new checkpoint once the second episode has had its first turn
        firsts = 0
        for line in server.stdout:
            out.append(line)
            if line.startswith("served chat turn=0"):
                firsts += 1
                if firsts == 2 and not switched.is_set():
                    (ckpts / ".latest").write_text("step-20 20\n")
                    (ckpts / ".latest").rename(ckpts / "latest")
                    switched.set()

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    try:
        wait_for(ep.exists, server, "the endpoint file")
        cmd = [sys.executable, "-m", "et_hpc.cli", "run", str(DEMO), "--set", f"tasks.ids=[{TASK}]",
               "--run-name", "switch", "--store", str(tmp_path / "store"), "--samples", "3", "--concurrency", "1",
               "--json", "--set", "policy.kind=openai", "--set", f"policy.endpoint_file={ep}",
               "--set", "policy.endpoint_wait_s=60", "--set", "policy.backoff_base_s=0.2",
               "--set", "policy.backoff_max_s=1", "--set", "policy.max_retries=20"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        reader.join(timeout=10)
    log = "".join(out)
    assert switched.is_set() and "switched (restart)" in log, log

    from et_hpc.runs.store import open_run

    recs = sorted(open_run(tmp_path / "store" / "switch").records(), key=lambda x: x.timings.start_s)
    a, b = f"{ckpts}/step-10@step-10", f"{ckpts}/step-20@step-20"
    assert len(recs) == 3 and all(x.status == "ok" and x.reward == 1.0 for x in recs), [
        (x.status, x.error) for x in recs]
    assert {x.policy_version for x in recs} == {a, b}  # two versions in the store
    first, second, third = recs
    assert first.policy_versions == [a] and first.crossed_version is False
    assert second.policy_version == a and second.policy_versions == [a, b] and second.crossed_version is True
    assert third.policy_versions == [b] and third.crossed_version is False
    import pyarrow.parquet as pq

    table = pq.read_table(sorted((tmp_path / "store" / "switch").glob("part-*.parquet")))
    assert sorted(table.column("crossed_version").to_pylist()) == [False, False, True]  # on disk too
