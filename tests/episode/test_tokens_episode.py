"""Token capture end to end: ``et-hpc run`` (real sandbox on the demo task's image, real parquet store)
against the scripted server, in tools and text mode. The stored per-turn ids must concatenate to the
server's own tokenization of the stored conversation; a model whose format the template re-renders
differently is recorded as drift; an older server gives ``re-tokenized`` ids that still agree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from et_hpc.agent.wire import TERMINAL_TOOL
from et_hpc.testing import scripted_tokenizer as tk
from helpers.demo import DEMO, KEY, SOLVE, TASK

ET_HPC = [sys.executable, "-m", "et_hpc.cli"]


def _run_one(tmp: Path, name: str, srv, mode: str, *extra: str):
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
        "--set",
        "policy.kind=openai",
        "--set",
        f"policy.base_url={srv.base_url}",
        "--set",
        f"policy.mode={mode}",
        *extra,
    ]
    r = subprocess.run(cmd, env=os.environ.copy(), capture_output=True, text=True, timeout=600, cwd=tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    from et_hpc.runs.store import open_run

    (rec,) = open_run(tmp / "store" / name).records()
    assert rec.status == "ok" and rec.reward == 1.0, (rec.status, rec.error)
    return rec


def _server_tokens(srv, rec) -> list[int]:
    """The server's /tokenize of the stored conversation up to and including the last assistant turn."""
    msgs = rec.messages
    last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    body = {"messages": msgs[: last + 1], "add_generation_prompt": False}
    if rec.policy_kind == "openai-tools":
        body["tools"] = [TERMINAL_TOOL]
    req = urllib.request.Request(
        srv.base_url[: -len("/v1")] + "/tokenize", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())["tokens"]


@pytest.mark.parametrize(
    "mode,script",
    [
        ("tools", {KEY: [{"command": SOLVE}, {"command": "cat /home/user/greeting.txt"}, "All done."]}),
        (
            "text",
            {KEY: [f"Writing it.\n<command>{SOLVE}</command>", "<command>cat /home/user/greeting.txt</command>", "<action>done</action>"]},
        ),
    ],
)
def test_run_records_server_exact_tokens(demo_image, tmp_path: Path, mode, script) -> None:
    from et_hpc.testing.scripted_server import ScriptedServer

    with ScriptedServer(script) as srv:
        rec = _run_one(tmp_path, f"tok-{mode}", srv, mode, "--set", "policy.logprobs=true")
        final = _server_tokens(srv, rec)
    assert rec.turns == 3 and rec.has_tokens and len(rec.prompt_token_ids) == 3
    assert (rec.tokens_source, rec.token_drift) == ("server-exact", None)
    tokens, masks, lps = rec.token_sequence()
    assert final == tokens + tk.encode("\n")  # exactly the server's tokens (the template then closes the turn)
    assert "Hello, et-hpc!" in tk.decode(tokens)  # the tool output is inside, as prompt tokens
    assert sum(m != -100 for m in masks) == sum(map(len, rec.token_ids)) == rec.completion_tokens
    assert lps is not None and len(lps) == len(tokens)
    full_prompts, n = [], 0  # usage.prompt_tokens sums every request's whole prompt
    for delta, completion in zip(rec.prompt_token_ids, rec.token_ids):
        n += len(delta)
        full_prompts.append(n)
        n += len(completion)
    assert rec.prompt_tokens == sum(full_prompts)


def test_run_records_drift_and_old_server_fallback(demo_image, tmp_path: Path) -> None:
    from et_hpc.testing.scripted_server import ScriptedServer

    compact = {"name": "terminal", "arguments": json.dumps({"command": SOLVE}, separators=(",", ":"))}
    with ScriptedServer({KEY: [{"tool_calls": [compact]}, "All done."]}) as srv:
        rec = _run_one(tmp_path, "tok-drift", srv, "tools")
    assert rec.tokens_source == "server-exact"
    assert rec.token_drift and rec.token_drift.startswith("turn 1:"), rec.token_drift
    assert rec.token_ids and rec.prompt_token_ids and not rec.has_tokens  # kept, but not one trainable sequence

    with ScriptedServer({KEY: [{"command": SOLVE}, "All done."]}, return_token_ids=False) as srv:
        rec = _run_one(tmp_path, "tok-old", srv, "tools", "--set", "policy.logprobs=true")
        final = _server_tokens(srv, rec)
    assert (rec.tokens_source, rec.token_drift) == ("re-tokenized", None)
    assert final == rec.token_sequence()[0] + tk.encode("\n")
