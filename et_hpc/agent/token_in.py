"""Token-in continuation: the policy sends token ids, so the tokens trained on are the tokens sampled.

``TokenIn`` (one episode's state) builds each turn's prompt as the previous prompt, the sampled
completion ids and the template's gap ids (rendered by the server's own chat template), so a
template that re-renders the model's reply differently cannot make the prompt drift; it speaks
llama.cpp's ``llama-server`` or vLLM (``Dialect``, chosen by ``OpenAIPolicy`` from what the
server answers) and raises ``TokenInError`` when the server cannot. ``parse_hermes`` parses the
``<tool_call>`` blocks of a raw completion in tools mode. The construction, the endpoints of
each dialect and the tool-call format: docs/policy.md.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

MARK = "\u2063ET_HPC_MARK\u2063"
_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

Dialect = Literal["llama", "vllm"]
log = logging.getLogger(__name__)
_WARNED: set[str] = set()  # what a server could not give, warned once per process
# llama-server's generation_settings that decide what it samples (its defaults included)
LLAMA_SAMPLING = (
    "temperature", "dynatemp_range", "dynatemp_exponent", "top_k", "top_p", "min_p", "typical_p", "xtc_probability",
    "xtc_threshold", "repeat_last_n", "repeat_penalty", "presence_penalty", "frequency_penalty", "dry_multiplier",
    "dry_base", "dry_allowed_length", "dry_penalty_last_n", "mirostat", "mirostat_tau", "mirostat_eta", "top_n_sigma",
    "seed", "n_predict", "samplers", "ignore_eos", "min_keep", "n_probs", "post_sampling_probs",
)  # fmt: skip


_LLAMA: dict[str, bool] = {}  # server root -> it is llama-server (answers /apply-template), once per process


def speaks_llama(client: Any, root: str) -> bool:
    """``token_in: auto``: llama-server (``POST /apply-template`` answers a prompt) gets token-in. An
    error answer means another server (chat mode, remembered); no answer: chat mode, asked again later."""
    import httpx
    import openai

    if root not in _LLAMA:
        body = {"messages": [{"role": "user", "content": "x"}]}
        try:
            r = client.post(root + "/apply-template", cast_to=httpx.Response, body=body, options={"max_retries": 0})
            _LLAMA[root] = isinstance(r.json().get("prompt"), str)
        except openai.APIStatusError:
            _LLAMA[root] = False
        except (openai.APIError, ValueError, AttributeError):
            return False
    return _LLAMA[root]


def warn_once(key: str, msg: str) -> None:
    """A requested field the server does not give: one warning per process, never silence."""
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("%s", msg)


def vllm_logprobs(choice: dict[str, Any], n: int) -> list[float] | None:
    """The sampled tokens' logprobs of a ``/v1/completions`` choice (``logprobs.token_logprobs``), when
    there is one float per completion token."""
    lp = (choice.get("logprobs") or {}).get("token_logprobs")
    if not isinstance(lp, list) or len(lp) != n or not all(isinstance(x, (int, float)) for x in lp):
        return None
    return [float(x) for x in lp]


def llama_logprobs(answer: dict[str, Any], ids: list[int]) -> list[float] | None:
    """The sampled tokens' logprobs of a llama-server ``/completion`` answer (``completion_probabilities``,
    asked with ``n_probs``: ``logprob``, or ``prob`` with ``post_sampling_probs``), when each entry
    names the token sampled at its place."""
    rows = answer.get("completion_probabilities")
    if not isinstance(rows, list) or len(rows) != len(ids):
        return None
    out: list[float] = []
    for row, t in zip(rows, ids):
        if not isinstance(row, dict) or ("id" in row and row["id"] != t):
            return None
        if isinstance(row.get("logprob"), (int, float)):
            out.append(float(row["logprob"]))
        elif isinstance(row.get("prob"), (int, float)) and row["prob"] > 0:
            out.append(math.log(row["prob"]))
        else:
            return None
    return out


class TokenInError(Exception):
    """The server cannot do token-in (no render/tokenize/completion route, or a template that does not extend)."""


@dataclass
class _Fn:
    name: str
    arguments: str


@dataclass
class _Call:
    id: str
    function: _Fn


@dataclass
class ParsedReply:
    """A raw completion as a chat message (the shape ``replies.tool_action`` reads)."""

    content: str
    tool_calls: list[_Call] = field(default_factory=list)


def parse_hermes(text: str) -> ParsedReply:
    """Split a raw completion into content and ``<tool_call>`` JSON blocks (unparsable ones keep their text)."""
    calls: list[_Call] = []
    for i, m in enumerate(_TOOL_CALL_RE.finditer(text)):
        raw = m.group(1)
        name, args = "", raw
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            name = str(obj.get("name") or "")
            a = obj.get("arguments", obj.get("parameters", {}))
            args = a if isinstance(a, str) else json.dumps(a)
        calls.append(_Call(id=f"call_{i}", function=_Fn(name=name, arguments=args)))
    first = text.find("<tool_call>")
    content = text if first < 0 else text[:first]
    return ParsedReply(content=content.strip() if calls else content, tool_calls=calls)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class TokenIn:
    """The token-in state of one episode: the last prompt and completion, and how to extend them."""

    def __init__(self, post, dialect: Dialect, model: str | None, tools: list[dict] | None):
        self._post = post  # post(path, body) -> dict (a JSON answer) or raises
        self.dialect = dialect
        self.model = model
        self.tools = tools
        self.prompt: list[int] | None = None
        self.completion: list[int] | None = None
        self.n_messages = 0  # messages in the conversation when the last prompt was made
        self.finish: str | None = None  # the last completion's finish reason
        self.logprobs: list[float] | None = None  # the last completion's, aligned with its ids (when asked)
        self.sampling: dict[str, Any] | None = None  # what llama-server says it sampled with (its defaults too)

    # -- rendering ---------------------------------------------------------------------------
    def _ids(self, messages: list[dict[str, Any]], *, gen: bool, cont: bool = False, special: bool = False) -> list[int]:
        if self.dialect == "vllm":
            body: dict[str, Any] = {"model": self.model, "messages": messages, "add_generation_prompt": gen}
            if cont:
                body["continue_final_message"] = True
                body["add_generation_prompt"] = False
            if self.tools:
                body["tools"] = self.tools
            return [int(t) for t in self._post("/tokenize", body)["tokens"]]
        return self._tokenize(self._text(messages, gen=gen), special=special)

    def _text(self, messages: list[dict[str, Any]], *, gen: bool) -> str:
        body: dict[str, Any] = {"messages": messages, "add_generation_prompt": gen}
        if self.tools:
            body["tools"] = self.tools
        return str(self._post("/apply-template", body)["prompt"])

    def _tokenize(self, text: str, *, special: bool = False) -> list[int]:
        out = self._post("/tokenize", {"content": text, "add_special": special, "parse_special": True})["tokens"]
        return [int(t if isinstance(t, int) else t["id"]) for t in out]

    def closing(self, head: list[dict[str, Any]]) -> tuple[list[int], str]:
        """What the template puts after an assistant message's content (ids, and text for llama)."""
        probe = [*head, {"role": "assistant", "content": MARK}]
        if self.dialect == "vllm":
            full = self._ids(probe, gen=False)
            open_ = self._ids(probe, gen=False, cont=True)
            if full[: len(open_)] != open_:
                raise TokenInError("the chat template's rendering of a reply does not extend its open form")
            return full[len(open_) :], ""
        text = self._text(probe, gen=False)
        at = text.rfind(MARK)
        if at < 0:
            raise TokenInError("the chat template dropped the reply's content")
        return [], text[at + len(MARK) :]

    # -- prompts -----------------------------------------------------------------------------
    def next_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """The prompt for this turn: the first rendered whole; later ones the last prompt + completion + gap."""
        if self.prompt is None or self.completion is None:
            return self._ids(messages, gen=True, special=True)
        n = self.n_messages  # messages[n] is the reply to the last prompt
        upto = messages[: n + 1]
        if self.dialect == "vllm":
            a = self._ids(upto, gen=False)
            b = self._ids(messages, gen=True)
            if b[: len(a)] != a:
                raise TokenInError("the template renders the conversation differently once more messages follow")
            closing, _ = self.closing(messages[:n])
            gap = closing + b[len(a) :]
        else:
            gap = self._tokenize(self._gap_text(messages, n))
        seq = self.prompt + self.completion
        # a reply that ended with the end-of-turn token (vLLM keeps it in token_ids): do not repeat it
        k = 1 if self.finish == "stop" and self.completion and gap and self.completion[-1] == gap[0] else 0
        return seq + gap[k:]

    def _gap_text(self, messages: list[dict[str, Any]], n: int) -> str:
        """llama-server: the template's text after reply ``messages[n]`` up to the next generation prompt.

        The reply is rendered as a placeholder whose end is found in the whole rendering, followed by
        the messages after it: llama-server renders a conversation ending in an assistant message as
        a prefill to continue, and refuses one with tool calls, so the reply is never rendered last.
        """
        probe = [*messages[:n], {"role": "assistant", "content": MARK}, *messages[n + 1 :]]
        text = self._text(probe, gen=True)
        at = text.rfind(MARK)
        if at < 0:
            raise TokenInError("the chat template dropped the reply's content")
        if not text.startswith(self._text(messages[:n], gen=True)):
            raise TokenInError("the template renders the conversation differently once more messages follow")
        return text[at + len(MARK) :]

    # -- completions -------------------------------------------------------------------------
    def complete(self, prompt: list[int], params: dict[str, Any]) -> tuple[str, list[int], str | None, dict[str, int]]:
        """Sample from ``prompt``: (text, completion ids, finish reason, usage); with
        ``params["logprobs"]`` the sampled tokens' logprobs in ``self.logprobs`` (a warning when the
        server gives none), and llama-server's sampler settings in ``self.sampling``."""
        want = bool(params.get("logprobs"))
        self.logprobs = None
        if self.dialect == "vllm":
            body = {
                "model": self.model,
                "prompt": prompt,
                "max_tokens": params["max_tokens"],
                "temperature": params["temperature"],
                "top_p": params["top_p"],
                "return_token_ids": True,
                "skip_special_tokens": False,
            }
            if params.get("seed") is not None:
                body["seed"] = params["seed"]
            if want:
                body["logprobs"] = 1  # the sampled token's logprob (and one alternative) per position
            if params.get("grammar"):  # vLLM >= 0.11's structured outputs (xgrammar reads GBNF)
                body["structured_outputs"] = {"grammar": params["grammar"]}
            r = self._post("/v1/completions", body)
            ch = r["choices"][0]
            ids = ch.get("token_ids")
            if not isinstance(ids, list):
                raise TokenInError("the server's /v1/completions returned no token_ids (vLLM >= 0.10.2 needed)")
            usage = {k: int(v) for k, v in (r.get("usage") or {}).items() if isinstance(v, int)}
            self._take_logprobs(want, vllm_logprobs(ch, len(ids)), "/v1/completions gave no logprobs.token_logprobs")
            return str(ch.get("text") or ""), [int(t) for t in ids], ch.get("finish_reason"), usage
        body = {
            "prompt": prompt,
            "n_predict": params["max_tokens"],
            "temperature": params["temperature"],
            "top_p": params["top_p"],
            "return_tokens": True,
            "cache_prompt": True,
        }
        if params.get("seed") is not None:
            body["seed"] = params["seed"]
        if params.get("grammar"):
            body["grammar"] = params["grammar"]
        if want:
            body["n_probs"] = 1  # completion_probabilities: each sampled token's logprob (before sampling)
        r = self._post("/completion", body)
        ids = r.get("tokens")
        if not isinstance(ids, list):
            raise TokenInError("llama-server's /completion returned no tokens")
        gs = r.get("generation_settings")
        self.sampling = {k: gs[k] for k in LLAMA_SAMPLING if k in gs} if isinstance(gs, dict) else None
        self._take_logprobs(want, llama_logprobs(r, [int(t) for t in ids]), "/completion gave no completion_probabilities")
        stop = r.get("stop_type")
        finish = "length" if stop == "limit" else "stop"
        usage = {
            "prompt_tokens": int(r.get("tokens_evaluated") or len(prompt)),
            "completion_tokens": int(r.get("tokens_predicted") or len(ids)),
        }
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return str(r.get("content") or ""), [int(t) for t in ids], finish, usage

    def _take_logprobs(self, want: bool, got: list[float] | None, why: str) -> None:
        if want and got is None:
            warn_once(f"{self.dialect}:logprobs", f"token-in: logprobs were asked for but {why}: records will have none")
        self.logprobs = got if want else None
