"""What the OpenAI client does not do itself with a server's answer: ``error_text`` and
``retry_after`` of an error answer, ``malformed`` (what makes a chat completion unusable) and
``keep_reasoning`` (the model's reasoning kept in the history, as the chat template re-renders it)."""

from __future__ import annotations

from typing import Any

import openai


def malformed(resp: Any) -> str | None:
    """What makes a chat completion unusable (the client does not validate it), or None."""
    choices = getattr(resp, "choices", None)
    if not isinstance(choices, list) or not hasattr(choices[0], "message"):
        return "choices is not a list of choice objects"
    msg = choices[0].message
    if not hasattr(msg, "content") or not isinstance(getattr(msg, "content", None), (str, type(None))):
        return "choices[0].message has no text content"
    calls = getattr(msg, "tool_calls", None)
    if calls is not None:
        if not isinstance(calls, list):
            return "tool_calls is not a list"
        for c in calls:
            fn = getattr(c, "function", None)
            if not isinstance(getattr(fn, "name", None), str) or \
                    not isinstance(getattr(fn, "arguments", None), (str, type(None))):
                return "a tool call has no function name and arguments"
    return None


def keep_reasoning(message: dict[str, Any], msg: Any) -> None:
    """Keep the model's reasoning (``reasoning_content``, or vLLM's newer ``reasoning``) in the history,
    as the chat template re-renders it: dropping it would make the next prompt differ from the tokens sampled."""
    for key in ("reasoning_content", "reasoning"):
        val = getattr(msg, key, None)
        if val is None:
            val = (getattr(msg, "model_extra", None) or {}).get(key)
        if isinstance(val, str) and val:
            message["reasoning_content"] = val
            return


def error_text(e: openai.APIStatusError) -> str:
    body = e.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
        if isinstance(inner, str):
            return inner
    return str(e.message or e)


def retry_after(e: openai.APIStatusError) -> float | None:
    try:
        val = e.response.headers.get("retry-after")
        return float(val) if val is not None else None
    except (TypeError, ValueError, AttributeError):
        return None
