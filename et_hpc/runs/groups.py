"""Groups of a run: what was sampled together (the one definition; exports and summaries use it).

A group's key is ``(run_name, group_id)``, unique to its writer: a batch invocation's units of a
task (``<task>@i<invocation>``), a continuous unit (``<task>@e<epoch>``), an Atropos env call
(``<task>@w<writer>-s<first sample>``); ``take_samples`` gives continuous and env writers unit keys
no other writer gets. Rows before schema 4 keep the key ``(run_name, task_id, policy_version)``
(``legacy_group``). ``untrainable`` is the one rule for what a trainer never gets (exports,
stream, env, summary): masked (``on_error``), incomplete (fewer members than ``group_size``),
without exact token ids, and (asked) cancelled by atropos. ``select_groups`` applies it and
``drop_zero_variance``; ``GroupCounts`` counts. Specification: docs/store.md ("Groups").
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, get_args

import filelock
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel

from et_hpc.errors import UserError
from et_hpc.record import CANCELLED_EVENT, EpisodeRecord
from et_hpc.util import atomic_write_text

log = logging.getLogger(__name__)


OnError = Literal["mask", "keep-ok"]
ON_ERROR: tuple[str, ...] = get_args(OnError)
GROUP_COLS = ["run_name", "group_id", "task_id", "policy_version", "schema_version"]
GROUP_READ_COLS = GROUP_COLS + ["sample", "status", "reward"]
# read when present: incompleteness, exact tokens, cancellation and the reward rule of a group
GROUP_EXTRA_COLS = ["group_size", "prompt_token_ids", "token_ids", "token_drift", "events", "reward_rule"]
GroupKey = tuple[str, str, str] | tuple[str, str, str, str | None]  # (run, "g", group_id) | (run, "t", task, version)
GROUP_ID_SCHEMA = 4  # rows written with this schema version or later are grouped by group_id


class GroupCounts(BaseModel):
    """How many groups a run (or a selection) has, and what a trainer gets of them."""

    total: int = 0
    complete: int = 0  # every member ok
    masked: int = 0  # at least one member with an error status
    zero_variance: int = 0  # complete, all scores equal
    incomplete: int = 0  # fewer members stored than its group_size (an interrupted group): never trainable
    without_tokens: int = 0  # an ok member without exact token ids (absent, drifted): never trainable
    cancelled: int = 0  # an Atropos env group that atropos cancelled (stored, never sent)
    trainable: int = 0  # complete, whole, every member with exact token ids (not cancelled)
    selected: int = 0  # groups kept by the selection
    episodes: int = 0  # ok episodes in the kept groups
    dropped_masked: int = 0  # groups left out because of an error member (on_error="mask")
    dropped_zero_variance: int = 0  # groups left out for equal scores (drop_zero_variance)
    dropped_error_episodes: int = 0  # error members of kept groups (on_error="keep-ok"): never exported
    dropped_no_tokens: int = 0  # groups left out because a member has no exact token ids (absent, drifted)
    dropped_incomplete: int = 0  # groups left out because members are missing (group_size)
    dropped_cancelled: int = 0  # groups left out because atropos cancelled them (exclude_cancelled)
    reward_rules: list[str] = []  # the reward rules of the groups' records (binary, fraction); [] when unrecorded


class Group(BaseModel):
    """One group: its key, and the deduped members' row indices (sample order) and statuses."""

    run_name: str
    task_id: str
    policy_version: str | None  # of the first member (members may differ: see crossed_version)
    rows: list[int]  # indices into the table the group was computed from, by sample
    samples: list[int]
    statuses: list[str]
    rewards: list[float | None]
    group_id: str = ""  # the sampled group; "" for a legacy group (see legacy_group)
    group_size: int | None = None  # members it was sampled with; None: unknown (rows before schema 6)
    tokens: list[bool | None] = []  # per member: exact token ids (EpisodeRecord.has_tokens); None: not read
    cancelled: bool = False  # atropos cancelled it (CANCELLED_EVENT)
    reward_rule: str | None = None

    @property
    def incomplete(self) -> bool:
        return self.group_size is not None and len(self.rows) < self.group_size

    @property
    def without_tokens(self) -> bool:
        """An ok member lacks exact token ids (False when the token columns were not read)."""
        return any(t is False for t, s in zip(self.tokens, self.statuses) if s == "ok")

    @property
    def key(self) -> GroupKey:
        return group_key(self.run_name, self.task_id, self.policy_version, self.group_id or None)

    @property
    def masked(self) -> bool:
        return any(s != "ok" for s in self.statuses)

    def ok_rows(self) -> list[int]:
        return [r for r, s in zip(self.rows, self.statuses) if s == "ok"]

    def ok_scores(self) -> list[float]:
        return [float(w) for w, s in zip(self.rewards, self.statuses) if s == "ok" and w is not None]


def legacy_group(group_id: str | None, task_id: str, schema_version: int | None) -> bool:
    """True for a row written before groups had their own id (schema < 4, ``group_id == task_id``)."""
    return (schema_version or 1) < GROUP_ID_SCHEMA and (not group_id or group_id == task_id)


def group_key(run_name: str, task_id: str, policy_version: str | None = None, group_id: str | None = None) -> GroupKey:
    """The key of the group an episode belongs to: ``(run_name, "g", group_id)``; without a
    ``group_id`` (a legacy row) ``(run_name, "t", task_id, policy_version)``."""
    if group_id:
        return (run_name, "g", group_id)
    return (run_name, "t", task_id, policy_version or None)


def tokens_column(table: pa.Table) -> list[bool | None]:
    """Per row: exact token ids, the rule of ``EpisodeRecord.has_tokens`` computed on the columns;
    None per row when the table lacks them."""
    need = ("prompt_token_ids", "token_ids", "token_drift")
    if not all(c in table.column_names for c in need):
        return [None] * table.num_rows
    tok, prm = table.column("token_ids"), table.column("prompt_token_ids")
    nt, np_ = pc.list_value_length(tok), pc.list_value_length(prm)
    ok = pc.and_kleene(pc.and_kleene(pc.equal(nt, np_), pc.greater(nt, 0)), pc.is_null(table.column("token_drift")))
    return [bool(x) for x in pc.fill_null(ok, False).to_pylist()]


def _extra(table: pa.Table, name: str) -> list:
    return table.column(name).to_pylist() if name in table.column_names else [None] * table.num_rows


def groups_of(table: pa.Table) -> list[Group]:
    """Groups of a deduped table (needs ``run_name, group_id, task_id, policy_version,
    schema_version, sample, status, reward``; reads ``GROUP_EXTRA_COLS`` when present).

    Order: by first appearance of the key in the table; members in sample order.
    """
    missing = [c for c in GROUP_READ_COLS if c not in table.column_names]
    if missing:
        raise ValueError(f"groups_of needs columns {missing}")
    cols = {c: table.column(c).to_pylist() for c in GROUP_READ_COLS}
    sizes, events, rules = _extra(table, "group_size"), _extra(table, "events"), _extra(table, "reward_rule")
    tokens = tokens_column(table)
    by_key: dict[GroupKey, list[int]] = {}
    for i, (run, gid, task, version, sv) in enumerate(
        zip(cols["run_name"], cols["group_id"], cols["task_id"], cols["policy_version"], cols["schema_version"])
    ):
        key = group_key(run, task, version, None if legacy_group(gid, task, sv) else gid)
        by_key.setdefault(key, []).append(i)
    out = []
    for key, idx in by_key.items():
        idx.sort(key=lambda i: cols["sample"][i])
        first = idx[0]
        known = [sizes[i] for i in idx if sizes[i] is not None]
        out.append(
            Group(
                run_name=key[0],
                task_id=cols["task_id"][first],
                policy_version=cols["policy_version"][first] or None,
                group_id=key[2] if key[1] == "g" else "",
                rows=idx,
                samples=[cols["sample"][i] for i in idx],
                statuses=[cols["status"][i] for i in idx],
                rewards=[cols["reward"][i] for i in idx],
                group_size=max(known) if known else None,
                tokens=[tokens[i] for i in idx],
                cancelled=any(CANCELLED_EVENT in (events[i] or []) for i in idx),
                reward_rule=next((rules[i] for i in idx if rules[i]), None),
            )
        )
    return out


def group_of_records(records: Sequence[EpisodeRecord]) -> Group:
    """The ``Group`` of one group's records (as the stream and the env hold them): rows index
    ``records``; the same fields ``groups_of`` fills, so ``untrainable`` judges both alike."""
    r0 = records[0]
    known = [r.group_size for r in records if r.group_size is not None]
    return Group(
        run_name=r0.run_name,
        task_id=r0.task_id,
        policy_version=r0.policy_version,
        group_id=r0.group_id,
        rows=list(range(len(records))),
        samples=[r.sample for r in records],
        statuses=[r.status for r in records],
        rewards=[r.reward for r in records],
        group_size=max(known) if known else None,
        tokens=[r.has_tokens for r in records],
        cancelled=any(CANCELLED_EVENT in r.events for r in records),
        reward_rule=next((r.reward_rule for r in records if r.reward_rule), None),
    )


Untrainable = Literal["masked", "incomplete", "no_tokens", "cancelled"]


def untrainable(g: Group, on_error: str = "mask", require_tokens: bool = True, exclude_cancelled: bool = False) -> Untrainable | None:
    """Why a trainer must not get ``g``, or None: the one rule of exports, stream, env and summary.

    ``masked``: an error member (``on_error="mask"``), or no ok member at all; ``incomplete``:
    fewer members than its ``group_size``; ``no_tokens``: an ok member without exact token ids
    (``require_tokens``); ``cancelled``: atropos cancelled it (``exclude_cancelled``).
    """
    if g.incomplete:
        return "incomplete"
    if (g.masked and on_error == "mask") or not g.ok_rows():
        return "masked"
    if require_tokens and g.without_tokens:
        return "no_tokens"
    if exclude_cancelled and g.cancelled:
        return "cancelled"
    return None


def count_groups(groups: list[Group]) -> GroupCounts:
    """``total``, ``complete``, ``masked``, ``zero_variance``, ``incomplete``, ``without_tokens``,
    ``cancelled`` and ``trainable`` of a list of groups."""
    c = GroupCounts(total=len(groups))
    for g in groups:
        c.incomplete += g.incomplete
        c.cancelled += g.cancelled
        if g.masked:
            c.masked += 1
        elif not g.incomplete:
            c.complete += 1
            if len(set(g.ok_scores())) <= 1:
                c.zero_variance += 1
            c.without_tokens += g.without_tokens
        c.trainable += untrainable(g, exclude_cancelled=True) is None and all(t is not None for t in g.tokens)
    c.reward_rules = sorted({g.reward_rule for g in groups if g.reward_rule})
    return c


_DROPPED = {
    "masked": "dropped_masked",
    "incomplete": "dropped_incomplete",
    "no_tokens": "dropped_no_tokens",
    "cancelled": "dropped_cancelled",
}


def select_groups(
    groups: list[Group],
    on_error: str = "mask",
    drop_zero_variance: bool = False,
    require_tokens: bool = False,
    exclude_cancelled: bool = False,
) -> tuple[list[Group], GroupCounts]:
    """The groups a trainer may get, each reduced to its ``ok`` members, and the counts.

    What ``untrainable`` refuses is left out and counted (``dropped_*``); ``on_error="keep-ok"``
    keeps the ok members of a group with an error member. ``drop_zero_variance`` leaves out
    groups whose kept scores are all equal. Error members are never selected (no reward).
    """
    if on_error not in ON_ERROR:
        raise UserError(f"on_error {on_error!r}: use one of {', '.join(ON_ERROR)}")
    counts = count_groups(groups)
    kept: list[Group] = []
    for g in groups:
        why = untrainable(g, on_error, require_tokens, exclude_cancelled)
        if why is not None:
            setattr(counts, _DROPPED[why], getattr(counts, _DROPPED[why]) + 1)
            continue
        ok = [i for i, st in enumerate(g.statuses) if st == "ok"]
        okg = g.model_copy(
            update={
                "rows": [g.rows[i] for i in ok],
                "samples": [g.samples[i] for i in ok],
                "rewards": [g.rewards[i] for i in ok],
                "statuses": ["ok"] * len(ok),
                "tokens": [g.tokens[i] for i in ok] if g.tokens else [],
            }
        )
        if drop_zero_variance and len(set(okg.ok_scores())) <= 1:
            counts.dropped_zero_variance += 1
            continue
        counts.dropped_error_episodes += len(g.rows) - len(okg.rows)
        counts.selected += 1
        counts.episodes += len(okg.rows)
        kept.append(okg)
    return kept, counts


SAMPLES_FILE = ".samples.json"  # in a run directory: the next free sample per task, for every writer


def take_samples(run_dir: Path, task_id: str, n: int, floor: int = 0) -> list[int]:
    """``n`` samples of ``task_id`` that no other writer of the run gets (processes on any node
    sharing the run directory): a counter per task in ``<run>/.samples.json`` under a file lock;
    ``floor``: above every sample already stored."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / SAMPLES_FILE
    with filelock.FileLock(str(run_dir / f"{SAMPLES_FILE}.lock")):
        try:
            taken = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            taken = {}
        first = max(int(taken.get(task_id, 0)), floor)
        taken[task_id] = first + n
        atomic_write_text(path, json.dumps(taken) + "\n")
    return list(range(first, first + n))
