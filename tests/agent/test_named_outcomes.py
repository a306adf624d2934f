"""What real models get wrong, each a named outcome: scripted HTTP server -> OpenAIPolicy -> run_agent -> host bash.

Every case keeps status ok (the agent did it; the episode is scored and trained on) and names what
happened in the turn's ``outcome`` and in ``events``.
"""

from __future__ import annotations

import random

import pytest

from et_hpc.agent.loop import BudgetConfig, run_agent
from et_hpc.agent.openai_policy import OpenAIPolicy
from et_hpc.testing.scripted_server import ScriptedServer


def _run(script_replies, shell, mode="tools", **budget):
    with ScriptedServer({"task": script_replies}) as srv:
        p = OpenAIPolicy(srv.base_url, mode=mode, backoff_base_s=0.01, backoff_max_s=0.02, rng=random.Random(1))
        r = run_agent("Do the task.", shell, p, BudgetConfig(**budget))
    assert r.status == "ok", r.error
    return r


def _named(r) -> list[str]:
    return [e.split(":", 1)[0] for e in r.events]


def test_no_tool_call_ends_the_episode(shell):
    r = _run(["I looked at it and it is fine."], shell)
    assert r.stop_reason == "done" and _named(r) == ["no_tool_call"]


def test_several_tool_calls_run_only_the_first(shell, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    r = _run([{"tool_calls": [{"command": f"touch {a}"}, {"command": f"touch {b}"}]}, "ok"], shell)
    assert a.exists() and not b.exists()
    assert _named(r) == ["several_tool_calls", "no_tool_call"] and "2 calls" in r.events[0]


def test_malformed_json_and_unknown_tool(shell):
    r = _run(
        [
            {"fault": "malformed_tool_json"},
            {"tool_calls": [{"name": "python", "arguments": '{"code": "print(1)"}'}]},
            {"tool_calls": [{"arguments": '{"cmd": "ls"}'}]},
            "giving up",
        ],
        shell,
    )
    assert [t.outcome for t in r.turns] == ["malformed_tool_json", "unknown_tool", "bad_tool_arguments", "no_tool_call"]
    assert r.stop_reason == "done" and "Unknown tool 'python'" in r.turns[1].observation


def test_text_outside_the_protocol_and_thinking(shell, tmp_path):
    keep = tmp_path / "keep"
    keep.write_text("x")
    r = _run(
        [
            "Let me look around first.",
            f"<think>maybe <command>rm {keep}</command>? no.</think>Nothing to run yet.",
            f"<think>now</think><command>echo hi > {tmp_path / 'out'}</command>",
            "<action>done</action>",
        ],
        shell,
        mode="text",
    )
    assert [t.outcome for t in r.turns] == ["unparsed_reply", "unparsed_reply", "thinking", None]
    assert keep.exists()  # a command inside <think> is not run
    assert (tmp_path / "out").read_text() == "hi\n"  # positive control: one outside it is
    assert r.stop_reason == "done"


@pytest.mark.parametrize("mode", ["tools", "text"])
def test_empty_reply(shell, mode):
    r = _run(["", "<action>done</action>"], shell, mode=mode)
    assert r.turns[0].outcome == "empty_reply" and _named(r)[0] == "empty_reply"
    assert r.stop_reason == "done"


def test_same_command_until_max_turns(shell):
    r = _run([{"command": "ls"}] * 4, shell, max_turns=4)
    assert r.stop_reason == "max_turns" and _named(r) == ["repeated_command"] and "last 4 turns" in r.events[0]
    # positive control: different commands up to max_turns are not named
    r = _run([{"command": "ls"}, {"command": "pwd"}, {"command": "ls"}], shell, max_turns=3)
    assert r.stop_reason == "max_turns" and r.events == []


def test_context_limit(shell):
    r = _run([{"command": "ls"}, {"fault": "context_length"}], shell)
    assert r.stop_reason == "context" and _named(r) == ["context"]
    r = _run([{"command": "ls"}, {"command": "ls"}], shell, context_tokens=50)  # our own budget
    assert r.stop_reason == "context" and len(r.turns) == 1
