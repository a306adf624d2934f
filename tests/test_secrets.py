"""The policy server's API key stays out of every file et-hpc writes, the sandbox and ``--help``.

Real runs on the demo task's image against the scripted server, which answers 401 without the key
(so an ``ok`` episode is the positive control: the key reached the worker). The key comes from each
place a user can give it: the endpoint file ``slurm/vllm.sbatch`` writes, ``policy.api_key`` in a
run config, and ``$OPENAI_API_KEY``; the runs go through real Slurm (submitit pickles, sbatch
scripts, job logs) and the local executor. Afterwards every file under the run directory, the
Slurm folder and the working directory is searched for the key, raw bytes and parquet decoded
(compressed columns would hide it from a byte search). The agent prints its whole environment
and PID 1's inside the sandbox; the key is not there either.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from helpers.demo import DEMO, KEY, SOLVE, TASK

SECRET = "sk-etsecret-7d41c0a9e2b84f5f"
ET_HPC = [sys.executable, "-m", "et_hpc.cli"]
SNOOP = "env; echo END-OF-ENV; tr '\\0' '\\n' < /proc/1/environ; cat /proc/self/environ | tr '\\0' '\\n'"
SCRIPT = {KEY: [{"command": SNOOP}, {"command": SOLVE}, "All done."]}


def files_with(secret: str, *roots: Path) -> list[str]:
    """Files under ``roots`` that hold ``secret``: raw bytes, or any cell of a parquet file."""
    hits = []
    needle = secret.encode()
    for root in roots:
        for p in [root] if root.is_file() else sorted(root.rglob("*")):
            if not p.is_file():
                continue
            data = p.read_bytes()
            if needle in data or p.suffix == ".parquet" and secret in json.dumps(pq.read_table(p).to_pylist(), default=str):
                hits.append(str(p))
    return hits


def test_finder_finds_what_is_there(tmp_path: Path) -> None:
    """Positive control for the search: a key in plain text, in a pickle, and in a compressed parquet."""
    import pyarrow as pa

    (tmp_path / "a.txt").write_text(f"x {SECRET} y")
    (tmp_path / "b.pkl").write_bytes(pickle.dumps({"k": SECRET}))
    # the key's head appears twice: the compressor refers back to it, so the key is never spelled out
    pq.write_table(pa.table({"m": [f"{SECRET[:14]} .. {SECRET}"]}), tmp_path / "c.parquet", compression="zstd", write_statistics=False)
    assert SECRET.encode() not in (tmp_path / "c.parquet").read_bytes()  # compressed: bytes alone miss it
    (tmp_path / "d.txt").write_text("nothing")
    assert files_with(SECRET, tmp_path) == [str(tmp_path / n) for n in ("a.txt", "b.pkl", "c.parquet")]


def _run(tmp: Path, name: str, *args: str, env: dict, timeout: float = 900) -> dict:
    cmd = ET_HPC + [
        "run",
        str(DEMO),
        "--set",
        f"tasks.ids=[{TASK}]",
        "--run-name",
        name,
        "--store",
        str(tmp / "store"),
        "--concurrency",
        "1",
        "--json",
        *args,
    ]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp / "cwd")
    assert r.returncode == 0, r.stderr[-3000:]
    assert SECRET not in r.stdout and SECRET not in r.stderr
    return json.loads(r.stdout)


def _check(tmp: Path, name: str, srv) -> None:
    from et_hpc.runs.store import open_run

    recs = open_run(tmp / "store" / name).records()
    assert len(recs) == 1 and recs[0].status == "ok" and recs[0].reward == 1.0, [(r.status, r.error) for r in recs]
    assert srv.requests.get("401", 0) == 0 and srv.chat_requests == 3  # the key reached the worker
    obs = next(m["content"] for m in recs[0].messages if m["role"] == "tool")
    assert "END-OF-ENV" in obs and "PATH=" in obs  # the agent really printed its environment
    assert SECRET not in obs and "API_KEY" not in obs
    assert files_with(SECRET, tmp / "store", tmp / "cwd") == []


def _env(tmp: Path, **extra: str) -> dict:
    (tmp / "cwd").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if "API_KEY" not in k}
    env.update(extra)
    return env


SLURM = ["--executor", "slurm", "--set", "slurm.cpus_per_task=1", "--set", "slurm.time_min=10", "--set", "slurm.poll_s=1"]


@pytest.mark.slurm
def test_key_from_run_config_through_slurm(demo_image, tmp_path: Path) -> None:
    from et_hpc.testing.scripted_server import ScriptedServer

    with ScriptedServer(SCRIPT, api_key=SECRET) as srv:
        cfg = tmp_path / "secret-config.yaml"  # the user's own file: the one place the key may be
        cfg.write_text(f"policy:\n  kind: openai\n  base_url: {srv.base_url}\n  api_key: {SECRET}\n")
        _run(tmp_path, "cfg", "--config", str(cfg), *SLURM, env=_env(tmp_path))
        _check(tmp_path, "cfg", srv)
    run_dir = tmp_path / "store" / "cfg"
    pickles = list((run_dir / "slurm").rglob("*.pkl"))
    scripts = list((run_dir / "slurm").rglob("*.sh"))
    assert pickles and scripts  # the submitit job files exist and were searched
    assert files_with(SECRET, cfg) == [str(cfg)]  # the search does see the key where it is
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["config"]["policy"]["base_url"] == srv.base_url and "api_key" not in meta["config"]["policy"]


@pytest.mark.slurm
def test_key_from_endpoint_file_through_slurm(demo_image, tmp_path: Path) -> None:
    from et_hpc.testing.scripted_server import ScriptedServer

    ep = tmp_path / "private" / "endpoint.json"
    with ScriptedServer(SCRIPT, api_key=SECRET) as srv:
        srv.write_endpoint_file(ep, job_id=None, model_version="ckpt@step-1")
        assert files_with(SECRET, ep) == [str(ep)] and ep.stat().st_mode & 0o777 == 0o600
        _run(
            tmp_path,
            "ep",
            "--set",
            "policy.kind=openai",
            "--set",
            f"policy.endpoint_file={ep}",
            "--set",
            "policy.endpoint_wait_s=30",
            *SLURM,
            env=_env(tmp_path, OPENAI_API_KEY="wrong-key"),
        )
        _check(tmp_path, "ep", srv)
    from et_hpc.runs.store import open_run

    assert open_run(tmp_path / "store" / "ep").records()[0].policy_version == "ckpt@step-1"


def test_key_from_environment_local(demo_image, tmp_path: Path) -> None:
    from et_hpc.testing.scripted_server import ScriptedServer

    with ScriptedServer(SCRIPT, api_key=SECRET) as srv:
        _run(
            tmp_path,
            "env",
            "--set",
            "policy.kind=openai",
            "--set",
            f"policy.base_url={srv.base_url}",
            env=_env(tmp_path, OPENAI_API_KEY=SECRET),
        )
        _check(tmp_path, "env", srv)


def test_wrong_key_is_a_policy_error_not_a_zero(demo_image, tmp_path: Path) -> None:
    from et_hpc.runs.store import open_run
    from et_hpc.testing.scripted_server import ScriptedServer

    with ScriptedServer(SCRIPT, api_key=SECRET) as srv:
        _run(
            tmp_path,
            "bad",
            "--set",
            "policy.kind=openai",
            "--set",
            f"policy.base_url={srv.base_url}",
            "--set",
            "policy.model=scripted",
            env=_env(tmp_path, OPENAI_API_KEY="not-the-key"),
        )
        assert srv.requests.get("401", 0) >= 1
    rec = open_run(tmp_path / "store" / "bad").records()[0]
    assert rec.status == "policy_error" and rec.reward is None and "401" in (rec.error or "")


def test_key_not_in_help() -> None:
    env = dict(os.environ, OPENAI_API_KEY=SECRET, VLLM_API_KEY=SECRET, ET_HPC_POLICY_API_KEY=SECRET)
    for args in (["--help"], ["run", "--help"], ["doctor", "--help"]):
        r = subprocess.run(ET_HPC + args, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and len(r.stdout) > 200, r.stderr
        assert SECRET not in r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "et_hpc.scripted_server", "--help"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--api-key" in r.stdout and SECRET not in r.stdout + r.stderr


def test_key_not_in_pickled_config() -> None:
    from et_hpc.runner.config import load_config
    from et_hpc.runner.slurm import KEY_ENV, key_by_reference

    cfg = load_config(None, [(["policy", "api_key"], SECRET), (["policy", "base_url"], "http://h:1/v1")])
    assert cfg.policy.key_value() == SECRET  # positive control: the config does hold it
    assert SECRET.encode() not in pickle.dumps(cfg) and SECRET not in cfg.model_dump_json()
    assert SECRET not in repr(cfg) and SECRET not in str(cfg)
    old = os.environ.get(KEY_ENV)
    try:
        ref = key_by_reference(cfg)
        assert ref.policy.api_key is None and ref.policy.api_key_env == KEY_ENV and os.environ[KEY_ENV] == SECRET
    finally:
        if old is None:
            os.environ.pop(KEY_ENV, None)
        else:
            os.environ[KEY_ENV] = old
