"""Exports of a run's ``ok`` episodes into the formats trainers read: Atropos JSONL, SkyRL/verl parquet.

Only episodes with ``status == "ok"`` are exported (errors carry no reward), after the store's
dedupe (one record per ``(task_id, sample)``).

**Atropos** (``export_atropos``): one ``ScoredDataGroup`` per line, one group per task (``group_id``)
holding that task's samples in sample order. Keys:

- ``tokens`` / ``masks``: the whole episode as one sequence per sample, masks ``-100`` on prompt
  positions (system/user prompt, tool output, template tokens) and the token id on completion
  positions, when every sample of the group recorded ``prompt_token_ids`` and ``token_ids``.
  Otherwise both are lists of empty lists (one per sample, so ``len(tokens)`` still equals the
  group size) and the consumer tokenizes ``messages`` itself, as Atropos' OpenAI-server path does.
- ``scores``: the rewards; ``messages``: each sample's chat transcript.
- ``inference_logprobs``: when every sample has logprobs, aligned with ``tokens`` (``1.0`` on
  prompt positions, which trainers ignore).
- ``group_overrides``: ``{"group_size": n}`` so a group shortened by failed episodes still passes
  Atropos' group-size check.

Groups whose scores are all equal carry no learning signal and are dropped, as Atropos does with
``ensure_scores_are_not_same`` (``keep_equal_scores=True`` keeps them).

**SkyRL / verl** (``export_skyrl``): one row per episode, columns

========================  =================================================================
``data_source``           ``"endless"`` (as upstream ``prepare_endless.py``)
``prompt``                list<struct{role, content}>: the messages before the first assistant turn
``messages``              list<struct{role, content}>: the whole trajectory (multi-turn SFT style)
``env_class``             ``"endless"`` (SkyRL)
``ability``               ``"terminal"`` (verl)
``reward``                float: the episode's reward
``reward_spec``           struct{method="rule", ground_truth=task_id} (SkyRL)
``reward_model``          struct{style="rule", ground_truth=task_id} (verl)
``extra_info``            struct{task_id, sample, group_id, episode_id, run_name, split, turns,
                          stop_reason, passed, total, model, policy_kind}
========================  =================================================================

Message ``content`` that is not a string (content parts, ``None`` with tool calls) is stored as
its JSON text (``None`` stays null); other message keys are dropped.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import BaseModel
from tqdm import tqdm

from et_hpc.errors import UserError
from et_hpc.record import EpisodeRecord
from et_hpc.store import RunStore
from et_hpc.util import atomic_write_bytes

log = logging.getLogger(__name__)

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
                ]
            ),
        ),
    ]
)


class ExportResult(BaseModel):
    path: str
    episodes: int  # ok episodes read
    groups: int = 0  # groups written (Atropos)
    dropped_equal: int = 0  # groups dropped because all scores were equal
    with_tokens: int = 0  # groups exported with tokens/masks
    rows: int = 0  # rows written (SkyRL)


def ok_records(run: RunStore, progress: bool = False) -> list[EpisodeRecord]:
    """The run's deduped ``ok`` episodes as records, in (task_id, sample) order."""
    table = run.read()
    table = table.filter(pc.equal(table.column("status"), "ok"))
    rows = table.to_pylist()
    return [EpisodeRecord.from_row(r) for r in tqdm(rows, desc="load", unit="ep", disable=None if progress else True)]


def _groups(records: list[EpisodeRecord]) -> dict[str, list[EpisodeRecord]]:
    groups: dict[str, list[EpisodeRecord]] = {}
    for r in records:
        groups.setdefault(r.group_id, []).append(r)
    for g in groups.values():
        g.sort(key=lambda r: r.sample)
    return groups


def atropos_group(records: list[EpisodeRecord]) -> dict[str, Any]:
    """One Atropos ``ScoredDataGroup`` (a JSON-ready dict) from the ok samples of one task."""
    n = len(records)
    group: dict[str, Any] = {"tokens": [[] for _ in range(n)], "masks": [[] for _ in range(n)]}
    if all(r.has_tokens for r in records):
        seqs = [r.token_sequence() for r in records]
        group["tokens"] = [s[0] for s in seqs]
        group["masks"] = [s[1] for s in seqs]
        if all(s[2] is not None for s in seqs):
            group["inference_logprobs"] = [s[2] for s in seqs]
    group["scores"] = [float(r.reward) for r in records]  # type: ignore[arg-type]
    group["messages"] = [r.messages for r in records]
    group["group_overrides"] = {"group_size": n}
    return group


def iter_atropos_groups(
    records: list[EpisodeRecord], keep_equal_scores: bool = False, stats: ExportResult | None = None
) -> Iterator[dict[str, Any]]:
    for gid, recs in _groups(records).items():
        group = atropos_group(recs)
        if not keep_equal_scores and len(set(group["scores"])) <= 1:
            log.debug("group %s: scores all equal, skipped", gid)
            if stats is not None:
                stats.dropped_equal += 1
            continue
        if stats is not None:
            stats.groups += 1
            stats.with_tokens += bool(group["tokens"] and group["tokens"][0])
        yield group


def export_atropos(run: RunStore, out: Path, keep_equal_scores: bool = False, progress: bool = False) -> ExportResult:
    """Write the run as Atropos ScoredDataGroup JSONL (atomically) and say what was written."""
    out = _check_out(out)
    records = ok_records(run, progress)
    stats = ExportResult(path=str(out), episodes=len(records))
    lines = [
        json.dumps(g, ensure_ascii=False, separators=(",", ":"))
        for g in tqdm(
            iter_atropos_groups(records, keep_equal_scores, stats),
            desc="atropos",
            unit="group",
            disable=None if progress else True,
        )
    ]
    atomic_write_bytes(out, ("\n".join(lines) + ("\n" if lines else "")).encode("utf-8"))
    return stats


def _msg(m: dict[str, Any]) -> dict[str, str | None]:
    content = m.get("content")
    if content is not None and not isinstance(content, str):
        content = json.dumps(content, ensure_ascii=False)
    return {"role": str(m.get("role", "")), "content": content}


def skyrl_row(r: EpisodeRecord) -> dict[str, Any]:
    msgs = [_msg(m) for m in r.messages]
    first_assistant = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs))
    return {
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
        },
    }


def export_skyrl(run: RunStore, out: Path, progress: bool = False) -> ExportResult:
    """Write the run's ok episodes as a SkyRL/verl-style parquet file (atomically)."""
    out = _check_out(out)
    records = ok_records(run, progress)
    rows = [skyrl_row(r) for r in tqdm(records, desc="skyrl", unit="ep", disable=None if progress else True)]
    table = pa.Table.from_pylist(rows, schema=SKYRL_SCHEMA)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    atomic_write_bytes(out, sink.getvalue().to_pybytes())
    return ExportResult(path=str(out), episodes=len(records), rows=table.num_rows)


def _check_out(out: Path | str) -> Path:
    out = Path(out).expanduser()
    if out.is_dir():
        raise UserError(f"output {out} is a directory; give a file name, e.g. {out}/episodes.jsonl")
    if not out.parent.is_dir():
        raise UserError(f"output folder {out.parent} does not exist; create it or choose another -o path")
    return out
