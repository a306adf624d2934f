"""What every policy shares: the ``Policy`` protocol, the ``Action`` it returns, its errors and
the token capture an episode's record stores. Implementations import this module, never the
registry in ``policies.py``.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from et_hpc.agent.prompts import COULD_NOT_PARSE
from et_hpc.agent.wire import Mode, parse_text_reply
from et_hpc.errors import InfraError
from et_hpc.record import TokensSource

DEFAULT_MAX_TOKENS = 2048  # completion tokens per turn unless a config says otherwise


class PolicyError(InfraError):
    """The policy could not produce an action (server down, retries exhausted, bad response)."""


class ContextLengthError(PolicyError):
    """The server refused the request because the conversation is longer than its context."""


class TokenCapture(BaseModel):
    """An episode's tokens as the record stores them (see ``et_hpc.record``)."""

    prompt_token_ids: list[list[int]] | None = None  # per turn: the prompt tokens new since the last completion
    token_ids: list[list[int]] | None = None
    logprobs: list[list[float]] | None = None
    tokens_source: TokensSource = "absent"
    token_drift: str | None = None
    events: list[str] = Field(default_factory=list)  # how the ids were obtained, when not the plain way


class Action(BaseModel):
    """One decision of a policy, plus what the server said about producing it."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["command", "done", "invalid"]
    command: str | None = None
    timeout: float | None = None  # seconds the policy asks for; the loop caps it
    uncapped_timeout: bool = False  # trusted commands (oracle) are capped by wall time only
    message: dict[str, Any]  # the assistant message to append, OpenAI format
    tool_call_id: str | None = None  # tools mode: the call the observation answers
    extra_tool_call_ids: list[str] = Field(default_factory=list)  # calls that are not run
    error: str | None = None  # kind == "invalid": the text sent back to the model
    usage: dict[str, int] | None = None  # prompt_tokens, completion_tokens, total_tokens
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    prompt_token_ids: list[int] | None = None  # the whole prompt of the request, as the server tokenized it
    tokens_from: Literal["server", "tokenize"] | None = None
    retries: int = 0  # failed requests retried before this answer


@runtime_checkable
class Policy(Protocol):
    """``mode`` tells the loop which protocol (system prompt, observation role) to speak."""

    mode: Mode

    def act(self, messages: list[dict[str, Any]]) -> Action: ...


def text_action(content: str) -> Action:
    """The action a text-protocol reply asks for."""
    parsed = parse_text_reply(content)
    msg = {"role": "assistant", "content": content}
    if parsed.kind == "invalid":
        return Action(kind="invalid", message=msg, error=COULD_NOT_PARSE)
    return Action(kind=parsed.kind, command=parsed.command, message=msg)
