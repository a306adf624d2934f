"""A reply's tool calls are kept in the conversation as arguments every server re-renders: the
model's malformed or cut-off call stays its own failure (an invalid turn, then reward 0), and never
becomes a request the server refuses (a masked policy error). The scripted server refuses to render
unparsable arguments of the history's calls, as vLLM and llama-server do."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from et_hpc.agent.replies import tool_action
from et_hpc.agent.token_in import parse_hermes
from et_hpc.agent.wire import history_arguments
from et_hpc.testing.scripted_tokenizer import HistoryError, render_chat

HEAD = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]


def _msg(name: str, arguments: str) -> SimpleNamespace:
    fn = SimpleNamespace(name=name, arguments=arguments)
    return SimpleNamespace(content="", tool_calls=[SimpleNamespace(id="call_0", function=fn)])


def _conversation(action) -> list[dict]:
    obs = {"role": "tool", "tool_call_id": action.tool_call_id or "call_0", "content": action.error or "out"}
    return [*HEAD, action.message, obs]


def test_a_cut_off_call_is_refused_by_the_server_as_written():
    cut = '{"command": "tail -n +2 /home/user/data/sales.csv | awk -F, \'{s+=$3}'  # the reply hit max_tokens
    call = {"id": "c", "type": "function", "function": {"name": "terminal", "arguments": cut}}
    raw = {"role": "assistant", "content": "", "tool_calls": [call]}
    with pytest.raises(HistoryError):  # positive control: kept as written, the next request fails
        render_chat([*HEAD, raw, {"role": "tool", "tool_call_id": "c", "content": "x"}])
    action = tool_action(_msg("terminal", cut))
    assert action.kind == "invalid" and action.error.startswith("Could not parse")
    assert json.loads(action.message["tool_calls"][0]["function"]["arguments"]) == {"unparsed": cut}
    assert "unparsed" in render_chat(_conversation(action))


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(["terminal", "", "bash", "terminal\n"]), arguments=st.text(max_size=80))
def test_any_arguments_are_kept_renderable(name, arguments):
    action = tool_action(_msg(name, arguments))
    for call in action.message["tool_calls"]:
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
    render_chat(_conversation(action))  # never refused
    if action.kind == "command":  # a usable call is kept exactly as the model wrote it
        assert action.message["tool_calls"][0]["function"]["arguments"] == arguments


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=200), cut=st.integers(min_value=0, max_value=120))
def test_any_raw_completion_is_kept_renderable(text, cut):
    """Token-in: a raw completion (the Hermes form, cut anywhere, or any text) parsed and kept."""
    full = '<tool_call>{"name": "terminal", "arguments": {"command": ' + json.dumps(text) + "}}</tool_call>"
    for raw in (full, full[:cut] + "</tool_call>", text):
        action = tool_action(parse_hermes(raw))
        for call in action.message.get("tool_calls") or []:
            assert isinstance(json.loads(call["function"]["arguments"]), dict)
        render_chat(_conversation(action))


def test_arguments_that_are_an_object_are_kept_byte_for_byte():
    for a in ('{"command": "ls"}', '{ "command" : "ls" , "timeout": 3 }', "{}"):
        assert history_arguments(a) == a
    for a in ("", "[1]", '"ls"', "null", '{"command": "ls"'):
        assert json.loads(history_arguments(a)) == {"unparsed": a}
