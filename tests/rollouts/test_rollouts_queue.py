"""The continuous run's work queue and stream on a real filesystem, with real processes racing.

Claims (rename) under contention, lease expiry and the fencing of a cut-off worker, publication
that a crash at any step cannot lose or duplicate, and the stream's persistent cursor.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from collections import Counter
from pathlib import Path

import pytest

from et_hpc.errors import UserError
from et_hpc.record import EpisodeRecord, records_to_table
from et_hpc.rollouts import RolloutStream, publish_version, read_version
from et_hpc.rollouts.queue import WorkQueue, slot_name
from et_hpc.rollouts.versions import VersionReader


def _table(task: str, epoch: int, version: str | None = None, statuses=("ok", "ok")):
    recs = [
        EpisodeRecord(
            run_name="r",
            task_id=task,
            sample=epoch * len(statuses) + i,
            group_id=f"{task}@e{epoch}",
            status=s,
            reward=1.0 if s == "ok" else None,
            policy_version=version,
            prompt_token_ids=[[1], [2]],
            token_ids=[[3], [4]],
        )
        for i, s in enumerate(statuses)
    ]
    return records_to_table(recs)


def _claimer(run_dir: str, out: str, start) -> None:
    q = WorkQueue(run_dir)
    got = []
    start.wait(60)  # every claimer has imported and is ready: they start together
    while (lease := q.claim(f"w{os.getpid()}")) is not None:
        got.append(lease.unit.uid)
        time.sleep(0.002)  # a worker does something with its unit before the next claim
    Path(out).write_text(json.dumps(got))


def test_racing_claimers_take_each_unit_once(tmp_path: Path) -> None:
    q = WorkQueue(tmp_path).init()
    tasks = [f"t{i}" for i in range(50)]
    for _ in range(4):
        q.enqueue_epoch(tasks, samples=2)
    assert q.count()["pending"] == 200
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(6)
    procs = [ctx.Process(target=_claimer, args=(str(tmp_path), str(tmp_path / f"got{i}.json"), start)) for i in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    got = [u for i in range(6) for u in json.loads((tmp_path / f"got{i}.json").read_text())]
    assert len(got) == 200 and len(set(got)) == 200
    assert sum(1 for i in range(6) if json.loads((tmp_path / f"got{i}.json").read_text())) >= 2  # they raced
    c = q.count()
    assert c == {"pending": 0, "leased": 200, "done": 0}


def test_epochs_reshuffle_and_have_unique_ids(tmp_path: Path) -> None:
    q = WorkQueue(tmp_path).init()
    tasks = [f"t{i}" for i in range(20)]
    e0, e1 = q.enqueue_epoch(tasks, 4, seed=7), q.enqueue_epoch(tasks, 4, seed=7)
    assert (e0, e1) == (0, 1)
    units = [json.loads((q.pending / n).read_text()) for n in q.pending_names()]
    order0 = [u["task_id"] for u in units if u["epoch"] == 0]
    order1 = [u["task_id"] for u in units if u["epoch"] == 1]
    assert sorted(order0) == sorted(order1) == sorted(tasks) and order0 != order1
    assert len({u["uid"] for u in units}) == 40


def test_controller_crash_mid_epoch_is_repaired_without_duplicates(tmp_path: Path) -> None:
    q = WorkQueue(tmp_path).init()
    tasks = [f"t{i}" for i in range(10)]
    q.enqueue_epoch(tasks, 2)
    # the controller died while writing epoch 1: it marked the epoch, wrote 3 units, one was claimed
    q.write_state({"next_epoch": 1, "enqueuing": 1, "samples": 2})
    for n in q.pending_names()[:3]:
        (q.pending / n.replace("e000000", "e000001")).write_text(
            (q.pending / n).read_text().replace('"epoch":0', '"epoch":1').replace("e000000", "e000001")
        )
    lease = q.claim("w")
    assert lease is not None
    before = q.count()["pending"] + q.count()["leased"]
    assert before == 13
    assert q.enqueue_epoch(tasks, 2) == 1  # repairs epoch 1
    assert q.count()["pending"] + q.count()["leased"] == 20
    assert q.read_state() == {"next_epoch": 2, "enqueuing": None, "samples": 2, "tasks": 10}


def test_expired_lease_requeued_and_the_cut_off_worker_cannot_commit(tmp_path: Path) -> None:
    q = WorkQueue(tmp_path, lease_s=30).init()
    q.enqueue_epoch(["a", "b"], 2)
    slow = q.claim("slow")
    other = q.claim("other")
    assert slow and other
    # positive control: a live lease commits
    assert q.commit(other, _table(other.unit.task_id, 0)) == 0
    # 'slow' misses its heartbeats: a sweep from elsewhere requeues its unit
    assert q.sweep(now=time.time() + 10)["requeued"] == 0  # not yet expired
    assert q.sweep(now=time.time() + 31)["requeued"] == 1
    assert not q.heartbeat(slow)  # slow learns it lost the lease
    fresh = q.claim("fresh")
    assert fresh and fresh.unit.uid == slow.unit.uid
    assert q.commit(slow, _table(slow.unit.task_id, 0)) is None  # fenced: its records are discarded
    assert q.commit(fresh, _table(fresh.unit.task_id, 0)) == 1
    assert q.count() == {"pending": 0, "leased": 0, "done": 2}
    assert q.published() == 2 and not (tmp_path / slot_name(2)).exists()
    assert not os.listdir(q.results)


def test_publication_survives_a_crash_at_every_step(tmp_path: Path) -> None:
    q = WorkQueue(tmp_path, lease_s=5, grace_s=1).init()
    q.enqueue_epoch(["a", "b", "c"], 2)
    leases = [q.claim("w") for _ in range(3)]
    old = time.time() - 10

    def commit_only(lease):  # crashed after the commit rename, before publishing
        res = q.results_path(lease)
        import pyarrow.parquet as pq

        pq.write_table(_table(lease.unit.task_id, 0), res)
        os.rename(lease.path, q.done / f"{lease.unit.uid}~{lease.attempt}.json")
        os.utime(res, (old, old))
        return res

    r0 = commit_only(leases[0])
    # crashed after taking the results file (rename), before linking it
    r1 = commit_only(leases[1])
    t1 = r1.with_name(r1.name + ".take-dead0001")
    os.rename(r1, t1)
    # crashed after linking into a slot, before dropping its take name
    r2 = commit_only(leases[2])
    t2 = r2.with_name(r2.name + ".take-dead0002")
    os.rename(r2, t2)
    os.link(t2, tmp_path / slot_name(0))
    q.write_head(1)
    assert q.published() == 1
    # two sweepers at once (processes) finish the job: each committed group lands in one slot
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_sweep, args=(str(tmp_path),)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert q.published() == 3
    groups = [
        json.dumps(
            sorted(set(__import__("pyarrow.parquet", fromlist=["x"]).read_table(tmp_path / slot_name(s)).column("group_id").to_pylist()))
        )
        for s in range(3)
    ]
    assert len(set(groups)) == 3
    assert not (tmp_path / slot_name(3)).exists()
    assert not os.listdir(q.results)
    assert r0.name and not r0.exists()


def _sweep(run_dir: str) -> None:
    WorkQueue(run_dir, lease_s=5, grace_s=1).sweep()


def test_stream_cursor_is_exactly_once_across_restarts(tmp_path: Path) -> None:
    q = WorkQueue(tmp_path).init()
    q.enqueue_epoch([f"t{i}" for i in range(6)], 2)
    for _ in range(6):
        lease = q.claim("w")
        q.commit(lease, _table(lease.unit.task_id, 0))
    s = RolloutStream(tmp_path, "tr")
    with pytest.raises(UserError, match="another process"):
        RolloutStream(tmp_path, "tr")
    b1 = s.next_batch(2, timeout_s=1)
    s.commit({"step": 1})
    b2 = s.next_batch(2, timeout_s=1)  # got, not committed: a crash now redelivers it
    s.close()
    s = RolloutStream(tmp_path, "tr")
    assert s.state == {"step": 1} and s.next_seq == 2
    b2again = s.next_batch(2, timeout_s=1)
    assert [g.seq for g in b1] == [0, 1] and [g.seq for g in b2] == [g.seq for g in b2again] == [2, 3]
    b3 = s.next_batch(5, timeout_s=0.5)  # auto-commits b2 first; only 2 left
    assert [g.seq for g in b3] == [4, 5]
    s.close()
    s = RolloutStream(tmp_path, "tr")
    assert s.next_seq == 4  # b3 was not committed
    other = RolloutStream(tmp_path, "eval")  # a second consumer has its own cursor
    assert [g.seq for g in other.next_batch(6, timeout_s=1)] == list(range(6))
    assert all(len(g.records) == 2 and g.rewards == [1.0, 1.0] for g in b1)


def test_stream_staleness_and_masking_are_counted(tmp_path: Path) -> None:
    q = WorkQueue(tmp_path).init()
    q.enqueue_epoch(["a", "b", "c", "d"], 2)
    for v in (1, 2, 3):
        publish_version(tmp_path, v)
    for version, statuses in (("1", ("ok", "ok")), ("2", ("ok", "ok")), ("3", ("ok", "infra_error")), ("3", ("ok", "ok"))):
        lease = q.claim("w")
        q.commit(lease, _table(lease.unit.task_id, 0, version, statuses))
    s = RolloutStream(tmp_path, "tr")
    got = s.next_batch(4, timeout_s=0.5, max_staleness=1)
    assert [g.policy_version for g in got] == ["2", "3"]
    assert s.counts == {"delivered": 2, "discarded_stale": 1, "discarded_masked": 1, "discarded_incomplete": 0, "discarded_no_tokens": 0}
    s2 = RolloutStream(tmp_path, "keep")
    got2 = s2.next_batch(4, timeout_s=0.5, on_error="keep-ok")
    assert [len(g.records) for g in got2] == [2, 2, 1, 2]


def test_versions_only_go_up_and_the_reader_sees_changes(tmp_path: Path) -> None:
    r = VersionReader(tmp_path)
    assert r.current() is None and read_version(tmp_path) is None
    assert publish_version(tmp_path).version == 1
    assert r.current().version == 1
    publish_version(tmp_path, model="ckpt-5")
    assert r.current().version == 2 and r.current().model == "ckpt-5"
    with pytest.raises(UserError, match="only go up"):
        publish_version(tmp_path, 1)
    # the trainer's file, the version log and its lock; no temp file left behind
    assert Counter(p.name for p in tmp_path.iterdir()) == Counter({"version.json": 1, "versions.jsonl": 1, ".versions.jsonl.lock": 1})


def test_scored_data_never_holds_absent_or_drifted_tokens(tmp_path: Path) -> None:
    from et_hpc.rollouts.stream import RolloutGroup

    def rec(sample: int, drift: str | None = None, tokens: bool = True) -> EpisodeRecord:
        kw = (
            dict(prompt_token_ids=[[1, 2], [3]], token_ids=[[4 + sample], [5]], tokens_source="server-exact", token_drift=drift)
            if tokens
            else {}
        )
        return EpisodeRecord(run_name="r", task_id="t", sample=sample, group_id="t@e0", status="ok", reward=float(sample), **kw)

    good = RolloutGroup(seq=0, group_id="t@e0", task_id="t", policy_version=None, records=[rec(0), rec(1)], committed_at=0.0)
    d = good.scored_data()  # positive control: a group with exact tokens is all there
    assert d["tokens"] == [[1, 2, 4, 3, 5], [1, 2, 5, 3, 5]] and d["dropped_no_tokens"] == 0 and d["group_id"] == "t@e0"
    for bad in ([rec(0), rec(1, drift="turn 1 position 0")], [rec(0), rec(1, tokens=False)]):
        d = RolloutGroup(seq=1, group_id="t@e1", task_id="t", policy_version=None, records=bad, committed_at=0.0).scored_data()
        assert d["tokens"] == [] and d["scores"] == [] and d["dropped_no_tokens"] == 1


@pytest.mark.parametrize(
    "label",
    [
        lambda n: f"/ck/step-{n}@step-{n}",  # vllm.sbatch --checkpoint-dir with steps
        lambda n: f"policy@sha256-{n:016x}",  # et-hpc model serve: a content hash, no step
        lambda n: f"/ck/final@files-{(n * 7919) % 65536:04x}",  # vllm.sbatch without a step
    ],
    ids=["step", "sha256", "files"],
)
def test_abandon_follows_the_servers_publishes(tmp_path: Path, label) -> None:
    """on_version_change: abandon with the server owning the switch: the worker appends each
    model_version its endpoint file shows to the run's version log; a unit is requeued once the
    served version moved more than max_staleness publishes past its own, whatever the label's kind,
    and restarts under the new one (a real worker, queue and unit runner; no model is called)."""
    import threading

    from et_hpc.agent.endpoint import endpoint_record, write_endpoint_file
    from et_hpc.agent.policies import PolicyConfig
    from et_hpc.rollouts.worker import Worker
    from et_hpc.runner.config import ContinuousConfig, RunConfig
    from helpers.units import make_tasks

    tasks = make_tasks(tmp_path / "t", 1, sleep_s=30)  # long enough to be abandoned
    log_dir = tmp_path / "t" / "log"
    ep_dir = tmp_path / "private"
    ep_dir.mkdir(mode=0o700)
    ep = ep_dir / "endpoint.json"

    def serve(step: int) -> None:
        write_endpoint_file(ep, endpoint_record("127.0.0.1", 9, "policy", model_version=label(step)))

    serve(10)
    cfg = RunConfig(
        name="ab",
        store=tmp_path / "store",
        samples=1,
        unit_runner="helpers.units:work_runner",
        policy=PolicyConfig(kind="openai", endpoint_file=ep),
        continuous=ContinuousConfig(on_version_change="abandon", max_staleness=1, heartbeat_s=0.2, poll_s=0.2, lease_s=30),
    )
    run_dir = cfg.run_dir()
    q = WorkQueue(run_dir).init()
    q.enqueue_epoch([tasks[0].id], 1)
    w = Worker(cfg, run_dir, {t.id: t for t in tasks}, {t.id: None for t in tasks}, concurrency=1)
    stop = threading.Event()
    th = threading.Thread(target=w.run, args=(stop,), daemon=True)
    th.start()
    try:
        deadline = time.monotonic() + 60
        while not (log_dir / "starts.log").exists():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        serve(11)  # one step behind: within max_staleness, the unit keeps running
        time.sleep(1.5)
        assert w.stats.abandoned == 0
        (log_dir / "fast").touch()  # the next start of the unit finishes at once
        serve(12)  # two steps past its start (10): abandoned, requeued, redone under step 12
        while q.published() < 1:
            assert time.monotonic() < deadline, w.stats.as_dict()
            time.sleep(0.1)
    finally:
        stop.set()
        th.join(30)
    assert w.stats.abandoned == 1 and w.stats.committed == 1
    from et_hpc.runs.version_log import VersionLog

    assert [e.label for e in VersionLog(run_dir).entries()] == [label(10), label(11), label(12)]
    assert len((log_dir / "starts.log").read_text().splitlines()) == 2
