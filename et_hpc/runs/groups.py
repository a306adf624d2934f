"""Groups of a run: what was sampled together (the one definition; exports and summaries use it).

A group's key is ``(run_name, group_id)``: a batch run's samples of one task, one unit of a
continuous run (``<task_id>@e<epoch>``), one Atropos ``collect_trajectories`` call
(``<task_id>@s<first sample>``). Rows from before schema version 4 keep the older key
``(run_name, task_id, policy_version)`` (``legacy_group``). ``select_groups`` decides what a
trainer gets: ``on_error="mask"`` leaves out a group with any non-``ok`` member, ``"keep-ok"``
keeps its ``ok`` members; ``drop_zero_variance`` leaves out groups whose scores are all equal.
``GroupCounts``: complete (only ``ok``), masked (an error member), zero_variance (complete, equal).
"""

from __future__ import annotations

import logging
from typing import Literal, get_args

import pyarrow as pa
from pydantic import BaseModel

from et_hpc.errors import UserError

log = logging.getLogger(__name__)


OnError = Literal["mask", "keep-ok"]
ON_ERROR: tuple[str, ...] = get_args(OnError)
GROUP_COLS = ["run_name", "group_id", "task_id", "policy_version", "schema_version"]
GROUP_READ_COLS = GROUP_COLS + ["sample", "status", "reward"]
GroupKey = tuple[str, str, str] | tuple[str, str, str, str | None]  # (run, "g", group_id) | (run, "t", task, version)
GROUP_ID_SCHEMA = 4  # rows written with this schema version or later are grouped by group_id


class GroupCounts(BaseModel):
    """How many groups a run (or a selection) has, and what a trainer gets of them."""

    total: int = 0
    complete: int = 0  # every member ok
    masked: int = 0  # at least one member with an error status
    zero_variance: int = 0  # complete, all scores equal
    selected: int = 0  # groups kept by the selection
    episodes: int = 0  # ok episodes in the kept groups
    dropped_masked: int = 0  # groups left out because of an error member (on_error="mask")
    dropped_zero_variance: int = 0  # groups left out for equal scores (drop_zero_variance)
    dropped_error_episodes: int = 0  # error members of kept groups (on_error="keep-ok"): never exported
    dropped_no_tokens: int = 0  # exports: groups left out because a member has no exact token ids (absent, drifted)


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


def groups_of(table: pa.Table) -> list[Group]:
    """Groups of a deduped table (needs ``run_name, group_id, task_id, policy_version,
    schema_version, sample, status, reward``).

    Order: by first appearance of the key in the table; members in sample order.
    """
    missing = [c for c in GROUP_READ_COLS if c not in table.column_names]
    if missing:
        raise ValueError(f"groups_of needs columns {missing}")
    cols = {c: table.column(c).to_pylist() for c in GROUP_READ_COLS}
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
            )
        )
    return out


def count_groups(groups: list[Group]) -> GroupCounts:
    """``total``, ``complete``, ``masked``, ``zero_variance`` of a list of groups."""
    c = GroupCounts(total=len(groups))
    for g in groups:
        if g.masked:
            c.masked += 1
        else:
            c.complete += 1
            if len(set(g.ok_scores())) <= 1:
                c.zero_variance += 1
    return c


def select_groups(groups: list[Group], on_error: str = "mask", drop_zero_variance: bool = False) -> tuple[list[Group], GroupCounts]:
    """The groups a trainer may get, each reduced to its ``ok`` members, and the counts.

    ``on_error``: ``"mask"`` leaves out every group with an error member; ``"keep-ok"`` keeps its
    ok members. ``drop_zero_variance`` leaves out groups whose kept scores are all equal.
    Error members are never selected (they carry no reward).
    """
    if on_error not in ON_ERROR:
        raise UserError(f"on_error {on_error!r}: use one of {', '.join(ON_ERROR)}")
    counts = count_groups(groups)
    kept: list[Group] = []
    for g in groups:
        if g.masked and on_error == "mask":
            counts.dropped_masked += 1
            continue
        okg = g.model_copy(
            update={
                "rows": g.ok_rows(),
                "samples": [s for s, st in zip(g.samples, g.statuses) if st == "ok"],
                "rewards": [w for w, st in zip(g.rewards, g.statuses) if st == "ok"],
                "statuses": [st for st in g.statuses if st == "ok"],
            }
        )
        if not okg.rows:
            counts.dropped_masked += 1
            continue
        if drop_zero_variance and len(set(okg.ok_scores())) <= 1:
            counts.dropped_zero_variance += 1
            continue
        counts.dropped_error_episodes += len(g.rows) - len(okg.rows)
        counts.selected += 1
        counts.episodes += len(okg.rows)
        kept.append(okg)
    return kept, counts
