"""Policies: what decides the next shell command. The protocol plus the non-model policies.

A policy turns the conversation so far into an ``Action``. ``OpenAIPolicy`` (a served model)
lives in ``openai_policy.py``; this file has ``OraclePolicy`` (runs the task's reference
solution), ``ReplayPolicy`` (replays a recorded ET run), ``NullPolicy`` (stops at once) and
``make_policy`` which builds one from a ``PolicyConfig``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from et_hpc.agent.base import (  # noqa: F401  (re-exported: the names' old home)
    Action,
    ContextLengthError,
    Policy,
    PolicyError,
    TokenCapture,
    text_action,
)
from et_hpc.agent.endpoint import CLIENT
from et_hpc.agent.wire import DONE_TEXT, Mode
from et_hpc.errors import TaskError, UserError

if TYPE_CHECKING:
    from et_hpc.tasks.model import Task


class NullPolicy:
    """Says done at once: measures the cost of an episode with no agent work."""

    mode: Mode = "text"

    def act(self, messages: list[dict[str, Any]]) -> Action:
        return text_action(DONE_TEXT)


ORACLE_TIMEOUT_S = 600.0


class OraclePolicy:
    """Runs the task's ``solution/solve.sh`` through the shell in one command, then says done."""

    mode: Mode = "text"

    def __init__(self, task: Task, timeout_s: float = ORACLE_TIMEOUT_S):
        if task.solution is None:
            raise UserError(
                f"task {task.id} has no reference solution (solution/solve.sh in {task.source}); "
                "use the replay or null policy for it, or add the script"
            )
        try:
            self.script = Path(task.solution).read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise TaskError(f"cannot read {task.solution}: {e.strerror}; check the task folder") from None
        self.timeout_s = timeout_s
        self._ran = False

    def command(self) -> str:
        delim = "ET_ORACLE_EOF"
        lines = set(self.script.splitlines())
        while delim in lines:
            delim += "_X"
        body = self.script if self.script.endswith("\n") else self.script + "\n"
        return f"bash <<'{delim}'\n{body}{delim}"

    def act(self, messages: list[dict[str, Any]]) -> Action:
        if self._ran:
            return text_action(DONE_TEXT)
        self._ran = True
        cmd = self.command()
        return Action(
            kind="command",
            command=cmd,
            timeout=self.timeout_s,
            uncapped_timeout=True,
            message={"role": "assistant", "content": f"<command>{cmd}</command>"},
        )


class RecordedRun(BaseModel):
    index: int
    success: bool | None
    reward: float | None
    n_assistant_turns: int


def _load_summary(path: Path) -> list[dict[str, Any]]:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise TaskError(f"cannot read recorded runs {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise TaskError(f"recorded runs {path} is not valid JSON ({e.msg}, line {e.lineno})") from None
    results = data.get("results") if isinstance(data, dict) else None
    if not isinstance(results, list):
        raise TaskError(f"recorded runs {path} has no 'results' list (expected a *_summary.json)")
    for i, r in enumerate(results):
        if not isinstance(r, dict) or not isinstance(r.get("messages"), list):
            raise TaskError(f"recorded runs {path}: results[{i}] has no 'messages' list")
    return results


def _assistant_contents(run: dict[str, Any]) -> list[str]:
    return [str(m.get("content") or "") for m in run["messages"] if m.get("role") == "assistant"]


def recorded_runs(path: Path) -> list[RecordedRun]:
    """Every recorded run in a ``solutions/*_summary.json`` file."""
    out = []
    for i, r in enumerate(_load_summary(path)):
        reward = r.get("reward")
        success = r.get("success")
        out.append(
            RecordedRun(
                index=i,
                success=None if success is None else bool(success),
                reward=None if reward is None else float(reward),
                n_assistant_turns=len(_assistant_contents(r)),
            )
        )
    return out


class ReplayPolicy:
    """Replays the assistant turns of one recorded run through the text protocol.

    When the recorded turns run out, it says done (so the final tests run on what was replayed).
    """

    mode: Mode = "text"

    def __init__(self, summary_json_path: Path, run_index: int = 0):
        results = _load_summary(summary_json_path)
        if not 0 <= run_index < len(results):
            raise UserError(
                f"run index {run_index} is out of range for {summary_json_path} ({len(results)} recorded runs: use 0..{len(results) - 1})"
            )
        self.path = Path(summary_json_path)
        self.run_index = run_index
        self.replies = _assistant_contents(results[run_index])
        self._pos = 0

    def act(self, messages: list[dict[str, Any]]) -> Action:
        if self._pos >= len(self.replies):
            return text_action(DONE_TEXT)
        content = self.replies[self._pos]
        self._pos += 1
        return text_action(content)


class PolicyConfig(BaseModel):
    """Everything that picks and tunes a policy (one block of the run config)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    kind: Literal["openai", "oracle", "replay", "null"] = "openai"
    """openai: a model server; oracle: the task's solution/solve.sh; replay: a recorded run; null: done at once."""
    # openai
    base_url: str | None = None
    """The server's OpenAI-compatible base URL (e.g. http://host:8000/v1)."""
    endpoint_file: Path | None = None
    """An endpoint file written by slurm/vllm.sbatch; gives base_url and model."""
    endpoint_dir: Path | None = None
    """Many servers: each server job writes <endpoint_dir>/<job id>.json (et_hpc.agent.replicas)."""
    endpoint_wait_s: float = 600.0
    """How long to wait for the endpoint file and /v1/models (seconds)."""
    failover_after: int = Field(default=CLIENT.failover_after, ge=1)
    """endpoint_dir: failed attempts in a row before another server."""
    system_prompt: str | None = None
    """The system prompt; default: Endless Terminals' prompt for the mode."""
    api_key: SecretStr | None = Field(default=None, exclude=True)
    """The key: the endpoint file's, else api_key, else $api_key_env (default OPENAI_API_KEY), else
    "EMPTY". api_key is never written (run.json, pickles for Slurm, records): see SECURITY.md."""
    api_key_env: str | None = None
    """The environment variable holding the key; default: OPENAI_API_KEY."""
    model: str | None = None
    """The served model name; default: the first model the server lists."""
    mode: Mode = "tools"
    """tools: commands as tool calls; text: commands in the reply's text."""
    constrain: bool | None = None
    """Replies constrained to the protocol (et_hpc.agent.constrain): a grammar allowing one command or the
    done reply. Default (unset): on with token_in on llama-server (the embedded server). True: also on
    vLLM (structured outputs) and in chat mode; where the server cannot enforce it, a warning says so."""
    token_in: bool | Literal["auto"] = "auto"
    """Token-in continuation (llama-server's /completion, vLLM's /v1/completions with token-id prompts):
    each prompt is the previous prompt + the sampled tokens + the tokens of what was added since.
    auto: on where the server is llama-server (it answers /apply-template), else chat mode."""
    temperature: float = CLIENT.temperature
    """Sampling temperature."""
    top_p: float = CLIENT.top_p
    """Nucleus sampling's top_p."""
    max_tokens: int | None = None
    """Completion tokens per turn; default: BudgetConfig.max_tokens_per_turn."""
    seed: int | None = None
    """Sampling seed sent with each request; sample i of a task sends seed + i (its record says which)."""
    logprobs: bool = False
    """Ask for the sampled tokens' logprobs."""
    return_token_ids: bool = True
    """Ask for exact token ids (vLLM >= 0.10.2); older servers: the /tokenize fallback (tokens_source)."""
    request_timeout_s: float = CLIENT.request_timeout_s
    """The time limit of one request (seconds)."""
    max_retries: int = CLIENT.max_retries
    """Retries of a failed request."""
    retry_budget_s: float = CLIENT.retry_budget_s
    """Time all retries of one request may take (seconds)."""
    backoff_base_s: float = CLIENT.backoff_base_s
    """The first retry's backoff, doubled per retry (seconds)."""
    backoff_max_s: float = CLIENT.backoff_max_s
    """The longest backoff between retries (seconds)."""
    # replay
    replay_index: int = 0
    """Which recorded run of the file to replay."""
    replay_file: Path | None = None
    """The recorded runs (a *_summary.json); default: the task's first recorded-runs file."""
    # oracle
    oracle_timeout_s: float = ORACLE_TIMEOUT_S
    """The time limit of the oracle's solve.sh (seconds)."""

    @model_validator(mode="after")
    def _one_source(self) -> PolicyConfig:
        if self.endpoint_dir is not None and (self.endpoint_file is not None or self.base_url):
            both = "policy.endpoint_file" if self.endpoint_file is not None else "policy.base_url"
            raise ValueError(f"policy.endpoint_dir and {both} both name the server: set only one of them")
        return self

    def __getstate__(self) -> dict[Any, Any]:
        """Pickles (submitit's job files) never carry the key: it travels by reference (api_key_env)."""
        state = super().__getstate__()
        state["__dict__"] = {**state["__dict__"], "api_key": None}
        return state

    def key_value(self) -> str | None:
        return self.api_key.get_secret_value() if self.api_key is not None else None


def make_policy(cfg: PolicyConfig, task: Task | None = None, *, max_tokens: int | None = None) -> Policy:
    """Build the configured policy for one episode of ``task``.

    ``max_tokens`` (usually ``BudgetConfig.max_tokens_per_turn``) is used when the config leaves it unset.
    """
    if cfg.kind == "null":
        return NullPolicy()
    if cfg.kind == "oracle":
        if task is None:
            raise UserError("the oracle policy needs a task (it runs the task's solution/solve.sh)")
        return OraclePolicy(task, timeout_s=cfg.oracle_timeout_s)
    if cfg.kind == "replay":
        path = cfg.replay_file
        if path is None:
            if task is None or not task.recorded_runs:
                tid = task.id if task is not None else "(none)"
                raise UserError(f"task {tid} has no recorded runs (solutions/*_summary.json); set policy.replay_file or use another policy")
            path = task.recorded_runs[0]
        return ReplayPolicy(path, cfg.replay_index)
    from et_hpc.agent.openai_policy import OpenAIPolicy

    if cfg.max_tokens is None and max_tokens is not None:
        cfg = cfg.model_copy(update={"max_tokens": max_tokens})
    return OpenAIPolicy.from_config(cfg)
