"""Token ids of chat completions from servers that do not return them the vLLM way (``return_token_ids``).

- Completion ids from the answer's logprobs: vLLM's ``token_id:N`` tokens (``return_tokens_as_token_ids``)
  or llama-server's integer ``id`` per entry (it sends logprobs when asked with ``n_probs``; other
  servers ignore that field). These are the sampled ids, exact.
- Prompt ids from llama-server: its ``/tokenize`` takes text, not a conversation (it answers ``[]`` to
  ``messages``), so the conversation is rendered by its own chat template (``POST /apply-template``,
  the tools included) and tokenized by its own tokenizer (``POST /tokenize``, special tokens parsed, as
  its chat route does). Re-rendered, not returned: ``tokens_source`` is ``re-tokenized``, with ``REASON``
  among the events; a prompt whose length differs from the server's own ``usage.prompt_tokens`` is drift.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any, Protocol

import httpx
import openai

log = logging.getLogger(__name__)

_TOKEN_ID_RE = re.compile(r"^token_id:(-?\d+)$")
LLAMA_ASK = {"n_probs": 1}  # llama-server: logprobs with ids in the chat answer (ignored elsewhere)
REASON = (
    "tokens: re-tokenized: the server returns no prompt ids; prompts rendered by its own chat template "
    "(/apply-template) and tokenizer (/tokenize), completions are the sampled ids from its logprobs"
)


class _Turn(Protocol):
    prompt_token_ids: list[int] | None
    token_ids: list[int] | None
    usage: dict[str, int] | None
    finish_reason: str | None


def logprob_token_ids(content: Sequence[Any]) -> list[int] | None:
    """The sampled ids in a chat answer's ``logprobs.content``, or None when an entry names none."""
    out: list[int] = []
    for c in content:
        m = _TOKEN_ID_RE.match(getattr(c, "token", None) or "")
        tid = int(m.group(1)) if m else (getattr(c, "model_extra", None) or {}).get("id")
        if not isinstance(tid, int) or isinstance(tid, bool):
            return None
        out.append(tid)
    return out


def render_ids(
    client: openai.OpenAI, tokenize_url: str, messages: list[dict[str, Any]], tools: list[dict] | None, add_generation_prompt: bool
) -> list[int] | None:
    """llama-server's ids for a conversation: its template's text, then its tokenizer; None on failure.

    A last assistant message is rendered open (llama-server prefills it), as the conversation's end."""
    root = tokenize_url.rsplit("/", 1)[0]

    def post(path: str, body: dict[str, Any]) -> Any:
        return client.post(root + path, cast_to=httpx.Response, body=body, options={"max_retries": 0}).json()

    body: dict[str, Any] = {"messages": messages, "add_generation_prompt": add_generation_prompt}
    if tools:
        body["tools"] = tools
    try:
        text = post("/apply-template", body)["prompt"]
        out = post("/tokenize", {"content": text, "add_special": True, "parse_special": True})["tokens"]
        ids = [int(t if isinstance(t, int) else t["id"]) for t in out]
    except Exception as e:  # noqa: BLE001 - token accounting never fails an episode
        log.warning("llama-server render/tokenize failed: %s: %s", type(e).__name__, e)
        return None
    return ids or None


def with_sampled_end(final: list[int] | None, last: _Turn) -> list[int] | None:
    """llama-server renders a conversation ending with an assistant message open (it prefills it), so
    its ``final`` lacks the end-of-turn token a reply that stopped was sampled with (the logprobs carry
    it; the content does not). Put back exactly that token when everything before it agrees."""
    seq = [*(last.prompt_token_ids or []), *(last.token_ids or [])]
    if final is not None and last.finish_reason == "stop" and last.token_ids and final == seq[:-1]:
        return [*final, seq[-1]]
    return final


def count_drift(turns: Sequence[_Turn]) -> str | None:
    """Where a re-rendered prompt's length differs from the server's count of the prompt it saw."""
    for i, t in enumerate(turns):
        counted = (t.usage or {}).get("prompt_tokens")
        if t.prompt_token_ids is not None and counted is not None and counted != len(t.prompt_token_ids):
            return f"turn {i}: the re-rendered prompt has {len(t.prompt_token_ids)} tokens, the server counted {counted}"
    return None
