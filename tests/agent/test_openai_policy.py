"""OpenAIPolicy against the real scripted HTTP server: retries, give-up, context, logprobs, tool args."""

from __future__ import annotations

import random

import pytest

from et_hpc.agent.openai_policy import OpenAIPolicy
from et_hpc.agent.policies import ContextLengthError, PolicyConfig, PolicyError, make_policy
from et_hpc.agent.prompts import COULD_NOT_PARSE
from et_hpc.errors import UserError
from et_hpc.testing.scripted_server import ScriptedServer


def _msgs(user: str) -> list[dict]:
    return [{"role": "system", "content": "s"}, {"role": "user", "content": user}]


def _policy(srv: ScriptedServer, **kw) -> tuple[OpenAIPolicy, list[float]]:
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)

    kw.setdefault("backoff_base_s", 0.01)
    kw.setdefault("backoff_max_s", 0.05)
    p = OpenAIPolicy(srv.base_url, kw.pop("model", None), sleep=sleep, rng=random.Random(0), **kw)
    return p, sleeps


def test_retries_with_backoff_then_answer():
    script = {"t": [{"fault": 500}, {"fault": 429}, {"fault": "empty_choices"}, {"command": "ls"}]}
    with ScriptedServer(script) as srv:
        p, sleeps = _policy(srv, max_retries=5)
        a = p.act(_msgs("t"))
        assert a.kind == "command" and a.command == "ls"
        assert srv.chat_requests == 4  # three faults seen by the server, then the answer
        assert a.retries == 3 and p.retries == 3
        assert len(sleeps) == 3
        # exponential: each delay's ceiling doubles (jitter takes 50..100% of it)
        assert 0.005 <= sleeps[0] <= 0.01 and 0.01 <= sleeps[1] <= 0.02 and 0.02 <= sleeps[2] <= 0.04
        assert p.model == "scripted"  # learned from GET /models


def test_retry_after_header_is_respected_within_cap():
    with ScriptedServer({"t": [{"fault": 429, "retry_after": 2}, "<command>ls</command>"]}) as srv:
        p, sleeps = _policy(srv, mode="text", backoff_max_s=1.0)
        assert p.act(_msgs("t")).command == "ls"
        assert sleeps == [1.0]  # Retry-After 2 s, capped at backoff_max_s


def test_same_500_twice_fails_fast_with_the_servers_message():
    # what llama-cpp-python's server does with a message it cannot validate: the same 500 every time
    msg = "7 validation errors for CreateChatCompletionRequest"
    with ScriptedServer({"t": [{"fault": 500, "message": msg}]}) as srv:
        p, sleeps = _policy(srv, max_retries=6, model="scripted")
        with pytest.raises(PolicyError) as e:
            p.act(_msgs("t"))
        assert "twice with the same error (HTTP 500)" in str(e.value) and msg in str(e.value)
        assert srv.chat_requests == 2 and len(sleeps) == 1


def test_different_500s_are_retried():
    # positive control for the rule above: a server in trouble answers differently, and is retried
    script = {"t": [{"fault": 500, "message": "a"}, {"fault": 500, "message": "b"}, {"command": "ls"}]}
    with ScriptedServer(script) as srv:
        p, _ = _policy(srv, max_retries=6, model="scripted")
        assert p.act(_msgs("t")).command == "ls" and srv.chat_requests == 3


@pytest.mark.parametrize("fault", [429, "empty_choices"])
def test_persistent_fault_gives_policy_error_after_budget(fault):
    with ScriptedServer({"t": [{"fault": fault}]}) as srv:
        p, sleeps = _policy(srv, max_retries=3, model="scripted")
        with pytest.raises(PolicyError) as e:
            p.act(_msgs("t"))
        assert not isinstance(e.value, ContextLengthError)
        assert "gave up after 4 attempts" in str(e.value)
        assert srv.chat_requests == 4 and len(sleeps) == 3


def test_timeout_is_retried_then_gives_up():
    with ScriptedServer({"t": [{"fault": "timeout", "sleep_s": 5}]}) as srv:
        p, sleeps = _policy(srv, max_retries=1, request_timeout_s=0.3, model="scripted")
        with pytest.raises(PolicyError, match="timed out"):
            p.act(_msgs("t"))
        assert srv.chat_requests == 2


def test_retry_budget_in_seconds_stops_early():
    with ScriptedServer({"t": [{"fault": "timeout", "sleep_s": 5}]}) as srv:
        p, _ = _policy(srv, max_retries=100, retry_budget_s=0.5, request_timeout_s=0.3, model="scripted")
        with pytest.raises(PolicyError):
            p.act(_msgs("t"))
        assert srv.chat_requests <= 3


def test_connection_refused_is_policy_error():
    with ScriptedServer({"t": ["x"]}) as srv:
        url = srv.base_url
    p = OpenAIPolicy(url, "m", max_retries=2, backoff_base_s=0.01, sleep=lambda s: None)
    with pytest.raises(PolicyError, match="connection failed"):
        p.act(_msgs("t"))
    assert p.requests == 3


def test_context_length_400_is_not_retried():
    with ScriptedServer({"t": [{"fault": "context_length"}]}) as srv:
        p, sleeps = _policy(srv, model="scripted")
        with pytest.raises(ContextLengthError, match="maximum context length"):
            p.act(_msgs("t"))
        assert srv.chat_requests == 1 and sleeps == []


def test_other_400_is_policy_error_without_retry():
    with ScriptedServer({"t": ["x"]}) as srv:
        p, _ = _policy(srv, model="scripted")
        with pytest.raises(PolicyError, match="HTTP 400"):
            p.act(_msgs("zzz"))
        assert srv.chat_requests == 1


def test_logprobs_and_token_ids_kept():
    from et_hpc.testing import scripted_tokenizer as tk

    with ScriptedServer({"t": [{"command": "echo hi"}]}) as srv:
        p, _ = _policy(srv)  # return_token_ids is on by default
        a = p.act(_msgs("t"))
        assert a.usage and a.usage["completion_tokens"] == len(a.token_ids) > 0 and a.logprobs is None
        assert a.usage["prompt_tokens"] == len(a.prompt_token_ids) and a.tokens_from == "server"
        assert a.token_ids[-1] == tk.EOS_ID and tk.decode(a.token_ids).startswith("<tool_call>\n")
        assert a.finish_reason == "tool_calls"
        p, _ = _policy(srv, logprobs=True)
        b = p.act(_msgs("t"))
        assert b.token_ids == a.token_ids and len(b.logprobs) == len(b.token_ids)
        assert all(lp <= 0 for lp in b.logprobs)
    with ScriptedServer({"t": ["<command>pwd</command>"]}) as srv:
        p, _ = _policy(srv, mode="text", logprobs=True, return_token_ids=False)
        a = p.act(_msgs("t"))
        assert a.command == "pwd" and a.logprobs and a.token_ids is None and a.prompt_token_ids is None
        assert p.tokenize_requests == 0


def test_tools_mode_shapes():
    script = {
        "t": [{"tool_calls": [{"command": "ls"}, {"command": "pwd"}]}],
        "m": [{"fault": "malformed_tool_json"}],
        "f": ["All finished."],
    }
    with ScriptedServer(script) as srv:
        p, _ = _policy(srv)
        a = p.act(_msgs("t"))
        assert a.kind == "command" and a.command == "ls" and len(a.extra_tool_call_ids) == 1
        assert a.message["tool_calls"][0]["id"] == a.tool_call_id
        a = p.act(_msgs("m"))
        assert a.kind == "invalid" and "JSON" in a.error and a.tool_call_id
        a = p.act(_msgs("f"))
        assert a.kind == "done" and a.message == {"role": "assistant", "content": "All finished."}


def test_text_mode_unparsable():
    with ScriptedServer({"t": ["I think I should list files."]}) as srv:
        p, _ = _policy(srv, mode="text")
        a = p.act(_msgs("t"))
        assert a.kind == "invalid" and a.error == COULD_NOT_PARSE


def test_make_policy_openai_and_errors():
    with ScriptedServer({"t": ["x"]}) as srv:
        p = make_policy(PolicyConfig(kind="openai", base_url=srv.base_url, mode="text"), None, max_tokens=77)
        assert isinstance(p, OpenAIPolicy) and p.max_tokens == 77 and p.mode == "text"
    with pytest.raises(UserError, match="base_url"):
        make_policy(PolicyConfig(kind="openai"), None)
