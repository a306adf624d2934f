"""The episode record: one scored agent episode, as a pydantic model and as one parquet row.

``EpisodeRecord`` is what an episode produces; ``EPISODE_SCHEMA`` is the one explicit Arrow
schema every shard of the store is written with (so shards from many hosts always concatenate).
Free-form parts (sampling params, the transcript, tool versions) are JSON strings in the row,
so a policy adding a key never changes the schema; the model keeps them as Python objects.
Optional token accounting per turn (prompt deltas, completion ids, logprobs) feeds the exports;
``prompt_deltas()`` turns a server's full per-request prompts into deltas. Columns, token ids
and their checks: docs/store.md.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone
from typing import Any, Literal, get_args

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from et_hpc.text import storable, visible_all

SCHEMA_VERSION = 6  # 4: group_id names the sampled group (et_hpc.runs.store.groups_of); 5: version_source; 6: group_size, reward_rule
SOLVED_REWARD = 1.0 - 1e-9  # Endless Terminals rewards are 0/1: an episode is solved at full reward


def solved(reward: float | None) -> bool:
    """Full reward: the one rule for "passed" (pass rates, the report, resume, trainer metrics)."""
    return reward is not None and float(reward) >= SOLVED_REWARD


# Who is to blame decides the status (SECURITY.md has the table of cases):
# - ok:           scored. Failures the agent caused through the state it left (tests that hang,
#                 a home it made unreadable, pytest dying, a shell it broke) are ok with reward 0.0
#                 and ``score_note`` saying what happened.
# - no_image:     the task has no image (its build failed); visible, and re-planned once it builds.
# - policy_error, shell_error, infra_error, score_error, timeout: outside the agent's reach
#                 (server, host, our bugs); reward None, masked and retried.
Status = Literal["ok", "policy_error", "shell_error", "infra_error", "score_error", "timeout", "no_image"]
STATUSES: tuple[str, ...] = get_args(Status)
ERROR_STATUSES: tuple[str, ...] = tuple(s for s in STATUSES if s != "ok")

# tokens_source: how the episode's token ids were obtained (token_drift says whether they agree)
#   server-exact  every turn's prompt and completion ids came with the server's answer
#                 (vLLM return_token_ids: prompt_token_ids, choices[].token_ids);
#   re-tokenized  some came from the server's /tokenize (older vLLM; llama-server after /apply-template):
#                 prompts re-rendered from the messages, completions from logprobs' ids or re-rendered too;
#   absent        no complete token ids (oracle, replay, null; a server with neither).
# token_drift: None when the concatenation of all turns' prompt deltas and completions equals the
# server's own tokenization of the final conversation; else where it differs (``check_tokens``).
TokensSource = Literal["server-exact", "re-tokenized", "absent"]

# reward_rule: binary = 1.0 when every final test passes, else 0.0 (the default everywhere);
# fraction = passed/total of the final tests (the seed Atropos environment's rule)
RewardRule = Literal["binary", "fraction"]
REWARD_RULES: tuple[str, ...] = get_args(RewardRule)
DEFAULT_REWARD_RULE: RewardRule = "binary"
# the event on every member of an Atropos env group that atropos cancelled (stored, never sent)
CANCELLED_EVENT = "collect cancelled: not sent"


def apply_reward_rule(rec: EpisodeRecord, rule: str) -> EpisodeRecord:
    """``rec`` scored under ``rule`` with ``reward_rule`` set; an error record keeps reward None."""
    upd: dict[str, Any] = {"reward_rule": rule}
    if rec.status == "ok" and rule == "fraction" and rec.total:
        upd["reward"] = (rec.passed or 0) / rec.total
    return rec.model_copy(update=upd)


TIMING_FIELDS = (
    "start_s",
    "stop_s",
    "queue_s",
    "setup_s",
    "agent_s",
    "model_s",
    "exec_s",
    "score_s",
    "teardown_s",
    "total_s",
    "warm_s",
)

_TEST_TYPE = pa.struct([("name", pa.string()), ("outcome", pa.string())])
_TIMINGS_TYPE = pa.struct([(f, pa.float64()) for f in TIMING_FIELDS])

EPISODE_SCHEMA = pa.schema(
    [
        ("schema_version", pa.int16(), False),
        ("episode_id", pa.string(), False),
        ("run_name", pa.string(), False),
        ("task_id", pa.string(), False),
        ("sample", pa.int32(), False),
        ("group_id", pa.string(), False),
        ("split", pa.string()),
        ("policy_kind", pa.string()),
        ("model", pa.string()),
        ("sampling_params", pa.string()),  # JSON object
        ("messages", pa.string()),  # JSON list of chat messages
        ("turns", pa.int32()),
        ("stop_reason", pa.string()),
        ("status", pa.string(), False),
        ("reward", pa.float64()),
        ("passed", pa.int32()),
        ("total", pa.int32()),
        ("tests", pa.list_(_TEST_TYPE)),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("prompt_token_ids", pa.list_(pa.list_(pa.int32()))),
        ("token_ids", pa.list_(pa.list_(pa.int32()))),
        ("logprobs", pa.list_(pa.list_(pa.float32()))),
        ("timings", _TIMINGS_TYPE),
        ("image_digest", pa.string()),
        ("image_path", pa.string()),
        ("host", pa.string()),
        ("slurm_job_id", pa.string()),
        ("slurm_array_task_id", pa.int32()),
        ("versions", pa.string()),  # JSON object: et-hpc, apptainer, python, ...
        ("error", pa.string()),
        ("created_at", pa.timestamp("us", tz="UTC"), False),
        # version 2
        ("score_note", pa.string()),
        ("interpreter", pa.string()),
        ("policy_version", pa.string()),
        ("policy_versions", pa.list_(pa.string())),
        ("crossed_version", pa.bool_()),
        ("tokens_source", pa.string()),
        ("token_drift", pa.string()),
        ("events", pa.list_(pa.string())),
        # version 3
        ("worker", pa.string()),
        ("peak_mem_mb", pa.float64()),
        ("peak_pids", pa.int32()),
        # kept final state and rescoring (et_hpc.runs.final_state, et_hpc.runner.rescore)
        ("final_state", pa.string()),
        ("tests_digest", pa.string()),
        ("rescored_from", pa.string()),
        ("turn_s", pa.list_(pa.list_(pa.float32()))),
        # version 5
        ("version_source", pa.string()),
        # version 6
        ("group_size", pa.int32()),
        ("reward_rule", pa.string()),
    ],
    metadata={b"et_hpc.schema_version": str(SCHEMA_VERSION).encode()},
)

_JSON_FIELDS = ("sampling_params", "messages", "versions")


TestOutcomeName = Literal["passed", "failed", "error", "skipped"]
TEST_OUTCOMES: tuple[str, ...] = get_args(TestOutcomeName)


class TestResult(BaseModel):
    """One test of the final test file: its pytest node name and outcome (what the record stores;
    scoring's ``TestOutcome`` adds the failure message)."""

    __test__ = False  # not a pytest class
    model_config = ConfigDict(extra="forbid")

    name: str
    outcome: TestOutcomeName


class Timings(BaseModel):
    """Wall-clock facts of one episode in seconds (``start_s``/``stop_s`` are Unix times).

    ``total_s`` is the episode from ``start_s`` to ``stop_s``; ``setup_s + agent_s + score_s +
    teardown_s <= total_s`` and ``model_s + exec_s <= agent_s``. ``queue_s`` lies before
    ``start_s``: from when the unit became runnable (the run's plan for the local and Slurm
    executors, the unit's enqueue time in a continuous run) to the episode's start; so does
    ``warm_s``, a warm sandbox's start done ahead.
    """

    model_config = ConfigDict(extra="forbid")

    start_s: float | None = None
    stop_s: float | None = None
    queue_s: float | None = None  # runnable, waiting for a slot/node, before start_s
    setup_s: float | None = None  # policy, node-local image copy, instance start, shell, watchdog
    agent_s: float | None = None  # the agent loop
    model_s: float | None = None  # of agent_s: waiting for the policy (model time, failed calls too)
    exec_s: float | None = None  # of agent_s: the agent's commands in the shell
    score_s: float | None = None  # final tests
    teardown_s: float | None = None  # instance stop, overlay removal
    total_s: float | None = None
    # setup_s is setup on the episode's critical path: with a warm sandbox (sandbox.warm) only its
    # hand-out; warm_s is that sandbox's start, done ahead of the episode (et_hpc.sandbox.warm)
    warm_s: float | None = None


def _now() -> datetime:
    return datetime.now(timezone.utc)


class EpisodeRecord(BaseModel):
    """One finished episode. ``reward`` is set only when ``status == "ok"``."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    episode_id: str = Field(default_factory=lambda: str(uuid.uuid4()))
    run_name: str
    task_id: str
    sample: int = Field(ge=0)
    group_id: str = ""  # defaults to task_id: one group per task per run
    split: str | None = None
    policy_kind: str | None = None  # vllm | text | oracle | replay ...
    model: str | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    messages: list[dict[str, Any]] = Field(default_factory=list)
    turns: int = 0
    stop_reason: str | None = None
    status: Status
    reward: float | None = None
    passed: int | None = None
    total: int | None = None
    tests: list[TestResult] = Field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_token_ids: list[list[int]] | None = None
    token_ids: list[list[int]] | None = None
    logprobs: list[list[float]] | None = None
    timings: Timings = Field(default_factory=Timings)
    image_digest: str | None = None
    image_path: str | None = None
    host: str | None = None
    slurm_job_id: str | None = None
    slurm_array_task_id: int | None = None
    versions: dict[str, str] = Field(default_factory=dict)
    error: str | None = None
    created_at: datetime = Field(default_factory=_now)
    # version 2
    score_note: str | None = None  # status ok, reward 0 by the agent's doing: what happened
    interpreter: str | None = None  # which interpreter ran the final tests
    policy_version: str | None = None  # the model version the episode started under
    policy_versions: list[str] | None = None  # every version its turns saw, in order
    crossed_version: bool | None = None  # True when its turns span a checkpoint switch
    tokens_source: TokensSource | None = None
    token_drift: str | None = None  # None: ids concatenate exactly; else where they differ
    events: list[str] = Field(default_factory=list)  # limits hit, shell restarts, ...
    # version 3
    worker: str | None = None  # the process that ran it: "<host>:<pid>"
    peak_mem_mb: float | None = None  # the sandbox's peak memory (PSS, RSS where unreadable, + tmpfs)
    peak_pids: int | None = None  # the sandbox's peak process count
    # sandbox.keep_final_state: "sha256:<hex>" names the kept state (<run>/final-state/<hex>.tar.gz),
    # "not kept: <why>" when it was asked for but not kept; None when it was not asked for
    final_state: str | None = None
    tests_digest: str | None = None  # rescored: "sha256:<hex>" of the final test file that scored it
    rescored_from: str | None = None  # rescored: "<source run>/<episode_id>" of the episode it regrades
    turn_s: list[list[float]] | None = None  # per turn: [seconds waiting for the model, seconds of its command]
    # version 5: where policy_version(s) came from: "response" (the server's versioned alias in each
    # answer), "endpoint" (the endpoint file around each request), "mixed", or "trainer" (version.json)
    version_source: str | None = None
    # version 6: how many members the group was sampled with (fewer stored: it is incomplete), and
    # the rule that turned the tests into ``reward`` (REWARD_RULES); None in older rows
    group_size: int | None = Field(default=None, ge=1)
    reward_rule: RewardRule | None = None

    def with_queue(self, ready_at: float | None) -> EpisodeRecord:
        """This record with ``timings.queue_s`` = its start minus ``ready_at`` (a Unix time: when
        its unit became runnable); unchanged when either is unknown or queue_s is already set."""
        t = self.timings
        if ready_at is None or t.start_s is None or t.queue_s is not None:
            return self
        return self.model_copy(update={"timings": t.model_copy(update={"queue_s": max(0.0, t.start_s - ready_at)})})

    @field_validator("created_at")
    @classmethod
    def _utc(cls, v: datetime) -> datetime:
        return v.replace(tzinfo=timezone.utc) if v.tzinfo is None else v.astimezone(timezone.utc)

    @model_validator(mode="after")
    def _check(self) -> EpisodeRecord:
        if not self.group_id:
            self.group_id = self.task_id
        if self.status == "ok" and self.reward is None:
            raise ValueError("status 'ok' needs a reward")
        if self.status != "ok" and self.reward is not None:
            raise ValueError(f"status {self.status!r} must have reward None (failures are not reward 0)")
        return self

    @property
    def succeeded(self) -> bool:
        return self.status == "ok"

    @property
    def has_tokens(self) -> bool:
        """True when the token accounting is complete enough for a trainer (docs/store.md, "Token ids").

        An episode whose ids drift from the server's tokenization (``token_drift``) has no
        sequence a trainer can use as one: exports then fall back to its messages.
        """
        return (
            self.token_ids is not None
            and self.prompt_token_ids is not None
            and len(self.token_ids) == len(self.prompt_token_ids)
            and len(self.token_ids) > 0
            and self.token_drift is None
        )

    def token_sequence(self) -> tuple[list[int], list[int], list[float] | None]:
        """The whole episode as one sequence: ``(tokens, masks, logprobs)``.

        Masks follow Atropos: ``-100`` on prompt positions (including tool output), the token id
        on completion positions. Logprobs are ``1.0`` on prompt positions (trainers ignore
        positions > 0), or ``None`` when logprobs were not recorded.
        """
        if not self.has_tokens:
            why = f"its token ids drift: {self.token_drift}" if self.token_drift else "no complete token ids"
            raise ValueError(f"episode {self.episode_id} has {why}")
        assert self.token_ids is not None and self.prompt_token_ids is not None
        with_lp = self.logprobs is not None and len(self.logprobs) == len(self.token_ids)
        tokens: list[int] = []
        masks: list[int] = []
        lps: list[float] = []
        for i, (prompt, completion) in enumerate(zip(self.prompt_token_ids, self.token_ids)):
            tokens += prompt
            masks += [-100] * len(prompt)
            tokens += completion
            masks += completion
            if with_lp:
                turn_lp = list(self.logprobs[i])  # type: ignore[index]
                if len(turn_lp) != len(completion):
                    with_lp = False
                    continue
                lps += [1.0] * len(prompt) + turn_lp
        return tokens, masks, (lps if with_lp else None)

    def to_row(self) -> dict[str, Any]:
        """A dict matching ``EPISODE_SCHEMA`` (JSON fields serialised), storable whatever its text.

        A Python string may hold what UTF-8 cannot encode: lone surrogates (an agent's command
        decoded with ``surrogateescape``, a ``\\udc80`` escape in a replayed transcript). The JSON
        fields then use ASCII escapes (lossless: reading them back gives the same strings); every
        other string has such characters replaced by their ``\\uXXXX`` text, and one event says
        which fields were escaped. The texts that quote a sandbox (``SHOWN_FIELDS``) go through
        ``et_hpc.text.visible``; an event names those it changed.
        """
        row = self.model_dump()
        shown = []
        for f in SHOWN_FIELDS:
            row[f], n = visible_all(row[f])
            if n:
                shown.append(f)
        escaped: list[str] = []
        for f in _JSON_FIELDS:
            text = json.dumps(row[f], ensure_ascii=False, separators=(",", ":"))
            if not _encodable(text):
                text = json.dumps(row[f], ensure_ascii=True, separators=(",", ":"))
                escaped.append(f)
            row[f] = text
        for k, v in row.items():
            if k not in _JSON_FIELDS:
                row[k] = _escape(v, k, escaped)
        if escaped:
            row["events"] = [*(row["events"] or []), _escaped_event(escaped)]
        if shown:
            row["events"] = [*(row["events"] or []), f"{SHOWN_EVENT} {', '.join(shown)}"]
        return row

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> EpisodeRecord:
        """Inverse of ``to_row``; accepts rows of older schema versions (missing keys take defaults)."""
        data = {k: v for k, v in row.items() if k in cls.model_fields and v is not None}
        for f in _JSON_FIELDS:
            if isinstance(data.get(f), str):
                data[f] = json.loads(data[f])
        return cls.model_validate(data)


# text fields that quote what a sandbox printed or named (agent file names, argv, mount points)
SHOWN_FIELDS = ("score_note", "events", "error", "final_state", "token_drift")
SHOWN_EVENT = "record: control characters were shown as visible escapes in"
ESCAPED_EVENT = "record: text that is not valid Unicode (lone surrogates) was stored as \\uXXXX escapes in"


def _escaped_event(fields: list[str]) -> str:
    return f"{ESCAPED_EVENT} {', '.join(sorted(set(fields)))}"


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def escape_text(s: str) -> str:
    """``s`` with every character UTF-8 cannot encode (a lone surrogate) written as ``\\uXXXX``."""
    return s if _encodable(s) else s.encode("utf-8", "backslashreplace").decode("utf-8")


def _escape(v: Any, name: str, escaped: list[str]) -> Any:
    """``v`` (a row value: str, list, dict, scalar) with its strings escaped; ``name`` goes into
    ``escaped`` when something had to be."""
    out, changed = storable(v)
    if changed:
        escaped.append(name)
    return out


def write_failed_record(rec: EpisodeRecord | dict[str, Any], cause: str) -> EpisodeRecord:
    """The error record that stands for ``rec`` (an EpisodeRecord or a dict) when its own record
    could not be written: same unit and episode id, status ``infra_error`` (outside the agent's
    reach: masked, and redone on resume), ``error`` naming the cause, an event keeping what the
    episode ended as. Only plain fields are kept, so this record stores whatever broke the other."""

    def get(key: str) -> Any:
        return rec.get(key) if isinstance(rec, dict) else getattr(rec, key, None)

    def text(v: Any, limit: int = 2000) -> str:
        return escape_text(str(v))[:limit]

    try:
        sample = max(0, int(get("sample") or 0))
    except (TypeError, ValueError):
        sample = 0
    ended = f"status {text(get('status'), 40)}, reward {text(get('reward'), 40)}"
    return EpisodeRecord(
        episode_id=text(get("episode_id") or uuid.uuid4(), 200),
        run_name=text(get("run_name") or "", 500),
        task_id=text(get("task_id") or "", 500),
        sample=sample,
        group_id=text(get("group_id") or "", 500),
        group_size=get("group_size") if isinstance(get("group_size"), int) and get("group_size") > 0 else None,
        status="infra_error",
        error=text(f"the run store could not write this episode's record: {cause}"),
        events=[f"store: the episode ended with {ended}; its record could not be written"],
        host=text(get("host") or "", 200) or None,
        worker=text(get("worker") or "", 200) or None,
    )


def records_to_table(records: list[EpisodeRecord]) -> pa.Table:
    return pa.Table.from_pylist([r.to_row() for r in records], schema=EPISODE_SCHEMA)


def records_from_table(table: pa.Table) -> list[EpisodeRecord]:
    return [EpisodeRecord.from_row(r) for r in table_rows(table)]


def table_rows(table: pa.Table) -> list[dict[str, Any]]:
    """``table.to_pylist()``, also when a string holds invalid UTF-8 (a shard another writer made):
    such a column is read as bytes and decoded with ``surrogateescape``, so the bad bytes become
    lone surrogates that ``to_row`` and the exports write as ``\\udcHH`` escapes."""
    try:
        return table.to_pylist()
    except UnicodeDecodeError:
        cols = {}
        for name in table.column_names:
            col = table.column(name)
            try:
                cols[name] = col.to_pylist()
            except UnicodeDecodeError:
                cols[name] = _decoded(col.cast(_as_binary(col.type)).to_pylist())
        return [dict(zip(cols, vals)) for vals in zip(*cols.values())] if cols else []


def _as_binary(t: pa.DataType) -> pa.DataType:
    """``t`` with every string type in it made binary (a cast that does not check UTF-8)."""
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return pa.binary()
    if pa.types.is_list(t):
        return pa.list_(_as_binary(t.value_type))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, _as_binary(f.type)) for f in t])
    return t


def _decoded(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.decode("utf-8", "surrogateescape")
    if isinstance(v, list):
        return [_decoded(x) for x in v]
    if isinstance(v, dict):
        return {k: _decoded(x) for k, x in v.items()}
    return v


def prompt_deltas(prompts: list[list[int]], completions: list[list[int]]) -> list[list[int]]:
    """Turn the full prompt of every request into the per-turn deltas ``prompt_token_ids`` holds.

    ``prompts[i]`` is the whole token list sent for completion ``i``. When it does not extend the
    sequence so far (a chat template re-rendered earlier turns differently) a ``ValueError`` is
    raised: such an episode cannot be expressed as one masked sequence.
    """
    if len(prompts) != len(completions):
        raise ValueError("one prompt per completion expected")
    seq: list[int] = []
    out: list[list[int]] = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        if p[: len(seq)] != seq:
            raise ValueError(f"prompt of turn {i} does not extend the previous turns")
        out.append(list(p[len(seq) :]))
        seq = list(p) + list(c)
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared in C
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def check_tokens(
    prompts: list[list[int]], completions: list[list[int]], final: list[int] | None = None
) -> tuple[list[list[int]], str | None]:
    """Per-turn prompt deltas, and where the sequence drifts from the server's tokenization.

    ``prompts[i]`` is the full prompt of request ``i`` as the server tokenized it,
    ``completions[i]`` the tokens it sampled, ``final`` (optional) the server's tokenization of the
    whole conversation including the last completion (``/tokenize`` with
    ``add_generation_prompt=false``): it must start with the concatenation (the template may add
    closing tokens after the last end-of-turn token). Returns ``(deltas, drift)``: ``drift`` is None
    when prompt ``i`` always extends prompt ``i-1`` + completion ``i-1`` and ``final`` extends the
    whole sequence; else it names the first turn, the token position and the lengths, and the delta
    of a drifting turn is the part of its prompt after the common prefix (so ``token_sequence()`` is
    then not the server's sequence: do not train on it as one sequence).
    """
    if len(prompts) != len(completions):
        raise ValueError("one prompt per completion expected")
    seq: list[int] = []
    out: list[list[int]] = []
    drifts: list[str] = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        k = _common_prefix(p, seq)
        if k < len(seq):
            drifts.append(
                f"turn {i}: the server's prompt ({len(p)} tokens) differs from the tokens of the earlier turns ({len(seq)}) at position {k}"
            )
        out.append(list(p[k:]))
        seq = list(p) + list(c)
    if final is not None:
        k = _common_prefix(final, seq)
        if k < len(seq):
            drifts.append(
                f"end: the server's tokenization of the conversation ({len(final)} tokens) differs "
                f"from the recorded sequence ({len(seq)}) at position {k}"
            )
    if not drifts:
        return out, None
    more = f" (+{len(drifts) - 1} more)" if len(drifts) > 1 else ""
    return out, drifts[0] + more
