"""Groups in the store: key (run, group_id), legacy rows by (run, task, policy version), masking,
zero variance, summary counts."""

from __future__ import annotations

import json

import pytest

from et_hpc.cli import main
from et_hpc.errors import UserError
from et_hpc.record import EpisodeRecord
from et_hpc.runs.store import RunStore, count_groups, group_key, groups_of, select_groups


def rec(
    task: str, sample: int, reward: float | None, status: str = "ok", version: str | None = None, run: str = "r", group: str = ""
) -> EpisodeRecord:
    return EpisodeRecord(
        run_name=run,
        task_id=task,
        sample=sample,
        status=status,
        group_id=group,
        reward=reward if status == "ok" else None,
        policy_version=version,
    )


@pytest.fixture()
def rs(tmp_path) -> RunStore:
    r = RunStore(tmp_path / "r")
    r.write([rec("varied", s, float(s % 2)) for s in range(4)])
    r.write([rec("flat", s, 1.0) for s in range(4)])
    r.write([rec("infra", 0, 1.0), rec("infra", 1, 0.0), rec("infra", 2, None, "infra_error"), rec("infra", 3, 1.0)])
    r.write([rec("allbad", 0, None, "policy_error"), rec("allbad", 1, None, "no_image")])
    return r


def test_legacy_rows_group_by_task_and_policy_version(tmp_path):
    # rows written before schema 4 with group_id == task_id keep the older rule
    assert group_key("r", "t", None) == group_key("r", "t", "") == ("r", "t", "t", None)
    r = RunStore(tmp_path / "v")
    old = [rec("t", 0, 1.0, version="v1"), rec("t", 1, 0.0, version="v1"), rec("t", 2, 1.0, version="v2"), rec("u", 0, 1.0)]
    r.write([x.model_copy(update={"schema_version": 3}) for x in old])
    groups = groups_of(r.read())
    assert sorted(g.key for g in groups) == [("r", "t", "t", "v1"), ("r", "t", "t", "v2"), ("r", "t", "u", None)]
    v1 = next(g for g in groups if g.policy_version == "v1")
    assert v1.samples == [0, 1] and v1.rewards == [1.0, 0.0]
    # the same rows written now: one group per group_id, whatever versions its members saw
    r2 = RunStore(tmp_path / "v4")
    r2.write(old)
    assert sorted((g.key, g.samples) for g in groups_of(r2.read())) == [(("r", "g", "t"), [0, 1, 2]), (("r", "g", "u"), [0])]


def test_groups_are_the_sampled_groups(tmp_path):
    # two collect calls of one task (group ids t@s0, t@s2) and two epochs of a continuous unit
    r = RunStore(tmp_path / "g")
    r.write([rec("t", 0, 1.0, group="t@s0"), rec("t", 1, 0.0, group="t@s0")])
    r.write([rec("t", 2, 1.0, group="t@s2"), rec("t", 3, 1.0, group="t@s2", status="infra_error")])
    r.write([rec("u", s, float(s), group=f"u@e{s // 2}") for s in range(4)])
    groups = groups_of(r.read())
    assert [(g.group_id, g.samples) for g in groups] == [("t@s0", [0, 1]), ("t@s2", [2, 3]), ("u@e0", [0, 1]), ("u@e1", [2, 3])]
    c = count_groups(groups)
    assert (c.total, c.complete, c.masked, c.zero_variance) == (4, 3, 1, 0)
    _, kept, c = r.select()
    assert [g.group_id for g in kept] == ["t@s0", "u@e0", "u@e1"] and c.dropped_masked == 1
    # a legacy shard in the same run keeps its own rule beside them
    r.write([rec("t", 9, 1.0).model_copy(update={"schema_version": 2})])
    assert [g.key for g in groups_of(r.read())][-1] == ("r", "t", "t", None)


def test_dedupe_before_grouping_an_ok_retry_unmasks_the_group(rs):
    # the infra error of sample 2 is retried and succeeds: the group is complete now
    assert count_groups(groups_of(rs.read())).masked == 2
    rs.write([rec("infra", 2, 0.0)])
    c = count_groups(groups_of(rs.read()))
    assert (c.total, c.complete, c.masked) == (4, 3, 1)


def test_mask_is_the_default_and_keep_ok_keeps_ok_members(rs):
    table, groups, c = rs.select()
    assert (c.total, c.complete, c.masked, c.zero_variance) == (4, 2, 2, 1)
    assert {g.task_id for g in groups} == {"varied", "flat"} and c.dropped_masked == 2
    assert table.num_rows == 8 and set(table.column("status").to_pylist()) == {"ok"}
    # rows of the returned groups index the returned table
    for g in groups:
        assert set(table.take(g.rows).column("task_id").to_pylist()) == {g.task_id}

    table, groups, c = rs.select(on_error="keep-ok")
    infra = next(g for g in groups if g.task_id == "infra")
    assert infra.samples == [0, 1, 3] and infra.statuses == ["ok"] * 3
    assert "allbad" not in {g.task_id for g in groups}  # no ok member
    assert c.dropped_error_episodes == 1 and c.episodes == table.num_rows == 11


def test_drop_zero_variance(rs):
    _, groups, c = rs.select(drop_zero_variance=True)
    assert [g.task_id for g in groups] == ["varied"] and c.dropped_zero_variance == 1
    kept, c2 = select_groups(groups_of(rs.read()), "keep-ok", drop_zero_variance=True)
    assert {g.task_id for g in kept} == {"varied", "infra"} and c2.dropped_zero_variance == 1
    with pytest.raises(UserError, match="on_error"):
        select_groups([], "ignore")


def test_summary_shows_group_counts(rs, capsys):
    g = rs.summary().groups
    assert (g.total, g.complete, g.masked, g.zero_variance) == (4, 2, 2, 1)
    assert main(["store", "summary", str(rs.path)]) == 0
    out = capsys.readouterr().out
    assert "groups 4: 2 complete, 2 masked" in out and "1 zero-variance" in out
    assert main(["store", "summary", str(rs.path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["groups"]["masked"] == 2
