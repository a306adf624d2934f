"""The token rules for chat answers without token ids (``et_hpc.agent.chat_tokens``), on plain values;
the real server's side is in test_model_server.py (chat-mode episodes against llama-server)."""

from __future__ import annotations

from types import SimpleNamespace as NS

from et_hpc.agent.chat_tokens import count_drift, logprob_token_ids, with_sampled_end


def turn(prompt, ids, finish="stop", counted=None):
    return NS(prompt_token_ids=prompt, token_ids=ids, finish_reason=finish, usage=None if counted is None else {"prompt_tokens": counted})


def test_logprob_ids_from_either_form():
    vllm = [NS(token="token_id:7", model_extra={}), NS(token="token_id:9", model_extra={})]
    llama = [NS(token="A", model_extra={"id": 49}), NS(token="mm", model_extra={"id": 6799})]
    assert logprob_token_ids(vllm) == [7, 9] and logprob_token_ids(llama) == [49, 6799]
    assert logprob_token_ids([NS(token="A", model_extra={})]) is None  # an entry without an id: no ids at all
    assert logprob_token_ids([NS(token="A", model_extra={"id": True})]) is None


def test_the_sampled_end_token_is_put_back_only_when_the_rest_agrees():
    last = turn([1, 2, 3], [4, 5, 2])
    assert with_sampled_end([1, 2, 3, 4, 5], last) == [1, 2, 3, 4, 5, 2]
    assert with_sampled_end([1, 2, 3, 4, 6], last) == [1, 2, 3, 4, 6]  # differs before the end: left as is
    assert with_sampled_end([1, 2, 3, 4, 5], turn([1, 2, 3], [4, 5, 2], "length")) == [1, 2, 3, 4, 5]
    assert with_sampled_end(None, last) is None


def test_a_prompt_the_server_counted_otherwise_is_drift():
    assert count_drift([turn([1, 2], [3], counted=2), turn([1, 2, 3, 4], [5], counted=4)]) is None
    why = count_drift([turn([1, 2], [3], counted=2), turn([1, 2, 3, 4], [5], counted=5)])
    assert why is not None and why.startswith("turn 1:") and "5" in why
