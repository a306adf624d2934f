"""A policy backed by an OpenAI-compatible chat server (vLLM), with our own bounded retries.

``OpenAIPolicy.act(messages)`` returns the next ``Action`` (tools or text mode; token-in mode:
``et_hpc.agent.token_in``). Connection errors, time-outs, 429, 5xx and empty ``choices`` are
retried with jittered backoff within a retry budget, then ``PolicyError``; a 400 about the context
length raises ``ContextLengthError``. Each turn keeps usage, finish reason, logprobs, token ids and
the policy version that answered; ``capture_tokens`` turns the turns into the record's tokens.
With ``replicas`` the episode keeps one server and fails over when it is down (``events``). The
full contract (tokens, versions, replicas): docs/policy.md, "The OpenAI policy".
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx
import openai

from et_hpc.agent.base import DEFAULT_MAX_TOKENS, Action, ContextLengthError, PolicyError, TokenCapture, text_action
from et_hpc.agent.chat_tokens import LLAMA_ASK, REASON, count_drift, render_ids, with_sampled_end
from et_hpc.agent.constrain import TEXT_GRAMMAR, grammar, how, warn_once
from et_hpc.agent.endpoint import CLIENT, EndpointWatch, key_or_default, resolve_api_key
from et_hpc.agent.replies import error_text as _error_text
from et_hpc.agent.replies import malformed as _malformed
from et_hpc.agent.replies import retry_after as _retry_after
from et_hpc.agent.replies import to_action as _to_action
from et_hpc.agent.replies import tool_action as _tool_action
from et_hpc.agent.served import ENDPOINT, MAX_SWITCHES, RESPONSE, ServedVersions
from et_hpc.agent.wire import TERMINAL_TOOL, Mode

if TYPE_CHECKING:
    from et_hpc.agent.loop import Turn
    from et_hpc.agent.policies import PolicyConfig
    from et_hpc.agent.replicas import Replica, ReplicaSet
    from et_hpc.record import TokensSource

log = logging.getLogger(__name__)

_CONTEXT_RE = re.compile(
    r"context length|context_length|maximum context|context window|too many tokens|prompt is too long"
    r"|max_model_len|input is too long|context size",
    re.IGNORECASE,
)


class _Retryable(Exception):
    def __init__(self, msg: str, retry_after: float | None = None, *, dead: bool = False, known: bool = False):
        super().__init__(msg)
        self.retry_after = retry_after
        self.dead = dead  # a sign the server is down (connection, time-out, 5xx): counts towards failover
        self.known = known  # the replica is known to be dead already: fail over without trying it


def _status_error(what: str, code: int, text: str, last_500: str | None, e: openai.APIStatusError) -> _Retryable:
    """An error answer (HTTP ``code``, ``text``) as a retryable error (408, 409, 429, 5xx); raises
    ``ContextLengthError`` for a 4xx about the context length and ``PolicyError`` for any other 4xx
    or a 500 repeating ``last_500``, the previous answer to the same request."""
    if 400 <= code < 500 and code not in (408, 409, 429) and _CONTEXT_RE.search(text):
        raise ContextLengthError(f"{what}: server says the context is too long ({code}): {text}") from None
    if code == 500 and text == last_500:
        # The same answer to the same request: a validation error or a bug, not a server in
        # trouble (those say 502-504, time out or drop the connection). Retrying cannot help.
        raise PolicyError(f"{what}: server rejected the request twice with the same error (HTTP 500): {text}") from None
    if code in (408, 409, 429) or code >= 500:
        return _Retryable(f"HTTP {code}: {text}", _retry_after(e), dead=code >= 500)
    raise PolicyError(f"{what}: server rejected the request (HTTP {code}): {text}") from None


def _as_retryable(e: openai.APIError | _Retryable) -> _Retryable:
    """A failed request without an error answer: time-outs and connection errors count as a dead
    server; malformed responses and the like do not."""
    if isinstance(e, _Retryable):
        return e
    if isinstance(e, openai.APITimeoutError):
        return _Retryable("request timed out", dead=True)
    if isinstance(e, openai.APIConnectionError):
        return _Retryable(f"connection failed: {e.__cause__ or e}", dead=True)
    return _Retryable(f"bad response: {e}")


def _config_params(cls: type, cfg: PolicyConfig) -> list[str]:  # constructor parameters that are fields of cfg
    return [k for k in inspect.signature(cls).parameters if k in type(cfg).model_fields]


class OpenAIPolicy:
    """Ask a served model for the next command, in tool-call (``tools``) or ET text (``text``) mode."""

    def __init__(
        self,
        base_url: str | None,
        model: str | None = None,
        *,
        api_key: str | None = None,
        mode: Mode = "tools",
        constrain: bool | None = None,
        token_in: bool | Literal["auto"] = False,
        temperature: float = CLIENT.temperature,
        top_p: float = CLIENT.top_p,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        seed: int | None = None,
        logprobs: bool = False,
        return_token_ids: bool = True,
        request_timeout_s: float = CLIENT.request_timeout_s,
        max_retries: int = CLIENT.max_retries,
        retry_budget_s: float = CLIENT.retry_budget_s,
        backoff_base_s: float = CLIENT.backoff_base_s,
        backoff_max_s: float = CLIENT.backoff_max_s,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
        endpoint_file: Path | None = None,
        replicas: ReplicaSet | None = None,
        failover_after: int = CLIENT.failover_after,
    ):
        self.mode: Mode = mode
        self.constrain = constrain
        self.token_in = token_in
        self.model = model
        self.temperature = temperature
        self.top_p = top_p
        self.max_tokens = max_tokens
        self.seed = seed
        self.logprobs = logprobs
        self.return_token_ids = return_token_ids
        self.max_retries = max_retries
        self.retry_budget_s = retry_budget_s
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self._sleep = sleep
        self._rng = rng or random.Random()
        self.events: list[str] = []  # failovers, for the episode's record
        self.failover_after = failover_after
        self._fixed_model = model is not None
        self._replicas = replicas
        self._replica: Replica | None = None
        if replicas is not None:
            got = replicas.acquire(wait_s=retry_budget_s)
            if got is None:
                raise PolicyError(f"no live policy server in {replicas.directory} within {retry_budget_s:g} s ({replicas.describe()})")
            self._replica = got
            base_url, api_key = got.base_url, got.api_key
            self.model = model or got.model
        if not base_url:
            raise PolicyError("no policy server address")
        self._api_key = key_or_default(api_key)
        self.client = openai.OpenAI(
            base_url=base_url,
            api_key=self._api_key,
            max_retries=0,
            timeout=request_timeout_s,
        )
        root = base_url.rstrip("/")
        self.tokenize_url = (root[:-3] if root.endswith("/v1") else root) + "/tokenize"  # vLLM: at the root
        self._no_tokenize = False  # set once the server answered /tokenize with 404
        self.tokenize_requests = 0
        self.requests = 0  # HTTP requests made (including retried ones)
        self.retries = 0  # of which retries
        # Policy versions: the endpoint file's model_version before and after each turn's request
        # (they differ when the server switched checkpoints during it); None without a file.
        self._watch = EndpointWatch(endpoint_file) if endpoint_file is not None else None
        self._served = {"base_url": base_url, "api_key": self._api_key}  # what the client talks to
        self.aliases = ServedVersions()  # versioned aliases: what answered each turn
        self.start_version = self._version()
        self.turn_versions: list[tuple[str | None, str | None]] = []
        self.version_sources: list[str] = []  # per turn: "response" or "endpoint"
        self._answered_by: str | None = None  # the model a token-in completion named
        self._tin: Any = None  # token_in: the episode's TokenIn state
        self._how: str | None = None  # how replies are constrained (et_hpc.agent.constrain.how), once known
        self.constrained: list[str] = []  # per turn: "grammar", "tool_choice" or "none"

    @classmethod
    def from_config(
        cls,
        cfg: PolicyConfig,
        *,
        max_tokens: int | None = None,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
    ) -> OpenAIPolicy:
        """The policy ``cfg`` describes (each parameter named like a field takes it; ``max_tokens``:
        when ``cfg`` leaves it unset)."""
        replicas = None
        if cfg.endpoint_dir is not None:
            from et_hpc.agent.replicas import replica_set

            replicas = replica_set(cfg.endpoint_dir, api_key=cfg.key_value(), api_key_env=cfg.api_key_env)
        elif not cfg.base_url:
            from et_hpc.errors import UserError

            raise UserError("the openai policy needs policy.base_url (or an endpoint file from slurm/vllm.sbatch)")
        explicit = ("api_key", "replicas", "max_tokens", "sleep", "rng")
        same: dict[str, Any] = {k: getattr(cfg, k) for k in _config_params(cls, cfg) if k not in explicit}
        return cls(
            **same,
            api_key=resolve_api_key(cfg.key_value(), cfg.api_key_env),
            replicas=replicas,
            max_tokens=cfg.max_tokens or max_tokens or DEFAULT_MAX_TOKENS,
            sleep=sleep,
            rng=rng,
        )

    def close(self) -> None:
        """Close the HTTP connections and give the replica back (the policy is unusable afterwards)."""
        if self._replicas is not None and self._replica is not None:
            self._replicas.release(self._replica)
            self._replica = None
        self.client.close()

    def _record(self) -> dict | None:
        """The endpoint's current record (the file's, or the episode's replica's), learnt for its alias."""
        if self._replicas is not None and self._replica is not None:
            r = self._replicas.current(self._replica)
            rec: dict | None = {"model": r.model, "model_version": r.model_version, "served_model": r.served_model}
        else:
            rec = self._watch.current() if self._watch else None
        self.aliases.learn(rec)
        return rec

    def _version(self) -> str | None:
        v = (self._record() or {}).get("model_version")
        return None if v is None else str(v)

    def _stamp(self, before: str | None, answered_by: object) -> None:
        """The turn's version: what its response names, else the endpoint's around the request."""
        label = self.aliases.label(answered_by, self._record)
        if label is None:
            self.turn_versions.append((before, self._version()))
            self.version_sources.append(ENDPOINT)
        else:
            self.turn_versions.append((label, label))
            self.version_sources.append(RESPONSE)

    def _inflight(self) -> contextlib.AbstractContextManager:
        if self._replicas is not None and self._replica is not None:
            return self._replicas.inflight(self._replica)
        return contextlib.nullcontext()

    def _fail_over(self, why: str) -> bool:
        """Mark the episode's replica dead and move to another live one (False: none within the budget)."""
        assert self._replicas is not None and self._replica is not None
        old, was = self._replica, self._replica.label()  # the same replica may come back at a new address
        self._replicas.mark_dead(old, why)
        new = self._replicas.acquire(wait_s=self.retry_budget_s)
        self._replicas.release(old)
        self._replica = new
        self.events.append(f"failover: {was} -> {new.label() if new else 'none'}: {why}")
        if new is None:
            return False
        if not self._fixed_model and new.model:
            self.model = new.model
        return True  # the next attempt re-points the client (_follow_endpoint)

    def __enter__(self) -> OpenAIPolicy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- retries -----------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` (one request), retried with backoff within the retry budget, failed over to
        another replica when the episode's is down, re-sent at once when the weights switched under
        the alias; ``PolicyError`` (or ``ContextLengthError``) when it cannot succeed."""
        start = time.monotonic()
        attempt = fails = moves = switches = 0
        last_500: str | None = None
        while True:
            self.requests += 1
            try:
                with self._inflight():
                    return fn()
            except openai.APIStatusError as e:
                text = _error_text(e)
                code = e.status_code
                new = self.aliases.switched(code, text, self._record) if switches < MAX_SWITCHES else None
                if new is not None:  # the weights switched under the alias sent: the same request, at once
                    switches += 1
                    self.events.append(f"version switch: {self.aliases.sent} -> {new} (HTTP {code}: {text})")
                    continue
                err = _status_error(what, code, text, last_500, e)
                last_500 = text if code == 500 else None
            except (openai.APIError, _Retryable) as e:  # APIStatusError is caught above
                err = _as_retryable(e)
            if self._replicas is not None and err.dead:
                fails += 1
                if err.known or fails >= self.failover_after:
                    moves += 1
                    if moves > max(self.max_retries, 1) or not self._fail_over(str(err)):
                        raise PolicyError(
                            f"{what}: no live policy server within {self.retry_budget_s:g} s after {moves} failovers; last error: {err}"
                        ) from None
                    attempt = fails = 0  # the same request, at once, on the next server
                    start = time.monotonic()
                    continue
            attempt += 1
            self._back_off(what, err, attempt, time.monotonic() - start)

    def _back_off(self, what: str, err: _Retryable, attempt: int, elapsed: float) -> None:
        """Sleep before retry ``attempt`` (jittered exponential, at least the server's Retry-After
        within bounds); ``PolicyError`` when the retries or the retry budget are used up."""
        if attempt > self.max_retries or elapsed >= self.retry_budget_s:
            raise PolicyError(f"{what}: gave up after {attempt} attempts in {elapsed:.1f} s; last error: {err}") from None
        delay = min(self.backoff_max_s, self.backoff_base_s * 2 ** (attempt - 1))
        delay *= self._rng.uniform(0.5, 1.0)
        if err.retry_after is not None:
            delay = max(delay, min(err.retry_after, self.backoff_max_s))
        delay = max(0.0, min(delay, self.retry_budget_s - elapsed))
        log.warning("%s: %s; retry %d/%d in %.2f s", what, err, attempt, self.max_retries, delay)
        self.retries += 1
        self._sleep(delay)

    def _resolve_model(self) -> str:
        if self.model is None:

            def first() -> str:
                self._follow_endpoint()
                data = list(self.client.models.list().data)
                if not data:
                    raise _Retryable("the server lists no models")
                return data[0].id

            self.model = self._call("listing models", first)
        return self.model

    # -- one turn ----------------------------------------------------------------------------
    def act(self, messages: list[dict[str, Any]]) -> Action:
        if self.token_in == "auto":  # token-in where the server is llama-server (et_hpc.agent.token_in.speaks_llama)
            from et_hpc.agent.token_in import speaks_llama

            self.token_in = speaks_llama(self.client, self._root())
        if self.token_in:
            return self._act_token_in(messages)
        model = self._resolve_model()
        kwargs: dict[str, Any] = dict(
            model=model,
            messages=messages,
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens=self.max_tokens,
        )
        if self.seed is not None:
            kwargs["seed"] = self.seed
        extra: dict[str, Any] = {}
        constrained = self._constraint(None)
        if self.mode == "tools":
            kwargs["tools"] = [TERMINAL_TOOL]
            kwargs["tool_choice"] = "required" if self.constrain else "auto"
        elif constrained == "grammar":  # llama.cpp's field (llama-server, llama-cpp-python) and vLLM's
            extra["grammar"] = TEXT_GRAMMAR
            extra["structured_outputs"] = {"grammar": TEXT_GRAMMAR}
        if self.logprobs:
            kwargs["logprobs"] = True
            extra["return_tokens_as_token_ids"] = True  # ids for the completion on servers without token_ids
        if self.return_token_ids:
            extra.update(return_token_ids=True, **LLAMA_ASK)
        if extra:
            kwargs["extra_body"] = extra

        def create() -> Any:
            self._follow_endpoint()
            kwargs["model"] = self.aliases.request_name(model)
            resp = self.client.chat.completions.create(**kwargs)
            if not getattr(resp, "choices", None):
                raise _Retryable("the server returned no choices")
            why = _malformed(resp)
            if why:
                raise _Retryable(f"malformed response: {why}")
            return resp

        retries_before = self.retries
        before = self._version()
        resp = self._call("chat completion", create)
        self._stamp(before, getattr(resp, "model", None))
        action = _to_action(resp, self.mode, self.return_token_ids)
        action.retries = self.retries - retries_before
        self.constrained.append(constrained)
        if self.return_token_ids:
            self._fill_tokens(action, resp, messages)
        return action

    # -- token-in continuation (et_hpc.agent.token_in) ---------------------------------------
    def _root(self) -> str:
        root = str(self.client.base_url).rstrip("/")
        return root[:-3] if root.endswith("/v1") else root

    def _post_json(self, path: str, body: dict[str, Any]) -> Any:
        def post() -> Any:
            self._follow_endpoint()
            if "model" in body:
                body["model"] = self.aliases.request_name(body["model"])
            r = self.client.post(self._root() + path, cast_to=httpx.Response, body=body, options={"max_retries": 0})
            try:
                data = r.json()
            except ValueError:
                raise _Retryable(f"{path}: the answer is not JSON") from None
            if path.endswith("/completions") or path == "/completion":
                self._answered_by = data.get("model") if isinstance(data, dict) else None
            return data

        return self._call(f"POST {path}", post)

    @property
    def server_sampling(self) -> dict[str, Any] | None:
        """What the server said it sampled with, its defaults included (llama-server's token-in answers); None: unknown."""
        return getattr(self._tin, "sampling", None)

    def _probe_dialect(self) -> str:
        """llama-server answers /apply-template; vLLM (and the scripted server) do not."""
        try:
            self._post_json("/apply-template", {"messages": [{"role": "user", "content": "x"}]})
            return "llama"
        except PolicyError:
            return "vllm"

    def _act_token_in(self, messages: list[dict[str, Any]]) -> Action:
        from et_hpc.agent.token_in import TokenIn, TokenInError, parse_hermes

        model = self._resolve_model()
        if self._tin is None:
            tools = [TERMINAL_TOOL] if self.mode == "tools" else None
            self._tin = TokenIn(self._post_json, self._probe_dialect(), model, tools)  # type: ignore[arg-type]
        tin = self._tin
        params: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed}
        params["logprobs"] = self.logprobs
        constrained = self._constraint(tin.dialect)
        if constrained == "grammar":
            params["grammar"] = grammar(self.mode)
        retries_before = self.retries
        before = self._version()
        self._answered_by = None
        try:
            prompt = tin.next_prompt(messages)
            text, ids, finish, usage = tin.complete(prompt, params)
        except TokenInError as e:
            raise PolicyError(f"token-in: {e}") from None
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise PolicyError(f"token-in: unusable answer from the server: {type(e).__name__}: {e}") from None
        self._stamp(before, self._answered_by)
        self.constrained.append(constrained)
        tin.prompt, tin.completion, tin.finish, tin.n_messages = prompt, ids, finish, len(messages)
        action = text_action(text) if self.mode == "text" else _tool_action(parse_hermes(text))
        action.usage = usage
        action.finish_reason = finish
        action.retries = self.retries - retries_before
        action.prompt_token_ids, action.token_ids, action.tokens_from = prompt, ids, "server"
        action.logprobs = tin.logprobs
        return action

    def _constraint(self, dialect: str | None) -> str:
        """How this episode's replies are constrained (decided once; a probe of the server only when
        a chat-mode constraint was asked for); a server that cannot enforce it is warned about once."""
        if self._how is None:
            if dialect is None and self.constrain and not self.token_in:
                dialect = self._probe_dialect()
            self._how, warning = how(self.constrain, self.mode, self.token_in is True, dialect)
            warn_once(str(self.client.base_url), warning)
        return self._how

    def _follow_endpoint(self) -> None:
        """A server republished elsewhere or with a new key (a restarted job): talk to that one."""
        if self._replicas is not None and self._replica is not None:
            r = self._replicas.current(self._replica)
            if not self._replicas.usable(r):
                raise _Retryable(f"found dead ({r.why})" if r.state == "dead" else r.why or r.state, dead=True, known=True)
            rec: dict | None = {"base_url": r.base_url, "api_key": r.api_key}
            self.aliases.learn({"model": r.model, "model_version": r.model_version, "served_model": r.served_model})
        else:
            rec = self._record()
        if rec is None:
            return
        old, self._served = self._served, rec
        if rec.get("base_url") != old.get("base_url") or rec.get("api_key") not in (None, old.get("api_key")):
            log.info("policy server moved to %s; following it", rec.get("base_url"))
            self._api_key = rec.get("api_key") or self._api_key
            self.client = self.client.with_options(base_url=rec["base_url"], api_key=self._api_key)
            root = str(rec["base_url"]).rstrip("/")
            self.tokenize_url = (root[:-3] if root.endswith("/v1") else root) + "/tokenize"

    # -- tokens ------------------------------------------------------------------------------
    def _fill_tokens(self, action: Action, resp: Any, messages: list[dict[str, Any]]) -> None:
        prompt = getattr(resp, "prompt_token_ids", None)
        completion = getattr(resp.choices[0], "token_ids", None)
        if isinstance(prompt, list) and isinstance(completion, list):
            action.prompt_token_ids = [int(t) for t in prompt]
            action.token_ids = [int(t) for t in completion]
            action.tokens_from = "server"
            return
        # An older server: re-tokenize what it was sent (and, without logprob ids, what it said).
        tools = [TERMINAL_TOOL] if self.mode == "tools" else None
        action.prompt_token_ids = self.tokenize(messages, tools, add_generation_prompt=True)
        if action.prompt_token_ids is None:
            return
        action.tokens_from = "tokenize"
        if action.token_ids is None:  # the reply re-rendered open-ended: no template tokens after it
            full = self.tokenize([*messages, action.message], tools, continue_final_message=True)
            n = len(action.prompt_token_ids)
            if full is not None and full[:n] == action.prompt_token_ids:
                action.token_ids = full[n:]

    def tokenize(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict] | None = None,
        *,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
    ) -> list[int] | None:
        """The server's tokenization of a conversation (vLLM ``POST /tokenize``); None if unavailable."""
        if self._llama_render:
            return render_ids(self.client, self.tokenize_url, messages, tools, add_generation_prompt)
        if self._no_tokenize:
            return None
        body: dict[str, Any] = {"model": self.model, "messages": messages, "add_generation_prompt": add_generation_prompt}
        if continue_final_message:
            body["continue_final_message"] = True
        if tools:
            body["tools"] = tools
        for _ in range(2):  # the client's pooled connection and auth; an absolute URL (vLLM: at the root)
            self.tokenize_requests += 1
            try:
                r = self.client.post(self.tokenize_url, cast_to=httpx.Response, body=body, options={"max_retries": 0})
            except openai.APIStatusError as e:
                if e.status_code in (404, 405):
                    log.warning("%s: not served (HTTP %d); token ids will be absent", self.tokenize_url, e.status_code)
                    self._no_tokenize = True
                    return None
                if e.status_code >= 500 or e.status_code == 429:
                    continue
                log.warning("tokenize: HTTP %d: %s", e.status_code, _error_text(e))
                return None
            except openai.APIError as e:  # connection trouble, time-outs
                log.warning("tokenize: %s", e)
                continue
            try:
                tokens = r.json()["tokens"]
            except (ValueError, KeyError, TypeError):
                tokens = None
            if not isinstance(tokens, list) or not tokens:  # llama-server: [] for a body without "content"
                if isinstance(tokens, list):  # llama-server: text only; render with its template (chat_tokens)
                    self._llama_render = True
                    return render_ids(self.client, self.tokenize_url, messages, tools, add_generation_prompt)
                log.warning("tokenize: unusable answer from %s", self.tokenize_url)
                return None
            return [int(t) for t in tokens]
        return None

    def capture_tokens(self, turns: list[Turn], messages: list[dict[str, Any]]) -> TokenCapture:
        """The episode's token record: per-turn deltas, source and drift (see ``record.check_tokens``)."""
        from et_hpc.record import check_tokens

        completions = [t.token_ids for t in turns]
        full_lps = [t.logprobs for t in turns if t.logprobs is not None and len(t.logprobs) == len(t.token_ids or ())]
        logprobs = full_lps if len(full_lps) == len(turns) else None
        if not self.return_token_ids:
            return TokenCapture(logprobs=logprobs)
        prompts = [t.prompt_token_ids for t in turns if t.prompt_token_ids is not None]
        known = [c for c in completions if c is not None]
        if len(prompts) < len(turns) or len(known) < len(turns):
            missing = next(i for i, t in enumerate(turns) if t.prompt_token_ids is None or t.token_ids is None)
            return TokenCapture(
                token_ids=known if len(known) == len(turns) else None,
                logprobs=logprobs,
                token_drift=f"turn {missing}: no token ids (the server returned no prompt_token_ids/token_ids "
                "and its /tokenize was not usable)",
            )
        last = max(i for i, m in enumerate(messages) if m.get("role") == "assistant")
        tools = [TERMINAL_TOOL] if self.mode == "tools" else None
        # token-in: each prompt was built from the last one's ids, so the sequence is the server's by
        # construction; a re-render of the conversation would only show how the template differs
        final = None if self.token_in is True else self.tokenize(messages[: last + 1], tools, add_generation_prompt=False)
        final = with_sampled_end(final, turns[-1]) if self._llama_render else final
        deltas, drift = check_tokens(prompts, known, final)
        if final is None:
            log.info("no /tokenize: the last completion is checked only through the turns before it")
        source: TokensSource = "server-exact" if all(t.tokens_from == "server" for t in turns) else "re-tokenized"
        why = [REASON] if self._llama_render and source == "re-tokenized" else []
        drift = drift or (count_drift(turns) if why else None)
        return TokenCapture(
            prompt_token_ids=deltas, token_ids=known, logprobs=logprobs, tokens_source=source, token_drift=drift, events=why
        )

    _llama_render = False  # llama-server: conversations are rendered by /apply-template, then tokenized
