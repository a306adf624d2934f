"""The run's version log orders every label kind by publication, and the stream's staleness bound
holds for all of them.

A hypothesis property publishes random sequences of labels of every kind through the real paths
(an endpoint file the reader observes, ``publish_version``), commits one group per label into a
real work queue in random order, and checks that ``RolloutStream.next_batch(max_staleness=k)``
delivers exactly the groups at most k publishes behind, refuses labels never published, and that
places follow the publish order. Appends from many processes at once lose nothing.
"""

from __future__ import annotations

import multiprocessing
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from et_hpc.agent.endpoint import endpoint_record, write_endpoint_file
from et_hpc.errors import UserError
from et_hpc.record import EpisodeRecord, records_to_table
from et_hpc.rollouts import RolloutStream, publish_version
from et_hpc.rollouts.queue import WorkQueue
from et_hpc.rollouts.versions import VersionReader
from et_hpc.runs.version_log import SERVER, TRAINER, VersionLog

HEX = "0123456789abcdef"

# every kind of label a server publishes: a step, a content hash, a checkpoint without a step, an
# alias (a plain model name), an integer written by a server
SERVER_LABEL = st.one_of(
    st.integers(0, 10**6).map(lambda n: f"/ck/step-{n}@step-{n}"),
    st.text(HEX, min_size=16, max_size=16).map(lambda h: f"SmolLM2@sha256-{h}"),
    st.text(HEX, min_size=16, max_size=16).map(lambda h: f"/ck/final@files-{h}"),
    st.sampled_from(["policy", "Qwen/Qwen3-8B", "lora-a", "lora-b"]),
    st.integers(0, 10**6).map(str),
)


def _group(q: WorkQueue, label: str | None) -> None:
    lease = q.claim("w")
    assert lease is not None
    recs = [
        EpisodeRecord(
            run_name="r",
            task_id=lease.unit.task_id,
            sample=i,
            group_id=lease.unit.group_id,
            status="ok",
            reward=1.0,
            policy_version=label,
            prompt_token_ids=[[1], [2]],  # exact tokens: the stream hands out only trainable groups
            token_ids=[[3], [4]],
        )
        for i in range(2)
    ]
    q.commit(lease, records_to_table(recs))


def _publish_server(ep: Path, reader: VersionReader, label: str) -> None:
    write_endpoint_file(ep, endpoint_record("127.0.0.1", 9, "policy", model_version=label))
    reader.current()  # a watcher (worker, stream) sees the file


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    server=st.lists(SERVER_LABEL, max_size=6),
    trainer=st.lists(st.integers(1, 3), max_size=4),  # increments of the trainer's integers
    k=st.integers(0, 4),
    order=st.randoms(use_true_random=False),
)
@example(server=["5", "policy"], trainer=[2, 3], k=0, order=__import__("random").Random(0))  # a trainer label a server holds
def test_staleness_follows_publish_order_for_every_label_kind(server: list[str], trainer: list[int], k: int, order) -> None:
    with tempfile.TemporaryDirectory() as d:
        run, ep = Path(d) / "run", Path(d) / "private" / "endpoint.json"
        reader = VersionReader(run, endpoint_file=ep)
        published: list[str] = []  # distinct labels, in the order they were first published
        for label in server:
            _publish_server(ep, reader, label)
            published += [label] if label not in published else []
        n = 0
        for inc in trainer:
            n += inc
            if str(n) in published:  # a server published that very label: the trainer's is refused
                with pytest.raises(UserError, match="already in"):
                    publish_version(run, n)
                continue
            publish_version(run, n)
            published += [str(n)]
        if (
            any(lab.isdigit() and lab not in server for lab in published) and server
        ):  # trainer-owned from now on: a server's new label is not a version of this run
            _publish_server(ep, reader, "late@sha256-ffffffffffffffff")
        log = VersionLog(run)
        assert [e.label for e in log.entries()] == published
        assert [e.pos for e in log.entries()] == list(range(1, len(published) + 1))
        assert log.owner() == (TRAINER if any(e.source == TRAINER for e in log.entries()) else SERVER if server else None)
        never = "never@sha256-0000000000000000"  # a label no one published
        labels = [*published, never]
        order.shuffle(labels)
        q = WorkQueue(run).init()
        q.enqueue_epoch([f"t{i}" for i in range(len(labels))], 2)
        for label in labels:
            _group(q, label)
        with RolloutStream(run, "tr", endpoint_file=ep) as s:
            got = s.next_batch(len(labels), timeout_s=0.05, max_staleness=k)
        newest = len(published)
        want = [lab for lab in labels if lab in published and newest - (published.index(lab) + 1) <= k] if published else labels
        assert [g.policy_version for g in got] == want
        for g in got:  # the bound, and places that are publish order
            assert g.position == (published.index(g.policy_version) + 1 if published else None)
            assert not published or newest - g.position <= k
        assert s.counts["discarded_stale"] == len(labels) - len(want)


def test_a_label_that_cannot_be_placed_is_refused_with_a_warning(tmp_path: Path, caplog) -> None:
    q = WorkQueue(tmp_path).init()
    q.enqueue_epoch(["a", "b"], 2)
    publish_version(tmp_path)
    _group(q, "1")  # positive control: the published version is delivered
    _group(q, "policy@sha256-0123456789abcdef")  # never in this run's log
    with RolloutStream(tmp_path, "tr") as s:
        got = s.next_batch(2, timeout_s=0.2, max_staleness=100)
    assert [g.policy_version for g in got] == ["1"] and s.counts["discarded_stale"] == 1
    assert "cannot be placed" in caplog.text and "policy@sha256-0123456789abcdef" in caplog.text


def test_run_json_says_who_owns_the_versions(tmp_path: Path) -> None:
    from et_hpc.agent.policies import PolicyConfig
    from et_hpc.runner.config import RunConfig
    from et_hpc.runner.plan import read_run_json, save_run_json

    ep = tmp_path / "ep.json"
    cfg = RunConfig(name="v", store=tmp_path / "store", policy=PolicyConfig(kind="openai", endpoint_file=ep))
    run = cfg.run_dir()
    save_run_json(cfg, run, {})
    assert read_run_json(run)["versions"] == {"log": "versions.jsonl", "source": "server"}
    publish_version(run)  # the trainer takes over the switch
    assert read_run_json(run)["versions"] == {"log": "versions.jsonl", "source": "trainer"}
    save_run_json(cfg, run, {})  # a rerun of the config keeps what the log says
    assert read_run_json(run)["versions"]["source"] == "trainer"
    with pytest.raises(UserError, match="only go up"):
        publish_version(run, 0)


def _append_many(run: str, who: int, n: int) -> None:
    log = VersionLog(run)
    for i in range(n):
        log.append(f"w{who}@sha256-{i:016x}", source=SERVER, by=f"writer {who}")


def test_appends_from_many_processes_lose_nothing(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_append_many, args=(str(tmp_path), w, 15)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    es = VersionLog(tmp_path).entries()
    assert sorted(e.label for e in es) == sorted(f"w{w}@sha256-{i:016x}" for w in range(4) for i in range(15))
    assert [e.pos for e in es] == list(range(1, 61))
    for w in range(4):  # each writer's labels keep its order
        mine = [e.label for e in es if e.by == f"writer {w}"]
        assert mine == [f"w{w}@sha256-{i:016x}" for i in range(15)]
