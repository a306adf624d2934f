"""Exports of a run into the formats trainers read: Atropos JSONL, SkyRL/verl parquet.

Exported: the ``ok`` episodes of the groups ``RunStore.select`` keeps (``on_error`` masks a group
with an error member, or keeps its ok members; ``drop_zero_variance``). Guarantees: error
episodes are never exported; no export holds an empty or drifted token list (such a group is
left out whole, ``dropped_no_tokens``); every Atropos line validates against atroposlib's
``ScoredDataGroup`` (``validate_atropos_group``); ``generator_output`` reads a SkyRL file back as
a complete ``GeneratorOutput``. Lone surrogates are written as ``\\udcHH`` (``escaped_episodes``);
a group with an episode that cannot be read or exported is skipped (``skipped_episodes``), never
the run. Every export returns an ``ExportResult`` with the counts. Keys, columns and the upstream
versions they follow: docs/exports.md; groups: docs/store.md.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel

from et_hpc.errors import UserError
from et_hpc.record import EpisodeRecord, table_rows
from et_hpc.runs.store import GROUP_ID_SCHEMA, Group, GroupCounts, RunStore
from et_hpc.text import storable
from et_hpc.util import atomic_open, atomic_write_bytes, progress_bar

log = logging.getLogger(__name__)

# The keys of atroposlib.envs.base.ScoredDataGroup (0.4.0), all present in every exported group.
ATROPOS_KEYS = (
    "tokens",
    "masks",
    "scores",
    "advantages",
    "ref_logprobs",
    "messages",
    "generation_params",
    "inference_logprobs",
    "group_overrides",
    "overrides",
    "images",
    "distill_token_ids",
    "distill_logprobs",
)
_ATROPOS_ROLES = ("system", "user", "assistant", "tool")

_MSG_TYPE = pa.struct([("role", pa.string()), ("content", pa.string())])
SKYRL_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(_MSG_TYPE)),
        ("messages", pa.list_(_MSG_TYPE)),
        ("env_class", pa.string()),
        ("ability", pa.string()),
        ("reward", pa.float64()),
        ("reward_spec", pa.struct([("method", pa.string()), ("ground_truth", pa.string())])),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        (
            "extra_info",
            pa.struct(
                [
                    ("task_id", pa.string()),
                    ("sample", pa.int32()),
                    ("group_id", pa.string()),
                    ("episode_id", pa.string()),
                    ("run_name", pa.string()),
                    ("split", pa.string()),
                    ("turns", pa.int32()),
                    ("stop_reason", pa.string()),
                    ("passed", pa.int32()),
                    ("total", pa.int32()),
                    ("model", pa.string()),
                    ("policy_kind", pa.string()),
                    ("policy_version", pa.string()),
                    ("reward_rule", pa.string()),
                ]
            ),
        ),
        # SkyRL GeneratorOutput fields (one batch index per row)
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("response_ids", pa.list_(pa.int32())),
        ("loss_masks", pa.list_(pa.int8())),
        ("rollout_logprobs", pa.list_(pa.float32())),
        ("rewards", pa.float64()),
        ("trajectory_ids", pa.struct([("instance_id", pa.string()), ("repetition_id", pa.int32())])),
        ("stop_reasons", pa.string()),
    ]
)
GENERATOR_OUTPUT_COLUMNS = (
    "prompt_token_ids",
    "response_ids",
    "rewards",
    "loss_masks",
    "stop_reasons",
    "rollout_logprobs",
    "trajectory_ids",
)


class ExportResult(BaseModel):
    """What an export wrote and what it left out (group counts from ``RunStore.select``)."""

    path: str
    format: str
    on_error: str
    drop_zero_variance: bool
    episodes: int  # ok episodes written
    groups: int  # groups written
    with_tokens: int = 0  # Atropos: groups with tokens/masks; SkyRL: rows with token columns
    rows: int = 0  # lines (Atropos) or rows (SkyRL) written
    counts: GroupCounts  # total/complete/masked/zero_variance and what was dropped
    escaped_episodes: int = 0  # episodes written with text escaped (lone surrogates as \udcHH)
    skipped_episodes: int = 0  # episodes of skipped groups: a member could not be read or exported
    skipped: list[str] = []  # "<episode>: <why>", the first few

    def line(self) -> str:
        c = self.counts
        what = "groups" if self.format == "atropos" else "episodes"
        n = self.groups if self.format == "atropos" else self.rows
        kept_err = f", {c.dropped_error_episodes} error episodes left out of kept groups" if c.dropped_error_episodes else ""
        if self.escaped_episodes:
            kept_err += f"; {self.escaped_episodes} episodes with text escaped"
        if self.skipped_episodes:
            kept_err += f"; {self.skipped_episodes} episodes skipped (could not be exported: {'; '.join(self.skipped[:1])})"
        return (
            f"wrote {n} {what} ({self.episodes} ok episodes in {self.groups} groups, {self.with_tokens} "
            f"{'groups' if self.format == 'atropos' else 'rows'} with tokens) to {self.path}; of {c.total} groups "
            f"({c.complete} complete, {c.masked} with an error member, {c.zero_variance} zero-variance): "
            f"dropped {c.dropped_masked} masked ({self.on_error}), {c.dropped_zero_variance} zero-variance, "
            f"{c.dropped_no_tokens} without exact token ids, {c.dropped_incomplete} incomplete"
            + (f", {c.dropped_cancelled} cancelled by atropos" if c.dropped_cancelled else "")
            + f"{kept_err}; reward rule {'/'.join(c.reward_rules) or 'unrecorded'}"
        )


def selected_groups(
    run: RunStore,
    on_error: str = "mask",
    drop_zero_variance: bool = False,
    progress: bool = False,
    require_tokens: bool = True,
    exclude_cancelled: bool = False,
) -> tuple[list[list[EpisodeRecord]], GroupCounts]:
    """The selected groups as lists of ``EpisodeRecord`` (sample order), and the counts.

    With ``require_tokens`` (what the exports do) a group with a member without exact token ids
    (absent, or drifting from the server's tokenization) is left out and counted in
    ``counts.dropped_no_tokens``.
    """
    groups, counts, _ = _selected(run, on_error, drop_zero_variance, progress, require_tokens, exclude_cancelled)
    return [recs for _, recs in groups], counts


@dataclass
class _Skips:
    """Episodes left out because they could not be read or exported: how many, and why (the first few)."""

    episodes: int = 0
    why: list[str] = field(default_factory=list)

    def add(self, n: int, why: str) -> None:
        self.episodes += n
        if len(self.why) < 5:
            self.why.append(storable(why[:300])[0])
        log.warning("export: skipped %d episodes: %s", n, why[:300])


def _record(row: dict[str, Any]) -> EpisodeRecord | str:
    try:
        return EpisodeRecord.from_row(row)
    except Exception as e:  # noqa: BLE001 - one unreadable row is one episode skipped
        return f"{row.get('episode_id')}: {type(e).__name__}: {e}"


def _selected(
    run: RunStore, on_error: str, drop_zero_variance: bool, progress: bool, require_tokens: bool, exclude_cancelled: bool = False
) -> tuple[list[tuple[Group, list[EpisodeRecord]]], GroupCounts, _Skips]:
    table, groups, counts = run.select(on_error, drop_zero_variance, require_tokens=require_tokens, exclude_cancelled=exclude_cancelled)
    rows = table_rows(table)
    recs = [_record(r) for r in progress_bar(rows, desc="load", unit="ep", show=None if progress else False)]
    out = []
    skips = _Skips()
    for g in groups:
        got = [recs[i] for i in g.rows]
        bad = [r for r in got if isinstance(r, str)]
        if bad:
            skips.add(len(got), bad[0])
            counts.selected -= 1
            counts.episodes -= len(got)
            continue
        members = [r for r in got if isinstance(r, EpisodeRecord)]  # select() left out what untrainable refuses
        out.append((g, members))
    return out, counts, skips


def atropos_message(m: dict[str, Any]) -> dict[str, Any]:
    """A chat message as an Atropos ``Message`` (role, string content, reward), tool fields kept."""
    content = m.get("content")
    if content is None:
        content = ""
    elif not isinstance(content, (str, list)):
        content = json.dumps(content, ensure_ascii=False)
    out: dict[str, Any] = {
        "role": m.get("role") if m.get("role") in _ATROPOS_ROLES else "user",
        "content": content,
        "reward": m.get("reward"),
    }
    for k in ("tool_calls", "tool_call_id", "name"):
        if m.get(k) is not None:
            out[k] = m[k]
    return out


def atropos_group(records: list[EpisodeRecord]) -> dict[str, Any]:
    """One Atropos ``ScoredDataGroup`` (a JSON-ready dict, every key present) from ok episodes
    with exact token ids (``ValueError`` otherwise: a group is never sent without its tokens)."""
    if not records or any(r.status != "ok" or r.reward is None for r in records):
        raise ValueError("an Atropos group holds ok episodes only")
    missing = [r for r in records if not r.has_tokens]
    if missing:
        raise ValueError(
            f"{len(missing)} of {len(records)} episodes have no exact token ids "
            f"({missing[0].token_drift or missing[0].tokens_source or 'absent'})"
        )
    n = len(records)
    group: dict[str, Any] = dict.fromkeys(ATROPOS_KEYS)
    seqs = [r.token_sequence() for r in records]
    group["tokens"] = [s[0] for s in seqs]
    group["masks"] = [s[1] for s in seqs]
    if all(s[2] is not None for s in seqs):
        group["inference_logprobs"] = [s[2] for s in seqs]
    group["scores"] = [float(r.reward) for r in records]  # type: ignore[arg-type]
    group["messages"] = [[atropos_message(m) for m in r.messages] for r in records]
    group["group_overrides"] = {"group_size": n}
    group["generation_params"] = records[0].sampling_params or None
    r0 = records[0]
    group["et_hpc"] = {
        "run_name": r0.run_name,
        "group_id": r0.group_id,
        "task_id": r0.task_id,
        "policy_version": r0.policy_version,
        "samples": [r.sample for r in records],
        "episode_ids": [r.episode_id for r in records],
    }
    return group


def validate_atropos_group(group: dict[str, Any]) -> None:
    """Check ``group`` against atroposlib's own types; raises ``ValueError`` saying what is wrong.

    Checks the ``ScoredDataGroup`` TypedDict (pydantic validation of atroposlib's definition) and
    the API server's ``ScoredData`` model (what ``POST /scored_data`` accepts), then the lengths
    Atropos assumes: one token list, mask list and score per sample; masks as long as tokens;
    logprobs (when present) as long as tokens; masks are ``-100`` or equal to the token.
    """
    from atroposlib.api.server import ScoredData
    from atroposlib.envs.base import ScoredDataGroup
    from pydantic import TypeAdapter, ValidationError

    try:
        TypeAdapter(ScoredDataGroup).validate_python({k: v for k, v in group.items() if k in ATROPOS_KEYS})
        ScoredData.model_validate(group)
    except ValidationError as e:
        raise ValueError(f"not an Atropos ScoredDataGroup: {e}") from None
    n = len(group["tokens"])
    if any(not toks for toks in group["tokens"]):
        raise ValueError("a sample has an empty token list")
    if not (len(group["masks"]) == len(group["scores"]) == n):
        raise ValueError(f"tokens/masks/scores lengths differ: {n}, {len(group['masks'])}, {len(group['scores'])}")
    size = (group.get("group_overrides") or {}).get("group_size", n)
    if size != n:
        raise ValueError(f"group_overrides.group_size {size} but {n} samples")
    for i, (toks, masks) in enumerate(zip(group["tokens"], group["masks"])):
        if len(toks) != len(masks):
            raise ValueError(f"sample {i}: {len(toks)} tokens but {len(masks)} masks")
        bad = [j for j, (t, m) in enumerate(zip(toks, masks)) if m != -100 and m != t]
        if bad:
            raise ValueError(f"sample {i}: mask at position {bad[0]} is neither -100 nor the token")
    lps = group.get("inference_logprobs")
    if lps is not None and (len(lps) != n or any(len(lp) != len(t) for lp, t in zip(lps, group["tokens"]))):
        raise ValueError("inference_logprobs are not aligned with tokens")


def iter_atropos_groups(groups: list[list[EpisodeRecord]], stats: dict[str, int] | None = None) -> Iterator[dict[str, Any]]:
    for recs in groups:
        group = atropos_group(recs)
        if stats is not None:
            stats["with_tokens"] = stats.get("with_tokens", 0) + bool(group["tokens"] and group["tokens"][0])
        yield group


def export_atropos(
    run: RunStore,
    out: Path | str,
    *,
    on_error: str = "mask",
    drop_zero_variance: bool = True,
    progress: bool = False,
    exclude_cancelled: bool = False,
) -> ExportResult:
    """Write the selected groups as Atropos ScoredDataGroup JSONL (atomically); returns the counts
    (``counts.reward_rules``: the rule the rewards follow). ``exclude_cancelled`` leaves out the
    Atropos env's groups that atropos cancelled."""
    out = _check_out(out)
    found, counts, skips = _selected(run, on_error, drop_zero_variance, progress, True, exclude_cancelled)
    stats: dict[str, int] = {}
    lines = escaped = 0
    with atomic_open(out) as f:  # streamed: a 10k-episode export is hundreds of MB of JSON
        for g, recs in progress_bar(found, desc="atropos", unit="group", show=None if progress else False):
            try:
                group, esc = storable(atropos_group(recs))
                line = json.dumps(group, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n"
            except (ValueError, TypeError, UnicodeError) as e:
                skips.add(len(recs), f"group {g.group_id}: {type(e).__name__}: {e}")
                continue
            f.write(line)
            lines += 1
            escaped += len(recs) if esc else 0
            stats["with_tokens"] = stats.get("with_tokens", 0) + bool(group["tokens"] and group["tokens"][0])
    return ExportResult(
        path=str(out),
        format="atropos",
        on_error=on_error,
        drop_zero_variance=drop_zero_variance,
        episodes=counts.episodes - skips.episodes,
        groups=lines,
        with_tokens=stats.get("with_tokens", 0),
        rows=lines,
        counts=counts,
        escaped_episodes=escaped,
        skipped_episodes=skips.episodes,
        skipped=skips.why,
    )


def _msg(m: dict[str, Any]) -> dict[str, str | None]:
    content = m.get("content")
    if content is not None and not isinstance(content, str):
        content = json.dumps(content, ensure_ascii=False)
    return {"role": str(m.get("role", "")), "content": content}


def skyrl_tokens(r: EpisodeRecord) -> dict[str, Any]:
    """The GeneratorOutput token fields of one episode (all None without token ids)."""
    none = {"prompt_token_ids": None, "response_ids": None, "loss_masks": None, "rollout_logprobs": None}
    if not r.has_tokens:
        return none
    assert r.prompt_token_ids is not None and r.token_ids is not None
    lps = r.logprobs if r.logprobs is not None and len(r.logprobs) == len(r.token_ids) else None
    response: list[int] = []
    masks: list[int] = []
    rollout_lps: list[float] | None = [] if lps is not None else None
    for i, completion in enumerate(r.token_ids):
        obs = r.prompt_token_ids[i + 1] if i + 1 < len(r.prompt_token_ids) else []
        response += completion + obs
        masks += [1] * len(completion) + [0] * len(obs)
        if rollout_lps is not None:
            if len(lps[i]) != len(completion):  # type: ignore[index]
                rollout_lps = None
            else:
                rollout_lps += list(lps[i]) + [0.0] * len(obs)  # type: ignore[index]
    return {"prompt_token_ids": list(r.prompt_token_ids[0]), "response_ids": response, "loss_masks": masks, "rollout_logprobs": rollout_lps}


def instance_id(r: EpisodeRecord, group: Group | None = None) -> str:
    """SkyRL's ``TrajectoryID.instance_id`` of an episode: its group within the run (the
    ``group_id``; a legacy group without one: ``task_id[@policy_version]``)."""
    if group is not None and group.group_id:
        return group.group_id
    if group is None and r.schema_version >= GROUP_ID_SCHEMA:
        return r.group_id
    return f"{r.task_id}@{r.policy_version}" if r.policy_version else r.task_id


def skyrl_row(r: EpisodeRecord, group: Group | None = None) -> dict[str, Any]:
    msgs = [_msg(m) for m in r.messages]
    first_assistant = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs))
    row = {
        "data_source": "endless",
        "prompt": msgs[:first_assistant],
        "messages": msgs,
        "env_class": "endless",
        "ability": "terminal",
        "reward": r.reward,
        "reward_spec": {"method": "rule", "ground_truth": r.task_id},
        "reward_model": {"style": "rule", "ground_truth": r.task_id},
        "extra_info": {
            "task_id": r.task_id,
            "sample": r.sample,
            "group_id": r.group_id,
            "episode_id": r.episode_id,
            "run_name": r.run_name,
            "split": r.split,
            "turns": r.turns,
            "stop_reason": r.stop_reason,
            "passed": r.passed,
            "total": r.total,
            "model": r.model,
            "policy_kind": r.policy_kind,
            "policy_version": r.policy_version,
            "reward_rule": r.reward_rule,
        },
        "rewards": r.reward,
        "trajectory_ids": {"instance_id": instance_id(r, group), "repetition_id": r.sample},
        "stop_reasons": r.stop_reason,
    }
    row.update(skyrl_tokens(r))
    return row


def export_skyrl(
    run: RunStore,
    out: Path | str,
    *,
    on_error: str = "mask",
    drop_zero_variance: bool = False,
    progress: bool = False,
    exclude_cancelled: bool = False,
) -> ExportResult:
    """Write the selected groups' ok episodes as SkyRL/verl parquet (atomically); returns the
    counts (as ``export_atropos``); ``extra_info.reward_rule`` names each row's rule."""
    out = _check_out(out)
    found, counts, skips = _selected(run, on_error, drop_zero_variance, progress, True, exclude_cancelled)
    built: list[tuple[Group, list[tuple[dict[str, Any], bool]]]] = []
    for g, recs in progress_bar(found, desc="skyrl", unit="group", show=None if progress else False):
        try:
            built.append((g, [storable(skyrl_row(r, g)) for r in recs]))
        except (ValueError, TypeError, UnicodeError) as e:
            skips.add(len(recs), f"group {g.group_id}: {type(e).__name__}: {e}")
    try:
        table = pa.Table.from_pylist([row for _, pairs in built for row, _ in pairs], schema=SKYRL_SCHEMA)
    except (ValueError, TypeError, UnicodeError, pa.ArrowException):  # find the groups to leave out
        built = [(g, pairs) for g, pairs in built if _converts(g, pairs, skips)]
        table = pa.Table.from_pylist([row for _, pairs in built for row, _ in pairs], schema=SKYRL_SCHEMA)
    rows = [row for _, pairs in built for row, _ in pairs]
    escaped = sum(esc for _, pairs in built for _, esc in pairs)
    written = len(built)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    atomic_write_bytes(out, sink.getvalue().to_pybytes())
    return ExportResult(
        path=str(out),
        format="skyrl",
        on_error=on_error,
        drop_zero_variance=drop_zero_variance,
        episodes=len(rows),
        groups=written,
        with_tokens=sum(r["response_ids"] is not None for r in rows),
        rows=table.num_rows,
        counts=counts,
        escaped_episodes=escaped,
        skipped_episodes=skips.episodes,
        skipped=skips.why,
    )


def _converts(g: Group, pairs: list[tuple[dict[str, Any], bool]], skips: _Skips) -> bool:
    try:
        pa.Table.from_pylist([row for row, _ in pairs], schema=SKYRL_SCHEMA)
    except (ValueError, TypeError, UnicodeError, pa.ArrowException) as e:
        skips.add(len(pairs), f"group {g.group_id}: {type(e).__name__}: {e}")
        return False
    return True


# The keys of SkyRL 0.4.0's GeneratorOutput TypedDict (skyrl/train/generators/base.py in the
# skyrl 0.4.0 wheel), in its order; all of them are required keys of the TypedDict.
SKYRL_GENERATOR_OUTPUT_KEYS = (
    "prompt_token_ids",
    "response_ids",
    "rewards",
    "loss_masks",
    "stop_reasons",
    "rollout_metrics",
    "rollout_logprobs",
    "trajectory_ids",
    "trajectory_generation_times",
    "trajectory_time_splits",
    "rollout_expert_indices",
    "rollout_sample_support",
    "is_last_step",
    "env_metrics",
    "pixel_values",
    "image_grid_thw",
)


@dataclass
class TrajectoryID:
    """SkyRL's ``TrajectoryID`` (same fields and ``to_string``), used when ``skyrl`` is not installed."""

    instance_id: str  # the group
    repetition_id: int  # the member (sample)

    def to_string(self) -> str:
        return f"{self.instance_id}_{self.repetition_id}"


def trajectory_id_class() -> type:
    """SkyRL's own ``TrajectoryID`` when ``skyrl`` is importable, else the same-shaped dataclass."""
    try:
        from skyrl.train.generators.base import TrajectoryID as Skyrl  # type: ignore[import-not-found]
    except Exception:  # not installed (it needs Python >= 3.12 and torch)
        return TrajectoryID
    return Skyrl


def generator_output(path: Path | str) -> dict[str, Any]:
    """Read a SkyRL export back as SkyRL's ``GeneratorOutput``: every key, ``trajectory_ids`` as
    ``TrajectoryID`` objects, ``None`` for what et-hpc does not produce (metrics, timings, routed
    experts, step-wise and vision fields). ``rollout_logprobs`` is ``None`` unless every row has them
    (SkyRL takes one list for the whole batch or none)."""
    t = pq.read_table(path, columns=list(GENERATOR_OUTPUT_COLUMNS))
    cols = {c: t.column(c).to_pylist() for c in GENERATOR_OUTPUT_COLUMNS}
    tid = trajectory_id_class()
    out: dict[str, Any] = dict.fromkeys(SKYRL_GENERATOR_OUTPUT_KEYS)
    out.update(
        prompt_token_ids=cols["prompt_token_ids"],
        response_ids=cols["response_ids"],
        rewards=cols["rewards"],
        loss_masks=cols["loss_masks"],
        stop_reasons=cols["stop_reasons"],
        trajectory_ids=[tid(instance_id=d["instance_id"], repetition_id=d["repetition_id"]) for d in cols["trajectory_ids"]],
    )
    lps = cols["rollout_logprobs"]
    out["rollout_logprobs"] = lps if all(x is not None for x in lps) else None
    return out


def _check_out(out: Path | str) -> Path:
    out = Path(out).expanduser()
    if out.is_dir():
        raise UserError(f"output {out} is a directory; give a file name, e.g. {out}/episodes.jsonl")
    if not out.parent.is_dir():
        raise UserError(f"output folder {out.parent} does not exist; create it or choose another -o path")
    return out


__all__ = [
    "ATROPOS_KEYS",
    "ExportResult",
    "GENERATOR_OUTPUT_COLUMNS",
    "Group",
    "SKYRL_GENERATOR_OUTPUT_KEYS",
    "SKYRL_SCHEMA",
    "TrajectoryID",
    "atropos_group",
    "trajectory_id_class",
    "atropos_message",
    "export_atropos",
    "export_skyrl",
    "generator_output",
    "iter_atropos_groups",
    "selected_groups",
    "skyrl_row",
    "skyrl_tokens",
    "validate_atropos_group",
]
