"""The agent loop: ask the policy, run the command in the shell, feed back the observation.

``run_agent`` never raises for a failing policy or shell: those end the episode with status
``policy_error`` / ``shell_error``; a used-up budget (``BudgetConfig``) ends it with status ``ok``
and a ``stop_reason`` naming it. ``shell_blame(exc)`` True means the agent broke its shell (status
``ok``, stop ``shell_broken``). What a model gets wrong is a named ``outcome`` on its turn and a line
in ``events``; each ``Turn`` keeps the policy's token ids, and a policy's ``capture_tokens`` makes
the record's tokens at the end. The loop knows only ``shell.run``. Details: docs/policy.md, "The
agent loop".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from et_hpc.agent.base import DEFAULT_MAX_TOKENS, Action, ContextLengthError, Policy, PolicyError, TokenCapture
from et_hpc.agent.wire import OUTPUT_LIMIT_CHARS, Mode, default_system_prompt, format_observation
from et_hpc.text import hidden_count, visible

log = logging.getLogger(__name__)

StopReason = Literal["done", "max_turns", "wall_time", "context", "token_budget", "policy_error", "shell_error", "shell_broken"]
Status = Literal["ok", "policy_error", "shell_error"]

NOT_RUN = "Not executed: only one terminal call runs per turn. Call the tool again for the next command."


class ShellLike(Protocol):
    def run(self, command: str, timeout: float = 60.0) -> Any: ...


class BudgetConfig(BaseModel):
    """Limits of one episode; reaching one ends the agent's loop with its stop reason."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    max_turns: int = 16
    """Model turns per episode."""
    wall_time_s: float = 300.0
    """The agent's wall time per episode (seconds)."""
    command_timeout_s: float = 60.0
    """The time limit of one shell command, and the most a command may ask for (seconds)."""
    max_tokens_per_turn: int = DEFAULT_MAX_TOKENS
    """Completion tokens per turn, when ``policy.max_tokens`` is unset."""
    context_tokens: int = 16384
    """Stop once the last request's prompt plus completion exceeds this many tokens."""
    total_tokens: int | None = None
    """Cap on the summed completion tokens (None: no cap)."""
    output_limit_chars: int = OUTPUT_LIMIT_CHARS
    """Characters of a command's output the model is shown (a head and a tail)."""


Budgets = BudgetConfig  # the old name, which run configs pickled by queued jobs name


class Usage(BaseModel):
    prompt_tokens: int = 0  # summed over turns
    completion_tokens: int = 0  # summed over turns
    last_prompt_tokens: int = 0  # the most recent request's prompt length


class Turn(BaseModel):
    index: int
    kind: Literal["command", "done", "invalid"]
    message: dict[str, Any]  # the raw assistant message
    command: str | None = None
    observation: str | None = None
    exit_code: int | None = None
    timed_out: bool = False
    shell_restarted: bool = False
    escaped: int = 0  # control characters of the command's output and notes shown as escapes
    timeout_s: float | None = None  # the timeout the command ran with
    policy_s: float = 0.0
    exec_s: float = 0.0
    usage: dict[str, int] | None = None
    finish_reason: str | None = None
    retries: int = 0
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    prompt_token_ids: list[int] | None = None  # the request's whole prompt, as the server tokenized it
    tokens_from: Literal["server", "tokenize"] | None = None  # return_token_ids, or /tokenize after the fact
    outcome: str | None = None  # what the reply got wrong (see the module's doc), None when nothing


class AgentResult(BaseModel):
    messages: list[dict[str, Any]]
    turns: list[Turn] = Field(default_factory=list)
    stop_reason: StopReason
    status: Status = "ok"
    error: str | None = None
    usage: Usage = Field(default_factory=Usage)
    wall_s: float = 0.0
    model_s: float = 0.0  # summed policy calls, failed ones included
    exec_s: float = 0.0  # summed shell commands, failed ones included
    mode: str = "text"
    tokens: TokenCapture = Field(default_factory=TokenCapture)
    events: list[str] = Field(default_factory=list)  # the named outcomes, one line each


REPEATS = 3  # the same command this many times in a row up to max_turns is named repeated_command


def reply_outcome(mode: str, action: Action) -> str | None:
    """What a reply got wrong, as a name (None: a well-formed command or done)."""
    msg = action.message or {}
    content = msg.get("content") or ""
    calls = msg.get("tool_calls") or []
    if not content.strip() and not calls:
        return "empty_reply"
    if mode == "tools":
        if action.kind == "done":
            return "no_tool_call"
        if action.kind == "invalid":
            err = action.error or ""
            if err.startswith("Unknown tool"):
                return "unknown_tool"
            if err.startswith("Could not parse") or "must be a JSON object" in err:
                return "malformed_tool_json"
            return "bad_tool_arguments"
        if action.extra_tool_call_ids:
            return "several_tool_calls"
    elif action.kind == "invalid":
        return "unparsed_reply"
    if "<think>" in content.lower() or msg.get("reasoning_content"):
        return "thinking"
    return None


def _outcome_events(turns: list[Turn], stop: str | None) -> list[str]:
    out = []
    for t in turns:
        if t.outcome:
            extra = ""
            if t.outcome == "several_tool_calls":
                extra = f" ({len(t.message.get('tool_calls') or [])} calls; only the first ran)"
            out.append(f"{t.outcome}: turn {t.index}{extra}")
    cmds = [t.command for t in turns]
    if stop == "max_turns" and len(cmds) >= REPEATS and cmds[-1] is not None:
        n = 0
        for c in reversed(cmds):
            if c != cmds[-1]:
                break
            n += 1
        if n >= REPEATS:
            out.append(f"repeated_command: the same command on the last {n} turns up to max_turns: {cmds[-1][:200]!r}")
    if stop == "context":
        out.append("context: the conversation outgrew the model's context")
    escaped = [t for t in turns if t.escaped]
    if escaped:
        where = ", ".join(str(t.index) for t in escaped[:20]) + (" ..." if len(escaped) > 20 else "")
        n = sum(t.escaped for t in escaped)
        out.append(f"observation: {n} control characters or bytes that are not UTF-8 shown as visible escapes (turns {where})")
    return out


def _blame(shell_blame: Callable[[Exception], bool], e: Exception) -> bool:
    try:
        return bool(shell_blame(e))
    except Exception:  # noqa: BLE001 - undecided: not the agent's
        log.exception("deciding who broke the shell failed")
        return False


def _observation_message(mode: str, action: Action, content: str) -> dict[str, Any]:
    if mode == "tools" and action.tool_call_id:
        return {"role": "tool", "tool_call_id": action.tool_call_id, "content": content}
    return {"role": "user", "content": content}


def _budget_stop(budgets: BudgetConfig, n_turns: int, elapsed: float, usage: Usage, last_context: int) -> StopReason | None:
    """The budget that is used up before the next turn (None: the episode goes on)."""
    if n_turns >= budgets.max_turns:
        return "max_turns"
    if elapsed >= budgets.wall_time_s:
        return "wall_time"
    if budgets.total_tokens is not None and usage.completion_tokens >= budgets.total_tokens:
        return "token_budget"
    if last_context > budgets.context_tokens:
        return "context"
    return None


def _count_usage(usage: Usage, reported: dict[str, int]) -> int:
    """Add a turn's reported usage to ``usage``; returns the tokens the next request holds at least
    (this prompt plus this reply)."""
    pt = int(reported.get("prompt_tokens", 0))
    ct = int(reported.get("completion_tokens", 0))
    usage.prompt_tokens += pt
    usage.completion_tokens += ct
    usage.last_prompt_tokens = pt
    return pt + ct


def _capture_tokens(policy: Policy, turns: list[Turn], messages: list[dict[str, Any]]) -> TokenCapture:
    """The policy's token record of the episode (``capture_tokens``, when it has one and there were
    turns); a failing capture is logged and noted in ``token_drift``, never raised."""
    capture = getattr(policy, "capture_tokens", None)
    if capture is None or not turns:
        return TokenCapture()
    try:
        return capture(turns, messages)
    except Exception as e:  # token accounting must not cost the episode
        log.exception("token capture failed")
        return TokenCapture(token_drift=f"token capture failed: {type(e).__name__}: {e}")


def run_agent(
    prompt: str,
    shell: ShellLike,
    policy: Policy,
    budgets: BudgetConfig | None = None,
    *,
    system_prompt: str | None = None,
    clock: Callable[[], float] = time.monotonic,
    shell_blame: Callable[[Exception], bool] | None = None,
) -> AgentResult:
    """Run one episode's agent part; the caller scores the shell's state afterwards."""
    budgets = budgets or BudgetConfig()
    mode: Mode = policy.mode if hasattr(policy, "mode") else "text"
    sys_text = system_prompt if system_prompt is not None else default_system_prompt(mode)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": sys_text},
        {"role": "user", "content": prompt},
    ]
    turns: list[Turn] = []
    usage = Usage()
    status: Status = "ok"
    error: str | None = None
    stop: StopReason | None = None
    last_context = 0
    model_s = exec_s = 0.0
    start = clock()

    while stop is None:
        stop = _budget_stop(budgets, len(turns), clock() - start, usage, last_context)
        if stop is not None:
            break

        t0 = clock()
        try:
            try:
                action = policy.act(messages)
            finally:
                model_s += clock() - t0
        except ContextLengthError as e:
            stop, error = "context", str(e)
            break
        except PolicyError as e:
            stop, status, error = "policy_error", "policy_error", str(e)
            break
        except Exception as e:  # a policy bug must not escape the episode
            log.exception("policy raised")
            stop, status, error = "policy_error", "policy_error", f"{type(e).__name__}: {e}"
            break
        policy_s = clock() - t0

        turn = Turn(
            index=len(turns),
            kind=action.kind,
            message=action.message,
            command=action.command,
            policy_s=policy_s,
            usage=action.usage,
            finish_reason=action.finish_reason,
            retries=action.retries,
            token_ids=action.token_ids,
            logprobs=action.logprobs,
            prompt_token_ids=action.prompt_token_ids,
            tokens_from=action.tokens_from,
            outcome=reply_outcome(mode, action),
        )
        turns.append(turn)
        messages.append(action.message)
        if action.usage:
            last_context = _count_usage(usage, action.usage)

        if action.kind == "done":
            stop = "done"
            break

        if action.kind == "invalid":
            turn.observation = action.error or ""
            messages.append(_observation_message(mode, action, turn.observation))
        else:
            remaining = budgets.wall_time_s - (clock() - start)
            if remaining <= 0:
                stop = "wall_time"
                break
            asked = action.timeout if action.timeout is not None else budgets.command_timeout_s
            timeout = asked if action.uncapped_timeout else min(asked, budgets.command_timeout_s)
            timeout = max(0.1, min(timeout, remaining))
            turn.timeout_s = timeout
            t1 = clock()
            try:
                try:
                    res = shell.run(action.command or "", timeout=timeout)
                finally:
                    exec_s += clock() - t1
            except Exception as e:
                turn.exec_s = clock() - t1
                error = f"{type(e).__name__}: {e}"
                if shell_blame is not None and _blame(shell_blame, e):
                    log.info("the agent broke its shell: %s", error)
                    stop = "shell_broken"
                    turn.observation = visible(f"[the shell could not be started again: {e}]")
                    break
                log.exception("shell failed")
                stop, status = "shell_error", "shell_error"
                break
            turn.exec_s = clock() - t1
            turn.exit_code = res.exit_code
            turn.timed_out = bool(getattr(res, "timed_out", False))
            turn.shell_restarted = bool(getattr(res, "shell_restarted", False))
            observation = format_observation(
                res.output,
                res.exit_code,
                timed_out=turn.timed_out,
                timeout_s=timeout,
                limit=budgets.output_limit_chars,
            )
            # the shell's own output is shown already; any other shell's is here (one function)
            turn.escaped = int(getattr(res, "escaped", 0) or 0) + hidden_count(observation)
            turn.observation = visible(observation)
            messages.append(_observation_message(mode, action, turn.observation))
        for extra in action.extra_tool_call_ids:
            messages.append({"role": "tool", "tool_call_id": extra, "content": NOT_RUN})

    tokens = _capture_tokens(policy, turns, messages)
    return AgentResult(
        tokens=tokens,
        messages=messages,
        turns=turns,
        stop_reason=stop,
        status=status,
        error=error,
        usage=usage,
        wall_s=clock() - start,
        model_s=model_s,
        exec_s=exec_s,
        mode=mode,
        events=[*_outcome_events(turns, stop), *tokens.events],
    )
