"""What the OpenAI client does not do itself with a server's answer: ``error_text`` and
``retry_after`` of an error answer, ``malformed`` (what makes a chat completion unusable),
``keep_reasoning`` (the model's reasoning kept in the history, as the chat template re-renders it)
and the ``Action`` a reply asks for (``to_action`` for a chat completion, ``tool_action`` for an
assistant message in tools mode)."""

from __future__ import annotations

from typing import Any

import openai

from et_hpc.agent.base import Action, text_action
from et_hpc.agent.chat_tokens import logprob_token_ids
from et_hpc.agent.wire import Mode, ToolArgsError, history_arguments, parse_tool_arguments


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
            if not isinstance(getattr(fn, "name", None), str) or not isinstance(getattr(fn, "arguments", None), (str, type(None))):
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


def to_action(resp: Any, mode: Mode, with_token_ids: bool) -> Action:
    """The action a chat completion asks for, with its usage, finish reason and logprobs (and the
    completion's token ids from the logprobs when ``with_token_ids``)."""
    choice = resp.choices[0]
    msg = choice.message
    if mode == "text":
        action = text_action(msg.content or "")
        keep_reasoning(action.message, msg)
    else:
        action = tool_action(msg)
    usage = getattr(resp, "usage", None)
    if usage is not None:
        action.usage = {k: int(v) for k, v in usage.model_dump().items() if k.endswith("_tokens") and isinstance(v, int)}
    action.finish_reason = choice.finish_reason
    lp = getattr(choice, "logprobs", None)
    content = getattr(lp, "content", None) if lp is not None else None
    if content:
        action.logprobs = [float(c.logprob) for c in content]
        if with_token_ids:
            action.token_ids = logprob_token_ids(content)
    return action


def tool_action(msg: Any) -> Action:
    """The action an assistant message with tool calls asks for: the first call's command (or an
    invalid action saying why its arguments are unusable); the other calls are answered, not run;
    no call is ``done``."""
    calls = list(msg.tool_calls or [])
    # content "" rather than null beside tool calls: vLLM takes both, llama-cpp-python's server
    # rejects null (HTTP 500, a validation error), llama-server takes both.
    message: dict[str, Any] = {"role": "assistant", "content": msg.content or ""}
    keep_reasoning(message, msg)
    if not calls:
        return Action(kind="done", message=message)
    ids: list[str] = []
    functions: list[dict[str, str]] = []
    for i, c in enumerate(calls):
        fn = getattr(c, "function", None)
        ids.append(c.id or f"call_{i}")
        functions.append({"name": getattr(fn, "name", None) or "", "arguments": getattr(fn, "arguments", None) or ""})
    kept = [{"name": f["name"], "arguments": history_arguments(f["arguments"])} for f in functions]
    message["tool_calls"] = [{"id": i, "type": "function", "function": f} for i, f in zip(ids, kept)]
    extra = ids[1:]
    try:
        cmd, timeout = parse_tool_arguments(functions[0]["name"], functions[0]["arguments"])
    except ToolArgsError as e:
        return Action(kind="invalid", message=message, tool_call_id=ids[0], error=str(e), extra_tool_call_ids=extra)
    return Action(kind="command", command=cmd, timeout=timeout, message=message, tool_call_id=ids[0], extra_tool_call_ids=extra)
