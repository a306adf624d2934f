"""The agent loop end to end: scripted HTTP server -> OpenAIPolicy -> run_agent -> a real host bash Shell."""

from __future__ import annotations

import itertools
import random

import pytest

from et_hpc.agent.loop import NOT_RUN, BudgetConfig, run_agent
from et_hpc.agent.openai_policy import OpenAIPolicy
from et_hpc.agent.policies import NullPolicy, OraclePolicy, PolicyConfig, make_policy
from et_hpc.agent.prompts import COULD_NOT_PARSE, TEXT_SYSTEM_PROMPT, TOOLS_SYSTEM_PROMPT
from et_hpc.tasks.model import Recipe, Task
from et_hpc.testing.scripted_server import ScriptedServer


def _policy(srv, mode="tools", **kw):
    return OpenAIPolicy(srv.base_url, mode=mode, backoff_base_s=0.01, backoff_max_s=0.02, rng=random.Random(1), **kw)


def test_tools_mode_solves_file_task(tmp_path, shell):
    out = tmp_path / "greeting.txt"
    script = {
        "greeting": [
            {"command": "cd " + str(tmp_path) + " && export WHO=world", "timeout": 10},
            {"command": 'printf "hello %s\\n" "$WHO" > greeting.txt'},  # cwd and env persist
            {"command": "cat greeting.txt"},
            {"command": "ls missing-file"},
            "The file is written.",
        ]
    }
    with ScriptedServer(script) as srv:
        r = run_agent("Write the greeting file.", shell, _policy(srv), BudgetConfig())
    assert r.status == "ok" and r.stop_reason == "done", r.error
    assert out.read_text() == "hello world\n"
    assert [t.kind for t in r.turns] == ["command"] * 4 + ["done"]
    assert r.turns[0].timeout_s == 10 and r.turns[2].timeout_s == 60
    assert r.turns[2].observation == "Command executed successfully. Output: hello world\n\n\n(exit_code=0)"
    assert r.turns[3].exit_code not in (0, None)
    assert r.turns[3].observation.startswith("Command failed. Output: ls: cannot access")
    # OpenAI format: system, user, then assistant tool call + tool result pairs, final answer
    assert r.messages[0] == {"role": "system", "content": TOOLS_SYSTEM_PROMPT}
    assert r.messages[1] == {"role": "user", "content": "Write the greeting file."}
    assert r.messages[3]["role"] == "tool" and r.messages[3]["tool_call_id"] == r.messages[2]["tool_calls"][0]["id"]
    assert r.messages[-1] == {"role": "assistant", "content": "The file is written."}
    assert r.usage.completion_tokens == sum(t.usage["completion_tokens"] for t in r.turns) > 0
    assert all(t.policy_s > 0 for t in r.turns) and r.turns[1].exec_s > 0


def test_text_mode_solves_file_task(tmp_path, shell):
    script = {
        "numbers": [
            "<think>make the dir</think><command>mkdir -p " + str(tmp_path / "d") + "</command>",
            "I will now write it.",  # unparsable: the model is told so and goes on
            "<command>echo wrong</command> no, this one: <command>seq 3 > " + str(tmp_path / "d/n.txt") + "</command>",
            "<command>rm -rf /</command><action>done</action>",  # done wins: nothing runs
        ]
    }
    with ScriptedServer(script) as srv:
        r = run_agent("Write the numbers file.", shell, _policy(srv, mode="text"), BudgetConfig())
    assert r.stop_reason == "done" and r.status == "ok"
    assert (tmp_path / "d/n.txt").read_text() == "1\n2\n3\n"
    assert [t.kind for t in r.turns] == ["command", "invalid", "command", "done"]
    assert r.messages[0]["content"] == TEXT_SYSTEM_PROMPT
    assert r.turns[1].observation == COULD_NOT_PARSE
    assert r.messages[5] == {"role": "user", "content": COULD_NOT_PARSE}
    assert r.turns[2].command.startswith("seq 3")
    assert r.messages[-1]["role"] == "assistant" and r.turns[-1].command is None


def test_malformed_tool_json_continues(tmp_path, shell):
    script = {"t": [{"fault": "malformed_tool_json"}, {"command": "echo recovered"}, "ok"]}
    with ScriptedServer(script) as srv:
        r = run_agent("t", shell, _policy(srv), BudgetConfig())
    assert r.stop_reason == "done"
    assert r.turns[0].kind == "invalid" and "JSON" in r.turns[0].observation
    assert r.messages[3]["role"] == "tool" and "JSON" in r.messages[3]["content"]
    assert r.turns[1].observation.startswith("Command executed successfully. Output: recovered")


def test_extra_tool_calls_are_answered_not_run(tmp_path, shell):
    marker = tmp_path / "second"
    script = {"t": [{"tool_calls": [{"command": "echo one"}, {"command": f"touch {marker}"}]}, "ok"]}
    with ScriptedServer(script) as srv:
        r = run_agent("t", shell, _policy(srv), BudgetConfig())
    assert not marker.exists()
    ids = [c["id"] for c in r.messages[2]["tool_calls"]]
    assert [m.get("tool_call_id") for m in r.messages[3:5]] == ids
    assert r.messages[4]["content"] == NOT_RUN


@pytest.mark.parametrize(
    "fault,stop,status",
    [
        (500, "policy_error", "policy_error"),
        (429, "policy_error", "policy_error"),
        ("empty_choices", "policy_error", "policy_error"),
        ("timeout", "policy_error", "policy_error"),
        ("context_length", "context", "ok"),
    ],
)
def test_faults_end_in_status_never_raise(shell, fault, stop, status):
    script = {"t": [{"command": "echo first"}, {"fault": fault, "sleep_s": 3}]}
    with ScriptedServer(script) as srv:
        pol = _policy(srv, max_retries=2, request_timeout_s=0.5)
        r = run_agent("t", shell, pol, BudgetConfig())
    assert (r.stop_reason, r.status) == (stop, status)
    assert r.error
    assert len(r.turns) == 1 and r.turns[0].observation.startswith("Command executed successfully")
    # a context error is not retried; the same HTTP 500 twice is deterministic (fails fast); the rest retry twice
    expected_requests = 1 + {"context_length": 1, 500: 2}.get(fault, 3)
    assert srv.chat_requests == expected_requests


def _first_turn_usage(srv, shell) -> dict:
    """What the server reports for the first turn (the budgets below are set from it)."""
    return run_agent("t", shell, _policy(srv), BudgetConfig(max_turns=1)).turns[0].usage


def test_context_budget_from_reported_prompt_tokens(shell):
    script = {"t": [{"command": "echo a"}, {"command": "echo b"}, {"command": "echo c"}]}
    with ScriptedServer(script) as srv:
        first = _first_turn_usage(srv, shell)
        budget = first["prompt_tokens"] + first["completion_tokens"]  # reached by turn 1, passed by turn 2
        r = run_agent("t", shell, _policy(srv), BudgetConfig(context_tokens=budget))
        assert srv.chat_requests == 1 + 2
    assert r.stop_reason == "context" and r.status == "ok"
    last = r.turns[-1].usage
    assert last["prompt_tokens"] + last["completion_tokens"] > budget
    assert len(r.turns) == 2


def test_token_budget(shell):
    script = {"t": [{"command": "echo " + "x " * 30}] * 5}
    with ScriptedServer(script) as srv:
        budget = _first_turn_usage(srv, shell)["completion_tokens"] + 1  # passed by turn 2
        r = run_agent("t", shell, _policy(srv), BudgetConfig(total_tokens=budget))
    assert r.stop_reason == "token_budget" and r.status == "ok"
    assert len(r.turns) == 2 and r.usage.completion_tokens >= budget


def test_max_turns(shell):
    with ScriptedServer({"t": [{"command": "true"}] * 10}) as srv:
        r = run_agent("t", shell, _policy(srv), BudgetConfig(max_turns=3))
    assert r.stop_reason == "max_turns" and r.status == "ok" and len(r.turns) == 3
    assert srv.chat_requests == 3


def test_wall_time_budget_with_injected_clock(shell):
    ticks = itertools.count(0, 7)  # every clock read advances 7 s
    with ScriptedServer({"t": [{"command": "true"}] * 10}) as srv:
        r = run_agent("t", shell, _policy(srv), BudgetConfig(wall_time_s=60), clock=lambda: float(next(ticks)))
    assert r.stop_reason == "wall_time" and r.status == "ok"
    assert 1 <= len(r.turns) < 10
    assert r.turns[0].timeout_s <= 60


def test_command_timeout_capped_and_reported(shell):
    with ScriptedServer({"t": [{"command": "sleep 30", "timeout": 999}, "ok"]}) as srv:
        r = run_agent("t", shell, _policy(srv), BudgetConfig(command_timeout_s=1))
    t = r.turns[0]
    assert t.timeout_s == 1 and t.timed_out and t.exit_code is None
    assert "timed out after 1 s" in t.observation
    assert r.stop_reason == "done"


class _Boom:
    mode = "text"

    def act(self, messages):
        raise RuntimeError("policy bug")


class _BrokenShell:
    """A shell whose transport is gone (stands in for a dead instance)."""

    def run(self, command, timeout=60.0):
        raise BrokenPipeError("shell pipe closed")


def test_exceptions_become_statuses(shell):
    r = run_agent("t", shell, _Boom(), BudgetConfig())
    assert (r.status, r.stop_reason) == ("policy_error", "policy_error") and "policy bug" in r.error
    with ScriptedServer({"t": [{"command": "ls"}]}) as srv:
        r = run_agent("t", _BrokenShell(), _policy(srv), BudgetConfig())
    assert (r.status, r.stop_reason) == ("shell_error", "shell_error") and "pipe closed" in r.error


def test_null_and_oracle_policies(tmp_path, shell):
    r = run_agent("t", shell, NullPolicy(), BudgetConfig())
    assert r.stop_reason == "done" and len(r.turns) == 1 and r.turns[0].command is None
    sol = tmp_path / "solve.sh"
    target = tmp_path / "made.txt"
    sol.write_text(f"#!/bin/bash\nset -e\ncat > {target} <<'EOF'\nline with 'quotes' and $HOME\nEOF\n")
    task = Task(
        id="t1", prompt="p", recipe=Recipe(kind="def", path=tmp_path / "c.def", context_dir=tmp_path), solution=sol, source=tmp_path
    )
    pol = make_policy(PolicyConfig(kind="oracle"), task)
    assert isinstance(pol, OraclePolicy)
    r = run_agent("p", shell, pol, BudgetConfig(command_timeout_s=5, wall_time_s=1000))
    assert r.stop_reason == "done" and [t.kind for t in r.turns] == ["command", "done"]
    assert target.read_text() == "line with 'quotes' and $HOME\n"
    assert r.turns[0].exit_code == 0 and r.turns[0].timeout_s == 600  # trusted: not capped at 5 s
