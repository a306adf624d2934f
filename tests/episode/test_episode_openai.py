"""Episodes through ``et-hpc run`` with an OpenAI-compatible server: the real scripted server, a real
sandbox on the demo task's built image, and the real parquet store.

Covers tool-call and text mode solving ``demo_hello_file``, an always-failing server ending in
``policy_error`` with no reward, the endpoint file a server writes, the API key staying out of the
sandbox, the null policy scoring 0.0, and a missing image recorded as an error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.demo import DEMO, KEY, SOLVE, TASK

SECRET = "sk-et-hpc-test-secret-4f1c9b"
ET_HPC = [sys.executable, "-m", "et_hpc.cli"]


def _run(tmp: Path, name: str, *args: str, env: dict | None = None, timeout: float = 600) -> dict:
    """``et-hpc run`` on the demo task into ``tmp/store``; returns the --json summary."""
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
    r = subprocess.run(cmd, env=env or os.environ.copy(), capture_output=True, text=True, timeout=timeout, cwd=tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def _records(tmp: Path, name: str) -> list:
    from et_hpc.runs.store import open_run

    return open_run(tmp / "store" / name).records()


def _one(tmp: Path, name: str):
    recs = _records(tmp, name)
    assert len(recs) == 1, recs
    return recs[0]


def _openai(base_url: str, mode: str, *extra: str) -> list[str]:
    return ["--set", "policy.kind=openai", "--set", f"policy.base_url={base_url}", "--set", f"policy.mode={mode}", *extra]


def test_tool_call_mode_solves_demo(demo_image, tmp_path: Path) -> None:
    from et_hpc.testing.scripted_server import ScriptedServer

    with ScriptedServer({KEY: [{"command": SOLVE}, {"command": "cat /home/user/greeting.txt"}, "All done."]}) as srv:
        info = _run(tmp_path, "tools", *_openai(srv.base_url, "tools"))
        assert srv.chat_requests == 3
    rec = _one(tmp_path, "tools")
    assert info["ok"] == 1 and rec.status == "ok" and rec.reward == 1.0, (rec.status, rec.error)
    assert rec.policy_kind == "openai-tools" and rec.turns == 3 and rec.model == "scripted"
    tool_msgs = [m for m in rec.messages if m["role"] == "tool"]
    assert len(tool_msgs) == 2 and "Hello, et-hpc!" in tool_msgs[1]["content"]
    assert rec.total and rec.passed == rec.total


def test_text_mode_solves_demo(demo_image, tmp_path: Path) -> None:
    from et_hpc.testing.scripted_server import ScriptedServer

    script = {KEY: [f"I will write the file.\n<command>{SOLVE}</command>", "<action>done</action>"]}
    with ScriptedServer(script) as srv:
        _run(tmp_path, "text", *_openai(srv.base_url, "text"))
    rec = _one(tmp_path, "text")
    assert rec.status == "ok" and rec.reward == 1.0, (rec.status, rec.error)
    assert rec.policy_kind == "openai-text" and rec.stop_reason == "done"
    assert any(m["role"] == "user" and "exit_code=0" in str(m["content"]) for m in rec.messages[2:])


def test_always_500_is_policy_error_not_zero(demo_image, tmp_path: Path) -> None:
    from et_hpc.testing.scripted_server import ScriptedServer

    with ScriptedServer({KEY: [{"fault": 500}]}) as srv:
        info = _run(
            tmp_path,
            "down",
            *_openai(
                srv.base_url,
                "tools",
                "--set",
                "policy.max_retries=2",
                "--set",
                "policy.backoff_base_s=0.05",
                "--set",
                "policy.backoff_max_s=0.1",
            ),
        )
        # the same 500 body twice is deterministic: no third try (a retry budget would only waste time)
        assert srv.chat_requests == 2
    rec = _one(tmp_path, "down")
    assert rec.status == "policy_error" and rec.reward is None and rec.error
    assert "twice with the same error (HTTP 500): scripted fault" in rec.error
    assert info["ok"] == 0
    from et_hpc.runs.store import open_run

    summary = open_run(tmp_path / "store" / "down").summary()
    assert summary.by_status.get("policy_error") == 1 and summary.ok == 0 and summary.pass_rate is None  # not a 0% pass rate


def test_endpoint_file_from_server(demo_image, tmp_path: Path) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps({KEY: [{"command": SOLVE}, "done"]}))
    ep = tmp_path / "endpoint.json"
    srv = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "et_hpc.scripted_server",
            "--script",
            str(script),
            "--port",
            "0",
            "--model",
            "served-by-file",
            "--endpoint-file",
            str(ep),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(300):
            if ep.exists() or srv.poll() is not None:
                break
            time.sleep(0.05)
        assert ep.exists(), srv.stderr.read() if srv.poll() is not None else "no endpoint file"
        _run(tmp_path, "epfile", "--set", "policy.kind=openai", "--set", f"policy.endpoint_file={ep}", "--set", "policy.endpoint_wait_s=30")
    finally:
        srv.terminate()
        srv.wait(timeout=30)
    rec = _one(tmp_path, "epfile")
    assert rec.status == "ok" and rec.reward == 1.0, (rec.status, rec.error)
    assert rec.model == "served-by-file"  # the model named in the endpoint file was used


@pytest.mark.parametrize("token_in", [False, True])
def test_each_sample_sends_its_own_seed_through_an_endpoint_file(demo_image, tmp_path: Path, token_in: bool) -> None:
    """Sample i of a run sends seed + i on every request, also when the server is found through an
    endpoint file (read once per process): a group's samples are draws of their own, not one
    draw repeated. Three samples on one worker, so all three resolve the endpoint in one process."""
    from et_hpc.testing.scripted_server import ScriptedServer

    with ScriptedServer({KEY: [{"command": SOLVE}, "done"]}, model="by-file") as srv:
        ep = tmp_path / "ep" / "endpoint.json"
        srv.write_endpoint_file(ep)
        sets = ["--set", "policy.kind=openai", "--set", f"policy.endpoint_file={ep}", "--set", "policy.seed=10"]
        _run(tmp_path, "seeds", "--samples", "3", *sets, "--set", f"policy.token_in={str(token_in).lower()}")
        sent = sorted({e["seed"] for e in srv.log})
    recs = _records(tmp_path, "seeds")
    assert sorted(r.sampling_params["seed"] for r in recs) == [10, 11, 12]
    assert sent == [10, 11, 12], sent  # what the server was asked for: each sample's own
    assert {r.model for r in recs} == {"by-file"}  # and the endpoint file's model


def test_api_key_not_visible_in_sandbox(demo_image, tmp_path: Path) -> None:
    from et_hpc.testing.scripted_server import ScriptedServer

    env = dict(os.environ, OPENAI_API_KEY=SECRET, ET_HPC_CANARY_VAR="visible-canary")
    with ScriptedServer({KEY: [{"command": "env; echo END-OF-ENV"}, {"command": SOLVE}, "done"]}) as srv:
        _run(tmp_path, "env", *_openai(srv.base_url, "tools"), env=env)
    rec = _one(tmp_path, "env")
    assert rec.status == "ok" and rec.reward == 1.0, (rec.status, rec.error)
    obs = next(m["content"] for m in rec.messages if m["role"] == "tool")
    assert "END-OF-ENV" in obs and "PATH=" in obs  # env really ran and printed
    assert SECRET not in obs and "OPENAI_API_KEY" not in obs
    assert "visible-canary" not in obs  # the host environment does not leak in at all
    assert SECRET not in json.dumps(rec.model_dump(mode="json"))


def test_null_policy_scores_zero_ok(demo_image, tmp_path: Path) -> None:
    info = _run(tmp_path, "null", "--policy", "null")
    rec = _one(tmp_path, "null")
    assert rec.status == "ok" and rec.reward == 0.0 and rec.stop_reason == "done"
    assert rec.passed is not None and rec.total and rec.passed < rec.total
    assert info["ok"] == 1 and info["pass_rate"] == 0.0


@pytest.mark.apptainer
def test_missing_image_is_recorded_as_error(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from et_hpc.episode.run import run_episode
    from et_hpc.runner.config import RunConfig
    from et_hpc.runs.store import RunStore
    from et_hpc.tasks.loader import load_tasks

    task = next(t for t in load_tasks(str(DEMO)).tasks if t.id == TASK)
    cfg = RunConfig(name="noimage", policy={"kind": "null"})
    gone = SimpleNamespace(path=tmp_path / "deleted.sif", digest="sha256:0")  # built once, since removed
    recs = [run_episode(task, 0, cfg, None), run_episode(task, 1, cfg, gone)]
    run = RunStore(tmp_path / "store" / "noimage")
    run.write(recs)
    got = sorted(run.records(), key=lambda r: r.sample)
    assert [r.status for r in got] == ["infra_error", "infra_error"]
    assert all(r.reward is None and r.error for r in got)
    assert "et-hpc build" in got[0].error
    assert "deleted.sif" in got[1].error or "image" in got[1].error.lower(), got[1].error
    # through the CLI the run refuses to start and names the fix, without a traceback
    env = dict(
        os.environ, APPTAINER_CACHEDIR=str(tmp_path / "c"), XDG_CACHE_HOME=str(tmp_path / "xdg"), ET_HPC_CACHE=str(tmp_path / "empty-cache")
    )
    r = subprocess.run(
        ET_HPC + ["run", str(DEMO), "--set", f"tasks.ids=[{TASK}]", "--policy", "null", "--store", str(tmp_path / "store")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and r.stderr.startswith("et-hpc: error:") and "et-hpc build" in r.stderr, r.stderr
