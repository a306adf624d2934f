"""Token-in continuation against the scripted server's vLLM routes (/tokenize with messages, /v1/completions
with token-id prompts): a reasoning model and a model writing compact tool-call JSON, whose re-rendered
history drifts in chat mode, end server-exact in token-in mode. Real HTTP, the real loop, a host bash.
"""

from __future__ import annotations

import random

from et_hpc.agent.loop import BudgetConfig, run_agent
from et_hpc.agent.openai_policy import OpenAIPolicy
from et_hpc.agent.token_in import parse_hermes
from et_hpc.testing import scripted_tokenizer as tk
from et_hpc.testing.scripted_server import ScriptedServer

THINKS = {
    "task": [
        {"command": "echo one", "reasoning": "first I look"},
        {"command": "echo two", "reasoning": "then I check"},
        {"content": "finished", "reasoning": "all good"},
    ]
}
COMPACT = {
    "task": [
        {"tool_calls": [{"name": "terminal", "arguments": '{"command":"echo one"}'}]},
        {"tool_calls": [{"name": "terminal", "arguments": '{"command":"echo two","timeout":5}'}]},
        "finished",
    ]
}
TEXT_THINKS = {
    "task": [
        {"content": "<command>echo one</command>", "reasoning": "hmm"},
        {"content": "<command>echo two</command>", "reasoning": "hmm again"},
        {"content": "<action>done</action>", "reasoning": "done now"},
    ]
}


def _run(script, shell, *, token_in: bool, mode: str = "tools"):
    with ScriptedServer(script) as srv:
        p = OpenAIPolicy(srv.base_url, mode=mode, token_in=token_in, backoff_base_s=0.01, rng=random.Random(0))
        r = run_agent("Do the task.", shell, p, BudgetConfig())
        return r, dict(srv.requests)


def _check_exact(r) -> None:
    assert r.status == "ok", r.error
    t = r.tokens
    assert (t.tokens_source, t.token_drift) == ("server-exact", None)
    seq: list[int] = []
    for turn, delta, comp in zip(r.turns, t.prompt_token_ids, t.token_ids):
        seq += delta
        assert turn.prompt_token_ids == seq  # each prompt is exactly what was sent
        seq += comp


def test_reasoning_kept_in_chat_history_and_token_in(shell):
    # chat mode: the reasoning stays in the history (reasoning_content), which the template re-renders
    # after tool results, so the sequence is exact there too
    chat, _ = _run(THINKS, shell, token_in=False)
    assert (chat.tokens.tokens_source, chat.tokens.token_drift) == ("server-exact", None)
    assert chat.messages[2]["reasoning_content"] == "first I look"
    r, reqs = _run(THINKS, shell, token_in=True)
    _check_exact(r)
    assert [t.command for t in r.turns] == ["echo one", "echo two", None] and r.stop_reason == "done"
    assert reqs.get("POST /v1/completions") == 3 and not reqs.get("POST /v1/chat/completions")
    # the model's thinking is in what it generated, and so in what is trained on
    assert "first I look" in tk.decode(r.tokens.token_ids[0])


def test_compact_tool_json_drifts_in_chat_mode_and_is_exact_token_in(shell):
    chat, _ = _run(COMPACT, shell, token_in=False)
    assert chat.tokens.token_drift  # positive control: the template re-serialises the arguments
    r, _ = _run(COMPACT, shell, token_in=True)
    _check_exact(r)
    assert [t.command for t in r.turns] == ["echo one", "echo two", None]
    assert '{"command":"echo one"}' in tk.decode(r.tokens.token_ids[0])  # as the model wrote it
    assert r.turns[1].timeout_s == 5


def test_text_mode_reasoning_drifts_in_chat_mode_and_is_exact_token_in(shell):
    chat, _ = _run(TEXT_THINKS, shell, token_in=False, mode="text")
    assert chat.tokens.token_drift  # positive control: the template drops reasoning before a user turn
    r, _ = _run(TEXT_THINKS, shell, token_in=True, mode="text")
    _check_exact(r)
    assert [t.command for t in r.turns] == ["echo one", "echo two", None]
    # every later prompt ends with the template's assistant header, after the observation
    assert tk.decode(r.turns[1].prompt_token_ids).endswith("(exit_code=0)<|im_end|>\n<|im_start|>assistant\n")


def test_parse_hermes():
    p = parse_hermes('thinking\n<tool_call>\n{"name": "terminal", "arguments": {"command": "ls"}}\n</tool_call>')
    assert p.content == "thinking" and p.tool_calls[0].function.name == "terminal"
    assert p.tool_calls[0].function.arguments == '{"command": "ls"}'
    bad = parse_hermes("<tool_call>{not json</tool_call>")
    assert bad.tool_calls[0].function.name == "" and bad.tool_calls[0].function.arguments == "{not json"
    assert parse_hermes("just text").tool_calls == []


def test_token_in_records_exact_ids_and_their_logprobs_together(shell, caplog):
    """Token-in asks /v1/completions for the sampled tokens' logprobs (``logprobs``) and keeps them
    aligned with the completion ids: each turn's logprobs are the scripted model's for those ids."""
    with ScriptedServer(THINKS) as srv:
        p = OpenAIPolicy(srv.base_url, token_in=True, logprobs=True, backoff_base_s=0.01, rng=random.Random(0))
        r = run_agent("Do the task.", shell, p, BudgetConfig())
    _check_exact(r)
    t = r.tokens
    assert t.logprobs is not None and len(t.logprobs) == len(t.token_ids) == 3
    for ids, lps in zip(t.token_ids, t.logprobs):
        assert lps == [tk.logprob_of(tok, j) for j, tok in enumerate(ids)]
    # a server that gives no logprobs: a warning, never silence (positive control above)
    with ScriptedServer(THINKS) as srv:
        import et_hpc.testing.scripted_tokenizer as stk
        from et_hpc.agent import token_in

        token_in._WARNED.clear()  # once per process: this test's warning is the one looked for
        real, stk.completion_logprobs = stk.completion_logprobs, lambda ids, n: None
        try:
            p = OpenAIPolicy(srv.base_url, token_in=True, logprobs=True, backoff_base_s=0.01, rng=random.Random(0))
            r2 = run_agent("Do the task.", shell, p, BudgetConfig())
        finally:
            stk.completion_logprobs = real
    assert r2.tokens.logprobs is None and r2.tokens.tokens_source == "server-exact"
    assert "logprobs were asked for but /v1/completions gave no logprobs.token_logprobs" in caplog.text


def test_token_in_auto_stays_in_chat_mode_on_a_vllm_shaped_server(shell):
    """``token_in: auto`` (the config's default) turns token-in on only where the server is
    llama-server (it answers /apply-template); the scripted vLLM-shaped server does not, so chat mode
    (the real llama-server's side: tests/model/test_model_server.py)."""
    from et_hpc.agent.policies import PolicyConfig

    assert PolicyConfig().token_in == "auto"
    with ScriptedServer(THINKS) as srv:
        p = OpenAIPolicy(srv.base_url, token_in="auto", backoff_base_s=0.01, rng=random.Random(0))
        r = run_agent("Do the task.", shell, p, BudgetConfig())
        served = dict(srv.requests)
    assert r.status == "ok" and p.token_in is False
    assert served.get("POST /v1/completions", 0) == 0 and served.get("POST /v1/chat/completions", 0) >= 3, served
