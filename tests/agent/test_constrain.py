"""Replies constrained to the protocol: what each server is sent, and the honest record of it.

The scripted server speaks vLLM's routes: token-in requests carry ``structured_outputs.grammar`` (vLLM's
completions field) when asked, nothing by default; the policy's per-turn record says which. A chat-mode
tools constraint on llama-server is not enforced: the run warns once (the real server: tests/model).
"""

from __future__ import annotations

import logging
import random
import re

import pytest

from et_hpc.agent import constrain
from et_hpc.agent.loop import BudgetConfig, run_agent
from et_hpc.agent.openai_policy import OpenAIPolicy
from et_hpc.testing.scripted_server import ScriptedServer

SCRIPT = {"task": [{"command": "echo one"}, "finished"]}


def _run(shell, **kw):
    seen: list[dict] = []
    with ScriptedServer(SCRIPT) as srv:
        srv.on_request = seen.append
        p = OpenAIPolicy(srv.base_url, token_in=True, backoff_base_s=0.01, rng=random.Random(0), **kw)
        r = run_agent("Do the task.", shell, p, BudgetConfig())
    return r, p, seen


@pytest.mark.parametrize("mode", ["tools", "text"])
def test_vllm_token_in_carries_structured_outputs_only_when_asked(shell, mode):
    script_mode = {"mode": mode}
    r, p, seen = _run(shell, constrain=True, **script_mode)
    assert r.status == "ok", r.error
    assert seen and all(q.get("structured_outputs") == {"grammar": constrain.grammar(mode)} for q in seen)
    assert p.constrained == ["grammar"] * len(r.turns)
    # the positive control: by default (not llama-server) nothing is sent, and the record says so
    r0, p0, seen0 = _run(shell, **script_mode)
    assert r0.status == "ok" and seen0 and not any("structured_outputs" in q or "grammar" in q for q in seen0)
    assert p0.constrained == ["none"] * len(r0.turns)


def test_how_each_server_and_mode_is_constrained():
    h = constrain.how
    assert h(None, "tools", True, "llama") == ("grammar", None)  # the embedded server: on by default
    assert h(None, "tools", True, "vllm") == ("none", None)
    assert h(True, "tools", True, "vllm") == ("grammar", None)
    assert h(False, "tools", True, "llama") == ("none", None)
    assert h(True, "text", False, "llama") == ("grammar", None)
    assert h(True, "tools", False, "vllm") == ("tool_choice", None)
    how, warning = h(True, "tools", False, "llama")
    assert how == "none" and warning and "NOT constrained" in warning and "\n" not in warning


def test_the_warning_is_one_line_once_per_server(caplog):
    with caplog.at_level(logging.WARNING, logger="et_hpc.agent.constrain"):
        for _ in range(3):
            constrain.warn_once("http://h:1/v1", constrain.CANNOT["llama-tools"])
        constrain.warn_once("http://h:1/v1", None)
    assert len(caplog.records) == 1 and "NOT constrained" in caplog.records[0].getMessage()


def test_the_tools_grammar_admits_exactly_a_terminal_call_or_done():
    """The grammar's call rule, read as a regex over JSON strings: the forms it must and must not take."""
    body = r'"(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*"'
    call = re.escape('<tool_call>\n{"name": "terminal", "arguments": {"command": ') + body + re.escape("}}\n</tool_call>")
    form = re.compile(f"(?:{call}|{re.escape(constrain.DONE_REPLY)})")
    g = constrain.TOOLS_GRAMMAR
    assert '\\"terminal\\"' in g and constrain.DONE_REPLY in g and "root ::= call | done" in g
    good = ['<tool_call>\n{"name": "terminal", "arguments": {"command": "echo \\"hi\\" > /tmp/x"}}\n</tool_call>', "The task is complete."]
    bad = ["```bash\nls\n```", '<tool_call>\n{"name": "python", "arguments": {"command": "x"}}\n</tool_call>', "done"]
    assert all(form.fullmatch(s) for s in good) and not any(form.fullmatch(s) for s in bad)
