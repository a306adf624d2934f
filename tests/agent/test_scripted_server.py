"""The scripted OpenAI-compatible server, spoken to over real HTTP (urllib and the openai client)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import openai
import pytest

from et_hpc.errors import UserError
from et_hpc.testing import scripted_tokenizer as tk
from et_hpc.testing.scripted_server import ScriptedServer, load_script


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _msgs(user: str, n_assistant: int = 0) -> list[dict]:
    m = [{"role": "system", "content": "sys"}, {"role": "user", "content": user}]
    for i in range(n_assistant):
        m += [{"role": "assistant", "content": f"a{i}"}, {"role": "user", "content": f"o{i}"}]
    return m


def test_binds_loopback_and_lists_model():
    with ScriptedServer({"x": ["hi"]}, model="m1") as srv:
        assert srv._httpd.server_address[0] == "127.0.0.1"
        assert srv.base_url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(srv.base_url + "/models", timeout=5) as r:
            data = json.loads(r.read())
        assert [d["id"] for d in data["data"]] == ["m1"]


def test_replies_by_turn_index_and_vllm_shape():
    script = {"apples": ["first", {"command": "ls -la", "timeout": 7}, "third"], "pears": ["other"]}
    with ScriptedServer(script) as srv:
        code, r = _post(srv.base_url, {"model": "scripted", "messages": _msgs("about apples")})
        assert code == 200 and r["choices"][0]["message"]["content"] == "first"
        assert r["choices"][0]["finish_reason"] == "stop"
        assert "tool_calls" not in r["choices"][0]["message"]  # newer vLLM leaves an empty list out
        assert r["prompt_token_ids"] is None and r["choices"][0]["token_ids"] is None  # not asked for
        assert r["usage"]["total_tokens"] == r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"]
        code, r = _post(srv.base_url, {"model": "scripted", "messages": _msgs("about apples", 1)})
        call = r["choices"][0]["message"]["tool_calls"][0]
        assert call["type"] == "function" and call["function"]["name"] == "terminal"
        assert json.loads(call["function"]["arguments"]) == {"command": "ls -la", "timeout": 7}
        assert r["choices"][0]["finish_reason"] == "tool_calls"
        # turn 2 asked again (e.g. another conversation) gives the same reply: no shared cursor
        assert _post(srv.base_url, {"messages": _msgs("about apples", 2)})[1]["choices"][0]["message"]["content"] == "third"
        assert _post(srv.base_url, {"messages": _msgs("about apples", 2)})[1]["choices"][0]["message"]["content"] == "third"
        assert _post(srv.base_url, {"messages": _msgs("pears!")})[1]["choices"][0]["message"]["content"] == "other"
        # past the script: done
        assert "done" in _post(srv.base_url, {"messages": _msgs("pears!", 5)})[1]["choices"][0]["message"]["content"]
        code, r = _post(srv.base_url, {"messages": _msgs("bananas")})
        assert code == 400 and "no script entry" in r["error"]["message"]
        assert srv.chat_requests == 7


def test_faults_then_reply_and_logprobs_with_token_ids():
    script = {"q": [{"fault": 500}, {"fault": 429, "retry_after": 1}, {"fault": "empty_choices"}, "ok now"]}
    with ScriptedServer(script) as srv:
        body = {"messages": _msgs("q"), "logprobs": True, "return_tokens_as_token_ids": True}
        assert _post(srv.base_url, body)[0] == 500
        assert _post(srv.base_url, body)[0] == 429
        code, r = _post(srv.base_url, body)
        assert code == 200 and r["choices"] == []
        code, r = _post(srv.base_url, body)
        assert r["choices"][0]["message"]["content"] == "ok now"
        toks = r["choices"][0]["logprobs"]["content"]
        assert len(toks) == r["usage"]["completion_tokens"] == len(b"ok now") + 1  # bytes + <|im_end|>
        assert all(t["token"].startswith("token_id:") and t["logprob"] <= 0 for t in toks)
        assert toks[-1]["token"] == f"token_id:{tk.EOS_ID}"
        assert [e["served"] for e in srv.log] == ["fault:500", "fault:429", "fault:empty_choices", "reply"]


def test_context_length_and_malformed_tool_json():
    with ScriptedServer(
        {"c": [{"fault": "context_length"}], "m": [{"fault": "malformed_tool_json"}], "long": ["fine"]}, max_model_len=1000
    ) as srv:
        code, r = _post(srv.base_url, {"messages": _msgs("c")})
        assert code == 400 and "maximum context length is 1000" in r["error"]["message"]
        code, r = _post(srv.base_url, {"messages": _msgs("m")})
        args = r["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
        with pytest.raises(json.JSONDecodeError):
            json.loads(args)
        code, r = _post(srv.base_url, {"messages": _msgs("long " + "word " * 2000)})
        assert code == 400 and "maximum context length" in r["error"]["message"]


def test_openai_client_reads_it():
    with ScriptedServer({"hi": [{"command": "echo 1", "content": None}]}) as srv:
        c = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
        r = c.chat.completions.create(model="scripted", messages=_msgs("hi there"))
        assert r.choices[0].message.tool_calls[0].function.name == "terminal"
        assert r.usage.prompt_tokens > 0


def test_bad_scripts_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="maps a substring"):
        load_script({"x": "not a list"})
    with pytest.raises(UserError, match="reply 1"):
        load_script({"x": ["ok", {"fault": 418}]})
    bad = tmp_path / "s.json"
    bad.write_text("{nope")
    with pytest.raises(UserError, match=str(bad)):
        load_script(bad)
    y = tmp_path / "s.yaml"
    y.write_text("task:\n  - '<command>ls</command>'\n  - command: pwd\n")
    assert load_script(y) == {"task": ["<command>ls</command>", {"command": "pwd"}]}


def test_cli_writes_endpoint_file(tmp_path):
    script = tmp_path / "s.json"
    script.write_text(json.dumps({"": ["hello"]}))
    ep = tmp_path / "ep.json"
    env = dict(os.environ, SLURM_JOB_ID="4242")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "et_hpc.scripted_server",
            "--script",
            str(script),
            "--port",
            "0",
            "--endpoint-file",
            str(ep),
            "--model",
            "tiny",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving http://127.0.0.1:")
        rec = json.loads(ep.read_text())
        assert set(rec) == {
            "host",
            "port",
            "model",
            "job_id",
            "base_url",
            "api_key",
            "model_version",
            "served_model",
            "started_at",
            "written_at",
        }
        assert ep.stat().st_mode & 0o777 == 0o600
        assert rec["host"] == "127.0.0.1" and rec["model"] == "tiny" and rec["job_id"] == "4242"
        assert rec["base_url"] == f"http://127.0.0.1:{rec['port']}/v1"
        code, r = _post(rec["base_url"], {"messages": _msgs("anything")})
        assert r["choices"][0]["message"]["content"] == "hello"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    assert not ep.exists()


def test_cli_bad_script_one_line(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "et_hpc.scripted_server", "--script", str(tmp_path / "none.json")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "none.json" in r.stderr and "Traceback" not in r.stderr
