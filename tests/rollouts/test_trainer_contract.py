"""The trainer contract, one defect at a time: stream slots outlive compaction, groups are unique per
invocation and writer, nothing untrainable is delivered, one reward rule per run.

Real parts: the parquet store and its compactor, the work queue, the stream, the exports, the
batch planner and unit pool (with the test unit runner, a real subprocess per unit).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from et_hpc.errors import UserError
from et_hpc.record import CANCELLED_EVENT, EpisodeRecord, records_to_table
from et_hpc.rollouts import RolloutStream
from et_hpc.rollouts.queue import WorkQueue, slot_name
from et_hpc.runs.store import RunStore


def _rec(task: str, sample: int, group: str, *, tokens: bool = True, drift: str | None = None, size: int | None = 2, **kw):
    toks = dict(prompt_token_ids=[[1, 2], [3]], token_ids=[[4 + sample], [5]], tokens_source="server-exact", token_drift=drift)
    return EpisodeRecord(
        run_name="r",
        task_id=task,
        sample=sample,
        group_id=group,
        group_size=size,
        status=kw.pop("status", "ok"),
        reward=kw.pop("reward", float(sample % 2)),
        **(toks if tokens else {}),
        **kw,
    )


def _commit_groups(run_dir: Path, n: int, **kw) -> WorkQueue:
    q = WorkQueue(run_dir).init()
    q.enqueue_epoch([f"t{i}" for i in range(n)], 2)
    for _ in range(n):
        lease = q.claim("w")
        u = lease.unit
        q.commit(lease, records_to_table([_rec(u.task_id, u.sample_index(i), u.group_id, **kw) for i in range(2)]))
    return q


def test_compaction_keeps_every_stream_slot_and_a_gap_is_an_error(tmp_path: Path) -> None:
    _commit_groups(tmp_path, 6)
    rs = RunStore(tmp_path)
    rs.write([_rec("batch", s, "batch@i1") for s in range(2)])  # a later batch run's own shards
    rs.write([_rec("batch", s, "batch@i2") for s in range(2, 4)])
    with RolloutStream(tmp_path, "tr") as s:
        assert len(s.next_batch(3, timeout_s=1)) == 3
        s.commit()
    res = rs.compact(target_rows=1000)
    assert res.inputs == 2  # positive control: the compactor did merge the batch shards
    assert all((tmp_path / slot_name(i)).exists() for i in range(6))
    with RolloutStream(tmp_path, "tr") as s:  # a consumer at cursor 3 reads on
        assert [g.seq for g in s.next_batch(3, timeout_s=1)] == [3, 4, 5]
    assert rs.summary().units == 16  # the store still reads every record once
    (tmp_path / slot_name(1)).unlink()  # a slot removed by hand (or an older compactor)
    got: list[BaseException] = []

    def read() -> None:
        try:
            with RolloutStream(tmp_path, "late") as s2:
                s2.next_batch(6, timeout_s=None)
        except BaseException as e:  # noqa: BLE001 - what the reader ended with is the result
            got.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "next_batch(timeout_s=None) waits forever on a missing slot"
    assert len(got) == 1 and isinstance(got[0], UserError) and "part-s0000000001" in str(got[0])


def test_continuous_restart_with_other_samples_never_reuses_a_unit_key(tmp_path: Path) -> None:
    q = WorkQueue(tmp_path).init()
    keys: list[tuple[str, int]] = []
    for samples in (2, 1, 3):  # three controller sessions, each with its own samples
        q.enqueue_epoch(["a", "b"], samples)
        while (lease := q.claim("w")) is not None:
            keys += [(lease.unit.task_id, lease.unit.sample_index(i)) for i in range(lease.unit.samples)]
            q.commit(lease, records_to_table([_rec(lease.unit.task_id, 0, lease.unit.group_id)]))
    assert len(keys) == 2 * (2 + 1 + 3) and len(set(keys)) == len(keys)


def test_stream_drops_groups_without_exact_tokens_and_counts_them(tmp_path: Path) -> None:
    q = WorkQueue(tmp_path).init()
    q.enqueue_epoch(["good", "drift", "none"], 2)
    for _ in range(3):
        lease = q.claim("w")
        u = lease.unit
        kw = {"drift": "turn 1"} if u.task_id == "drift" else {"tokens": False} if u.task_id == "none" else {}
        q.commit(lease, records_to_table([_rec(u.task_id, u.sample_index(i), u.group_id, **kw) for i in range(2)]))
    with RolloutStream(tmp_path, "tr") as s:
        got = s.next_batch(3, timeout_s=1)
        assert [g.task_id for g in got] == ["good"] and all(r.has_tokens for r in got[0].records)
        assert s.counts["delivered"] == 1 and s.counts["discarded_no_tokens"] == 2 and s.next_seq == 3
        s.commit()
        assert s.stats()["telemetry"]["calls"] == 1
    with RolloutStream(tmp_path, "eval") as s:  # asked for: evaluation may read them all
        assert len(s.next_batch(3, timeout_s=1, require_tokens=False)) == 3
    g = RunStore(tmp_path).summary().groups
    assert g is not None and (g.total, g.complete, g.without_tokens, g.trainable) == (3, 3, 2, 1)


def _batch_cfg(tmp_path: Path, samples: int, **extra):
    from et_hpc.runner.config import RunConfig

    return RunConfig.model_validate(
        {"name": "b", "store": str(tmp_path / "store"), "samples": samples, "unit_runner": "helpers.units:work_runner", **extra}
    )


def _tasks(tmp_path: Path):
    from helpers.units import make_tasks

    return make_tasks(tmp_path, 2)


def _plan(cfg, tasks):
    from et_hpc.runner.plan import make_plan
    from helpers.units import image_lookup

    return make_plan(cfg, tasks=tasks, image_lookup=image_lookup)


def test_extending_a_batch_run_makes_new_groups(tmp_path: Path) -> None:
    from et_hpc.runner.local import run_local

    tasks = _tasks(tmp_path)
    for samples in (2, 3):
        plan = _plan(_batch_cfg(tmp_path, samples), tasks)
        assert len(plan.units) == (4 if samples == 2 else 2)
        run_local(plan, progress=False, handle_signals=False)
    rs = RunStore(tmp_path / "store" / "b")
    _, groups = rs.groups()
    assert sorted(len(g.rows) for g in groups) == [1, 1, 2, 2]  # 2 samples, then the 3rd in a group of its own
    assert all(not g.incomplete for g in groups) and len({g.group_id for g in groups}) == 4
    assert rs.summary().planned_units == 6
    plan = _plan(_batch_cfg(tmp_path, 3), tasks)
    assert plan.units == []  # a rerun: nothing to do


def test_an_interrupted_batch_group_is_incomplete_and_not_exported(tmp_path: Path) -> None:
    from et_hpc.runner.local import run_local
    from et_hpc.runs.export import export_atropos

    tasks = _tasks(tmp_path)[:1]
    cfg = _batch_cfg(tmp_path, 4, concurrency=1)
    plan = _plan(cfg, tasks)
    stop = threading.Event()
    from et_hpc.runner.plan import rec_get

    def runner(task, sample, cfg, image, stop_ev):  # the run is stopped after its 3rd episode
        from helpers.units import make_record

        if sample == 2:
            stop.set()
        return make_record(cfg, task, sample, "ok", reward=float(sample % 2), prompt_token_ids=[[1]], token_ids=[[2]])

    run_local(plan, runner, stop=stop, progress=False, handle_signals=False)
    rs = RunStore(tmp_path / "store" / "b")
    recs = rs.records()
    assert len(recs) == 3 and {rec_get(r, "group_size") for r in recs} == {4}
    g = rs.summary().groups
    assert g is not None and (g.total, g.incomplete, g.complete, g.trainable) == (1, 1, 0, 0)
    res = export_atropos(rs, tmp_path / "a.jsonl", drop_zero_variance=False)
    assert res.groups == 0 and res.counts.dropped_incomplete == 1
    # positive control: the same three records as a group of 3 are exported
    from datetime import datetime, timezone

    now = datetime.now(timezone.utc)
    rs.write([r.model_copy(update={"group_size": 3, "episode_id": r.episode_id + "x", "created_at": now}) for r in recs])
    assert export_atropos(rs, tmp_path / "b.jsonl", drop_zero_variance=False).groups == 1


def test_reward_rule_is_recorded_and_applied_everywhere(tmp_path: Path) -> None:
    from et_hpc.runner.local import run_local
    from et_hpc.runner.plan import read_run_json

    tasks = _tasks(tmp_path)[:1]

    def runner(task, sample, cfg, image, stop_ev):
        from helpers.units import make_record

        return make_record(cfg, task, sample, "ok", reward=0.0, passed=3, total=4)

    for rule, reward in (("binary", 0.0), ("fraction", 0.75)):
        cfg = _batch_cfg(tmp_path, 1, name=f"b-{rule}", reward=rule)
        plan = _plan(cfg, tasks)
        run_local(plan, runner, progress=False, handle_signals=False)
        rs = RunStore(tmp_path / "store" / f"b-{rule}")
        assert [(r.reward_rule, r.reward) for r in rs.records()] == [(rule, reward)]
        assert read_run_json(rs.path)["config"]["reward"] == rule
        assert rs.summary().groups.reward_rules == [rule]


def test_export_can_leave_out_groups_atropos_cancelled(tmp_path: Path) -> None:
    from et_hpc.runs.export import export_atropos, export_skyrl

    rs = RunStore(tmp_path / "env")
    rs.write([_rec("t", s, "t@wa-s0", reward_rule="binary") for s in range(2)])
    rs.write([_rec("t", s, "t@wa-s2", reward_rule="binary", events=[CANCELLED_EVENT]) for s in range(2, 4)])
    assert export_atropos(rs, tmp_path / "all.jsonl").groups == 2  # kept unless asked
    res = export_atropos(rs, tmp_path / "a.jsonl", exclude_cancelled=True)
    assert res.groups == 1 and res.counts.dropped_cancelled == 1 and res.counts.cancelled == 1
    assert "reward rule binary" in res.line()
    sk = export_skyrl(rs, tmp_path / "s.parquet", exclude_cancelled=True)
    assert sk.rows == 2
    import pyarrow.parquet as pq

    assert {x["reward_rule"] for x in pq.read_table(tmp_path / "s.parquet").column("extra_info").to_pylist()} == {"binary"}


def test_compact_cli_keeps_slots(tmp_path: Path) -> None:
    from et_hpc.cli import main

    _commit_groups(tmp_path, 3)
    RunStore(tmp_path).write([_rec("x", 0, "x@i1")])
    RunStore(tmp_path).write([_rec("x", 1, "x@i1")])
    assert main(["store", "compact", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.glob("part-s*.parquet")) == [slot_name(i) for i in range(3)]
    with pytest.raises(UserError, match="on_error"):
        RolloutStream(tmp_path, "x").next_batch(1, timeout_s=0, on_error="bad")
