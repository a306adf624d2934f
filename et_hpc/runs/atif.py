"""ATIF export: one Agent Trajectory Interchange Format (v1.8) document per episode.

``trajectory(rec)`` maps one record to a JSON-ready ATIF document (Harbor's trajectory format:
system and task prompt steps, one agent step per assistant message with its tool calls,
observation and, when the ids pair with the turns, token metrics; final metrics with the score).
``export_atif`` writes ``DIR/<task_id>.<sample>.json`` per deduped episode and
``DIR/index.jsonl``. Prompt ids are left out when they drift from the server's tokenization; the
document's ``notes`` says so. Text UTF-8 cannot encode (lone surrogates) is written as ``\\udcHH``
(``extra.escaped_text``); an episode that cannot be exported is skipped and counted, never the
rest of the run. The field mapping: docs/exports.md.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from et_hpc import __version__
from et_hpc.errors import UserError
from et_hpc.record import EpisodeRecord, table_rows
from et_hpc.runs.store import RunStore
from et_hpc.text import storable
from et_hpc.util import atomic_write_text

log = logging.getLogger(__name__)

ATIF_VERSION = "ATIF-v1.8"
# the ET text protocol: a reply names its command as <command>...</command>
_COMMAND = re.compile(r"<command>\s*(.*?)\s*</command>", re.DOTALL)
_TEXT_TOOL = "terminal"
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", json.dumps(p)) if isinstance(p, dict) else str(p) for p in content)
    return json.dumps(content)


def _arguments(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    try:
        v = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        v = None
    return v if isinstance(v, dict) else {"raw": "" if raw is None else str(raw)}


def _token_metrics(rec: EpisodeRecord) -> list[dict[str, Any]] | None:
    """Per agent turn, the ATIF metrics the record's token ids give (None when it has none)."""
    if not rec.token_ids:
        return None
    exact = rec.token_drift is None and rec.prompt_token_ids is not None and len(rec.prompt_token_ids) == len(rec.token_ids)
    seq: list[int] = []
    out = []
    for i, completion in enumerate(rec.token_ids):
        m: dict[str, Any] = {"completion_token_ids": list(completion or []), "completion_tokens": len(completion or [])}
        if exact:
            seq = seq + list(rec.prompt_token_ids[i] or [])  # type: ignore[index]
            m["prompt_token_ids"] = list(seq)
            m["prompt_tokens"] = len(seq)
            seq = seq + list(completion or [])
        lps = rec.logprobs[i] if rec.logprobs is not None and i < len(rec.logprobs) else None
        if lps is not None and len(lps) == len(completion or []):
            m["logprobs"] = [float(x) for x in lps]
        out.append(m)
    return out


def _tool_calls(m: dict[str, Any], text: str, turn: int) -> list[dict[str, Any]]:
    """An assistant message's calls as ATIF tool calls (a ``<command>`` reply: one ``terminal`` call)."""
    calls = []
    for k, tc in enumerate(m.get("tool_calls") or []):
        f = tc.get("function") or {}
        calls.append(
            {
                "tool_call_id": str(tc.get("id") or f"call_{turn}_{k}"),
                "function_name": str(f.get("name") or "unknown"),
                "arguments": _arguments(f.get("arguments")),
            }
        )
    if not calls:
        cmd = _COMMAND.search(text)
        if cmd:
            calls.append(
                {
                    "tool_call_id": f"call_{turn}_0",
                    "function_name": _TEXT_TOOL,
                    "arguments": {"command": cmd.group(1)},
                    "extra": {"protocol": "text"},
                }
            )
    return calls


def _agent_step(
    rec: EpisodeRecord, m: dict[str, Any], text: str, step_id: int, turn: int, metrics: list[dict[str, Any]] | None
) -> dict[str, Any]:
    step: dict[str, Any] = {"step_id": step_id, "source": "agent", "message": text}
    if rec.model:
        step["model_name"] = rec.model
    reasoning = m.get("reasoning_content") or m.get("reasoning")
    if reasoning:
        step["reasoning_content"] = _text(reasoning)
    calls = _tool_calls(m, text, turn)
    if calls:
        step["tool_calls"] = calls
    if metrics is not None:
        step["metrics"] = metrics[turn]
        step["llm_call_count"] = 1
    return step


def _observe(last_agent: dict[str, Any], m: dict[str, Any], text: str) -> None:
    """A tool result, or (text protocol) the environment's reply: the observation of the last agent step."""
    ids = [c["tool_call_id"] for c in last_agent.get("tool_calls", [])]
    call = m.get("tool_call_id") if m.get("tool_call_id") in ids else None
    if call is None and m.get("role") != "tool" and ids:
        taken = {r.get("source_call_id") for r in last_agent.get("observation", {}).get("results", [])}
        call = next((i for i in ids if i not in taken), None)
    result: dict[str, Any] = {"content": text}
    if call is not None:
        result["source_call_id"] = call
    last_agent.setdefault("observation", {"results": []})["results"].append(result)


def _steps(rec: EpisodeRecord, metrics: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = []
    seen_user = False
    last_agent: dict[str, Any] | None = None
    turn = 0
    for m in rec.messages:
        role = m.get("role")
        text = _text(m.get("content"))
        if role == "assistant":
            last_agent = _agent_step(rec, m, text, len(steps) + 1, turn, metrics)
            turn += 1
            steps.append(last_agent)
        elif role == "system" or (role == "user" and not seen_user):
            seen_user |= role == "user"
            steps.append({"step_id": len(steps) + 1, "source": role, "message": text})
            last_agent = None
        elif last_agent is None:
            steps.append({"step_id": len(steps) + 1, "source": "user", "message": text})
        else:
            _observe(last_agent, m, text)
    if not steps:  # ATIF needs one step: an episode that never reached its prompt (an error) says why
        steps.append({"step_id": 1, "source": "system", "message": rec.error or f"no transcript (status {rec.status})"})
    return steps


def _final_metrics(rec: EpisodeRecord, n_steps: int) -> dict[str, Any]:
    final_extra = {
        "reward": rec.reward,
        "status": rec.status,
        "passed": rec.passed,
        "total": rec.total,
        "tests": [{"name": x.name, "outcome": x.outcome} for x in rec.tests],
        "score_note": rec.score_note,
        "stop_reason": rec.stop_reason,
        "error": rec.error,
        "turns": rec.turns,
        "timings": rec.timings.model_dump(exclude_none=True),
        "peak_mem_mb": rec.peak_mem_mb,
        "peak_pids": rec.peak_pids,
        "events": rec.events,
        "tokens_source": rec.tokens_source,
        "token_drift": rec.token_drift,
    }
    final: dict[str, Any] = {"total_steps": n_steps, "extra": {k: v for k, v in final_extra.items() if v is not None}}
    if rec.prompt_tokens is not None:
        final["total_prompt_tokens"] = rec.prompt_tokens
    if rec.completion_tokens is not None:
        final["total_completion_tokens"] = rec.completion_tokens
    return final


def trajectory(rec: EpisodeRecord) -> dict[str, Any]:
    """The ATIF v1.8 document of one episode (a JSON-ready dict, ``None`` values left out)."""
    metrics = _token_metrics(rec)
    n_agent = sum(1 for m in rec.messages if m.get("role") == "assistant")
    if metrics is not None and len(metrics) != n_agent:
        metrics = None  # ids that do not pair with the turns are not attached to any step
    steps = _steps(rec, metrics)
    agent: dict[str, Any] = {
        "name": "et-hpc",
        "version": __version__,
        "extra": {"policy_kind": rec.policy_kind, "sampling_params": rec.sampling_params},
    }
    if rec.model:
        agent["model_name"] = rec.model
    root_extra = {
        "run_name": rec.run_name,
        "task_id": rec.task_id,
        "sample": rec.sample,
        "group_id": rec.group_id,
        "split": rec.split,
        "policy_version": rec.policy_version,
        "policy_versions": rec.policy_versions,
        "crossed_version": rec.crossed_version,
        "image_digest": rec.image_digest,
        "host": rec.host,
        "created_at": rec.created_at.isoformat(),
    }
    doc: dict[str, Any] = {
        "schema_version": ATIF_VERSION,
        "session_id": rec.episode_id,
        "trajectory_id": rec.episode_id,
        "agent": agent,
        "steps": steps,
        "final_metrics": _final_metrics(rec, len(steps)),
        "extra": {k: v for k, v in root_extra.items() if v is not None},
    }
    if metrics is None and rec.token_ids:
        doc["notes"] = "token ids were recorded but do not pair one to one with the agent steps; left out"
    elif rec.token_drift and metrics is not None:
        doc["notes"] = f"token ids drift from the server's tokenization ({rec.token_drift}): prompt ids left out"
    return doc


ESCAPED_NOTE = "text UTF-8 cannot encode (lone surrogates, undecodable bytes) written as \\udcHH escapes"


@dataclass
class AtifResult:
    out: Path
    documents: int
    by_status: dict[str, int]
    escaped: int = 0  # documents holding escaped text
    skipped: list[str] = field(default_factory=list)  # "<episode>: <why>" per episode not exported

    def line(self) -> str:
        st = ", ".join(f"{k} {v}" for k, v in sorted(self.by_status.items()))
        extra = f"; {self.escaped} with text escaped" if self.escaped else ""
        if self.skipped:
            extra += f"; {len(self.skipped)} episodes skipped (could not be exported): {self.skipped[0]}"
        return f"wrote {self.documents} {ATIF_VERSION} documents to {self.out} ({st}){extra}; index: {self.out / 'index.jsonl'}"


def atif_document(rec: EpisodeRecord) -> tuple[str, bool]:
    """The ATIF JSON text of one episode, and whether text in it had to be escaped."""
    doc, escaped = storable(trajectory(rec))
    if escaped:
        doc["extra"]["escaped_text"] = ESCAPED_NOTE
    return json.dumps(doc, ensure_ascii=False, indent=1) + "\n", escaped


def export_atif(run: RunStore, out: Path | str, ok_only: bool = False) -> AtifResult:
    """One ATIF document per deduped episode of ``run`` (only ``ok`` ones with ``ok_only``); an
    episode whose record cannot be read or exported is skipped and listed in ``skipped``."""
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"-o {out} is a file; give a directory (one JSON document per episode goes there)")
    out.mkdir(parents=True, exist_ok=True)
    res = AtifResult(out=out, documents=0, by_status={})
    index = []
    recs = []
    for i, row in enumerate(table_rows(run.read())):
        try:
            recs.append(EpisodeRecord.from_row(row))
        except Exception as e:  # noqa: BLE001 - one bad row is one episode skipped
            res.skipped.append(f"{storable(str(row.get('episode_id') or f'row {i}'))[0]}: {type(e).__name__}")
    for rec in sorted(recs, key=lambda r: (r.task_id, r.sample)):
        if ok_only and rec.status != "ok":
            continue
        name = f"{_SAFE.sub('_', rec.task_id)}.{rec.sample}.json"
        try:
            text, escaped = atif_document(rec)
            atomic_write_text(out / name, text)
        except (ValueError, TypeError, UnicodeError) as e:
            log.warning("ATIF: episode %s skipped: %s", rec.episode_id, e)
            res.skipped.append(f"{rec.episode_id}: {type(e).__name__}: {e}"[:300])
            continue
        res.escaped += escaped
        res.by_status[rec.status] = res.by_status.get(rec.status, 0) + 1
        entry = {"file": name, "episode_id": rec.episode_id, "task_id": rec.task_id, "sample": rec.sample}
        index.append(json.dumps({**storable(entry)[0], "status": rec.status, "reward": rec.reward}))
    atomic_write_text(out / "index.jsonl", "".join(line + "\n" for line in index))
    res.documents = len(index)
    return res
