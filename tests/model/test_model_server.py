"""A real model on CPU: ``et-hpc model serve`` (llama.cpp's llama-server on the embedded SmolLM2-135M)
and real-model episodes through ``et-hpc run`` on the demo tasks in real apptainer sandboxes.

No stand-ins: the model samples, the server's own chat template and tokenizer make the tokens.
What a 135M model does is not asserted (it rarely solves anything); what et-hpc makes of it is:
every episode ends ``ok`` (no policy_error), its tokens are the server's, and the exports validate.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from helpers import REPO, need

ET_HPC = [sys.executable, "-m", "et_hpc.cli"]
DEMO = REPO / "defs" / "demo"
TASKS = ["demo_hello_file", "demo_csv_sum"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    need("model")
    from et_hpc.model.server import ServerConfig, serving

    d = tmp_path_factory.mktemp("model")
    with serving(ServerConfig(endpoint_file=d / "ep" / "endpoint.json", log_file=d / "server.log")) as srv:
        yield srv


@pytest.fixture(scope="module")
def demo_images(base_sif: Path):
    from et_hpc.images.store import ImageStore
    from et_hpc.tasks.loader import load_tasks

    return [ImageStore().ensure(t) for t in load_tasks(str(DEMO)).tasks if t.id in TASKS]


def test_serve_command_publishes_an_endpoint_file(tmp_path):
    need("model")
    from et_hpc.model.server import default_model
    from et_hpc.util import sha256_file

    ep = tmp_path / "private" / "endpoint.json"
    p = subprocess.Popen(
        [*ET_HPC, "model", "serve", "--endpoint-file", str(ep), "--parallel", "1", "--ctx-size", "2048"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not ep.exists():
            assert p.poll() is None, p.stdout.read()
            assert time.monotonic() < deadline, "no endpoint file"
            time.sleep(0.2)
        rec = json.loads(ep.read_text())
        assert stat.S_IMODE(ep.stat().st_mode) == 0o600 and stat.S_IMODE(ep.parent.stat().st_mode) == 0o700
        assert rec["host"] == "127.0.0.1" and rec["model"] == "SmolLM2-135M-Instruct.Q4_1"
        assert rec["model_version"] == f"{rec['model']}@sha256-{sha256_file(default_model())[:16]}"
        key = rec["api_key"]
        assert key and len(key) >= 24
        # the key is not on any command line
        assert not any(
            key.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
            for pid in os.listdir("/proc")
            if pid.isdigit() and Path(f"/proc/{pid}/cmdline").exists()
        )
        assert httpx.get(rec["base_url"] + "/models", timeout=10).status_code == 401
        ok = httpx.get(rec["base_url"] + "/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        # its one alias is the version: every answer names the weights that gave it
        assert rec["served_model"] == rec["model_version"]
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == rec["served_model"]
    finally:
        p.send_signal(signal.SIGTERM)
        out = p.communicate(timeout=60)[0]
    assert p.returncode == 0, out
    assert not ep.exists()  # removed with the server


def test_serve_bad_model_path_is_one_line(tmp_path):
    r = subprocess.run([*ET_HPC, "model", "serve", "--model", str(tmp_path / "nope.gguf")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "nope.gguf" in r.stderr


def test_history_forms_every_server_takes(served):
    """The assistant message beside tool calls carries content "" (not null); the server takes the history."""
    from et_hpc.agent.openai_policy import OpenAIPolicy

    ep = json.loads(served.cfg.endpoint_file.read_text())
    p = OpenAIPolicy(ep["base_url"], ep["model"], api_key=ep["api_key"], mode="tools", max_tokens=48, max_retries=1)
    msgs = [
        {"role": "system", "content": "You run shell commands with the terminal tool."},
        {"role": "user", "content": "List the files in /tmp."},
    ]
    a = p.act(msgs)
    msgs.append(
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "terminal", "arguments": '{"command": "ls /tmp"}'}}],
        }
    )
    msgs.append({"role": "tool", "tool_call_id": "call_0", "content": "Command executed successfully. Output: a b\n\n(exit_code=0)"})
    b = p.act(msgs)  # the history with a tool call and its result is accepted
    assert a.message["role"] == b.message["role"] == "assistant"
    assert a.message["content"] is not None and b.message["content"] is not None


def _run(tmp: Path, name: str, ep: Path, *args: str, timeout: float = 900) -> dict:
    cmd = [
        *ET_HPC,
        "run",
        str(DEMO),
        "--set",
        f"tasks.ids=[{','.join(TASKS)}]",
        "--run-name",
        name,
        "--store",
        str(tmp / "store"),
        "--concurrency",
        "2",
        "--json",
        "--policy",
        "openai",
        "--set",
        f"policy.endpoint_file={ep}",
        "--set",
        "policy.max_retries=2",
        "--set",
        "budgets.max_turns=3",
        "--set",
        "budgets.max_tokens_per_turn=96",
        *args,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp)
    assert r.returncode in (0, 1), r.stderr[-3000:]
    return json.loads(r.stdout)


def _skyrl_checker():
    """The SkyRL 0.4.0 GeneratorOutput check of the export tests (SkyRL's own class, then field by field)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("export_tests", REPO / "tests" / "runs" / "test_export.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._check_skyrl_040


def _check_exports(run, tmp: Path) -> None:
    """Both exports of a real-model run validate with their own types and carry each exact episode's ids."""
    from et_hpc.runs.export import export_atropos, export_skyrl, generator_output, validate_atropos_group

    exact = {(r.task_id, r.sample): r.token_sequence() for r in run.records() if r.has_tokens}
    assert exact, [(r.tokens_source, r.token_drift) for r in run.records()]  # not vacuous: some ids to check
    out = tmp / "groups.jsonl"
    export_atropos(run, out, drop_zero_variance=False)
    groups = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    seen = set()
    for g in groups:
        validate_atropos_group(g)  # atroposlib's ScoredDataGroup and ScoredData
        for k, s, toks in zip([g["et_hpc"]["task_id"]] * len(g["tokens"]), g["et_hpc"]["samples"], g["tokens"]):
            assert list(toks) == list(exact[(k, s)][0])
            seen.add((k, s))
    assert seen == set(exact)
    sk = tmp / "go.parquet"
    export_skyrl(run, sk)
    go = generator_output(sk)
    _skyrl_checker()(go)  # SkyRL 0.4.0's GeneratorOutput, field by field
    rows = {
        (t.instance_id.split("@")[0], t.repetition_id): (p, r)
        for t, p, r in zip(go["trajectory_ids"], go["prompt_token_ids"], go["response_ids"])
    }
    assert set(rows) == set(exact)
    for key, (prompt, response) in rows.items():
        assert list(prompt) + list(response) == list(exact[key][0])


@pytest.mark.apptainer
@pytest.mark.parametrize("mode,token_in", [("tools", False), ("text", False), ("text", True)])
def test_real_model_episodes_through_run(served, demo_images, tmp_path, mode, token_in):
    from et_hpc.agent.chat_tokens import REASON
    from et_hpc.runs.store import open_run

    name = f"real-{mode}-{token_in}"
    _run(tmp_path, name, served.cfg.endpoint_file, "--set", f"policy.mode={mode}", "--set", f"policy.token_in={token_in}")
    run = open_run(tmp_path / "store" / name)
    recs = run.records()
    assert len(recs) == len(TASKS)
    for r in recs:
        assert r.status == "ok", (r.status, r.error)  # the model's mistakes are its own: no policy_error
        assert r.reward is not None and r.turns >= 1 and r.model == served.alias
        assert r.policy_version == served.version and r.version_source == "response"
        if token_in:
            assert (r.tokens_source, r.token_drift) == ("server-exact", None)
        else:
            # chat mode on llama-server: completions are the sampled ids (its logprobs), prompts rendered
            # by its template and tokenizer; drift, where the re-render differs, is named
            assert r.tokens_source == "re-tokenized" and REASON in r.events, (r.tokens_source, r.events)
            assert r.token_ids and all(r.token_ids) and len(r.prompt_token_ids) == len(r.token_ids)
            assert r.token_drift is None or r.token_drift.startswith(("turn ", "end: "))
        assert r.timings.model_s and r.timings.model_s > 0
    if mode == "text":  # tools mode re-serialises the model's tool calls: its ids may all drift
        _check_exports(run, tmp_path)


@pytest.mark.apptainer
def test_server_killed_mid_run_loses_nothing(demo_images, tmp_path):
    """Two real servers behind policy.endpoint_dir; one is SIGKILLed while episodes run on it."""
    need("model")
    from et_hpc.model.server import ServerConfig, serving
    from et_hpc.runs.store import open_run

    d = tmp_path / "replicas"
    with (
        serving(ServerConfig(endpoint_file=d / "a.json", parallel=1, ctx_size=4096, log_file=tmp_path / "a.log")) as a,
        serving(ServerConfig(endpoint_file=d / "b.json", parallel=1, ctx_size=4096, log_file=tmp_path / "b.log")),
    ):
        cmd = [
            *ET_HPC,
            "run",
            str(DEMO),
            "--set",
            f"tasks.ids=[{','.join(TASKS)}]",
            "--samples",
            "1",
            "--run-name",
            "killed",
            "--store",
            str(tmp_path / "store"),
            "--concurrency",
            "2",
            "--json",
            "--policy",
            "openai",
            "--set",
            f"policy.endpoint_dir={d}",
            "--set",
            "policy.mode=text",
            "--set",
            "policy.retry_budget_s=60",
            "--set",
            "budgets.max_turns=3",
            "--set",
            "budgets.max_tokens_per_turn=64",
        ]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
        deadline = time.monotonic() + 300
        while "launch_slot_" not in (tmp_path / "a.log").read_text():  # a request is being processed
            assert p.poll() is None and time.monotonic() < deadline, "server a never got a request"
            time.sleep(0.2)
        assert p.poll() is None  # positive control: the run is still going when its server dies
        os.killpg(a.proc.pid, signal.SIGKILL)
        out, err = p.communicate(timeout=900)
    assert p.returncode in (0, 1), err[-3000:]
    recs = open_run(tmp_path / "store" / "killed").records()
    assert len(recs) == len(TASKS)  # every episode is stored
    assert all(r.status == "ok" for r in recs), [(r.status, r.error) for r in recs]
    assert any(any(e.startswith("failover:") for e in r.events) for r in recs)


def test_token_in_on_llama_server_records_logprobs_and_its_sampler(served):
    """Token-in on the real llama-server: each turn's exact ids come with their logprobs (asked with
    ``n_probs``, read from ``completion_probabilities``), and the sampler settings the server used,
    its own defaults included (``top_k`` 40, ``min_p`` 0.05), are what the policy reports."""
    from et_hpc.agent.openai_policy import OpenAIPolicy

    # token_in "auto" (PolicyConfig's default): llama-server answers /apply-template, so token-in it is
    p = OpenAIPolicy(served.base_url, api_key=served.api_key, mode="text", token_in="auto", logprobs=True, max_tokens=24, seed=1)
    msgs = [{"role": "system", "content": "Reply with one shell command."}, {"role": "user", "content": "List the files."}]
    for _ in range(2):
        a = p.act(msgs)
        assert a.tokens_from == "server" and a.token_ids
        assert a.logprobs is not None and len(a.logprobs) == len(a.token_ids)
        assert all(lp <= 0.0 for lp in a.logprobs) and any(lp < 0.0 for lp in a.logprobs)
        msgs += [a.message, {"role": "user", "content": "Output: a.txt b.txt"}]
    assert p.token_in is True
    s = p.server_sampling
    assert s is not None and s["top_k"] == 40 and abs(s["min_p"] - 0.05) < 1e-6, s
    assert abs(s["temperature"] - p.temperature) < 1e-6 and s["n_predict"] == 24
    p.close()
