"""Policy versions end to end: ``slurm/vllm.sbatch`` serving a checkpoint directory (the scripted
server standing in for vLLM), a checkpoint switch in the middle of an ``et-hpc run`` on the demo
task's real image, and the store: two policy_versions, and the episode whose turns straddled the
switch flagged ``crossed_version``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from helpers import REPO
from helpers.demo import DEMO, SOLVE, TASK
from helpers.servers import vllm_shim, wait_for


def test_version_fields_from_turns() -> None:
    from et_hpc.episode.run import policy_version_fields

    class P:
        start_version = "a"
        turn_versions: list = []

    p = P()
    assert policy_version_fields(p) == {
        "policy_version": "a",
        "policy_versions": ["a"],
        "crossed_version": False,
        "version_source": "endpoint",
    }
    p.turn_versions = [("a", "a"), ("a", "b"), ("b", "b")]  # the second request straddled the switch
    assert policy_version_fields(p) == {
        "policy_version": "a",
        "policy_versions": ["a", "b"],
        "crossed_version": True,
        "version_source": "endpoint",
    }
    p.turn_versions = [("b", "b")]  # switched between the policy's start and its first turn: not crossed
    assert policy_version_fields(p)["crossed_version"] is False
    p.start_version, p.turn_versions = None, []
    assert policy_version_fields(p) == {}  # no endpoint file, or a server that names no version
    p.turn_versions, p.version_sources = [("a", "a"), ("b", "b")], ["endpoint", "response"]
    assert policy_version_fields(p)["version_source"] == "mixed"


def test_switch_mid_run_is_recorded(demo_image, tmp_path: Path) -> None:
    # the first command leaves the server time to see the new pointer and restart (1 s polls; more under load)
    script = {"greeting.txt": [{"command": "sleep 8"}, {"command": SOLVE}, "All done."]}
    shim = vllm_shim(tmp_path, script, log_requests=True)
    ckpts = tmp_path / "ckpts"
    for step in (10, 20):
        (ckpts / f"step-{step}").mkdir(parents=True)
        (ckpts / f"step-{step}" / "model.safetensors").write_text(f"weights {step}")
    (ckpts / "latest").write_text("step-10 10\n")
    ep = tmp_path / "private" / "endpoint.json"
    env = dict(os.environ, VLLM=str(shim), POLL_S="1", HEALTH_EVERY_S="1")
    server = subprocess.Popen(
        ["bash", str(REPO / "slurm" / "vllm.sbatch"), "--checkpoint-dir", str(ckpts), "policy", str(ep)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out: list[str] = []
    switched = threading.Event()

    def follow() -> None:  # the trainer: a new checkpoint once the second episode has had its first turn
        firsts = 0
        for line in server.stdout:
            out.append(line)
            if line.startswith("served chat turn=0"):
                firsts += 1
                if firsts == 2 and not switched.is_set():
                    (ckpts / ".latest").write_text("step-20 20\n")
                    (ckpts / ".latest").rename(ckpts / "latest")
                    switched.set()

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    try:
        wait_for(ep.exists, server, "the endpoint file")
        cmd = [
            sys.executable,
            "-m",
            "et_hpc.cli",
            "run",
            str(DEMO),
            "--set",
            f"tasks.ids=[{TASK}]",
            "--run-name",
            "switch",
            "--store",
            str(tmp_path / "store"),
            "--samples",
            "3",
            "--concurrency",
            "1",
            "--json",
            "--set",
            "policy.kind=openai",
            "--set",
            f"policy.endpoint_file={ep}",
            "--set",
            "policy.endpoint_wait_s=60",
            "--set",
            "policy.backoff_base_s=0.2",
            "--set",
            "policy.backoff_max_s=1",
            "--set",
            "policy.max_retries=20",
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        reader.join(timeout=10)
    log = "".join(out)
    assert switched.is_set() and "switched (restart)" in log, log

    from et_hpc.runs.store import open_run

    recs = sorted(open_run(tmp_path / "store" / "switch").records(), key=lambda x: x.timings.start_s)
    a, b = f"{ckpts}/step-10@step-10", f"{ckpts}/step-20@step-20"
    assert len(recs) == 3 and all(x.status == "ok" and x.reward == 1.0 for x in recs), [(x.status, x.error) for x in recs]
    assert {x.policy_version for x in recs} == {a, b}  # two versions in the store
    first, second, third = recs
    assert first.policy_versions == [a] and first.crossed_version is False
    assert second.policy_version == a and second.policy_versions == [a, b] and second.crossed_version is True
    assert third.policy_versions == [b] and third.crossed_version is False
    assert {x.version_source for x in recs} == {"response"}  # every turn named by the weights that answered it
    import pyarrow.parquet as pq

    table = pq.read_table(sorted((tmp_path / "store" / "switch").glob("part-*.parquet")))
    assert sorted(table.column("crossed_version").to_pylist()) == [False, False, True]  # on disk too


def test_version_ids_order_both_sources() -> None:
    from et_hpc.rollouts.versions import version_step

    assert version_step("3") == 3 and version_step(7) == 7
    assert version_step("/ck/step-20@step-20") == 20 and version_step("/ck/step-9@step-9") == 9  # not by text
    assert version_step("switching /ck/a@step-10 -> /ck/b@step-20") == 10  # mid-switch: the older step
    assert version_step("switching /ck/a@files-ab12 -> /ck/b@step-20") is None  # the older one had none
    assert version_step("/ck/b@files-0123abcd") is None and version_step("Qwen/Qwen3-8B") is None
    assert version_step(None) is None


@pytest.mark.parametrize("with_step", [True, False], ids=["step", "files-hash"])
def test_max_staleness_counts_publishes_of_the_checkpoint_dir(tmp_path: Path, with_step: bool) -> None:
    """Groups stamped with vllm.sbatch's model_version: the stream orders them by when the endpoint
    file (republished by vllm.sbatch --checkpoint-dir on each switch) showed them, with or without a
    step in the pointer (``PATH@files-HASH`` has none: it used to be kept whatever max_staleness)."""
    from et_hpc.record import EpisodeRecord, records_to_table
    from et_hpc.rollouts import RolloutStream
    from et_hpc.rollouts.queue import WorkQueue

    shim = vllm_shim(tmp_path, {"hi": ["hello"]})
    ckpts = tmp_path / "ckpts"
    for step in (8, 9, 10, 11):
        (ckpts / f"step-{step}").mkdir(parents=True)
        (ckpts / f"step-{step}" / "weights").write_text(f"w{step}\n")  # files-HASH differs per checkpoint

    def point(step: int) -> None:
        (ckpts / ".latest").write_text(f"step-{step} {step}\n" if with_step else f"step-{step}\n")
        (ckpts / ".latest").rename(ckpts / "latest")

    point(8)
    ep = tmp_path / "private" / "endpoint.json"
    server = subprocess.Popen(
        ["bash", str(REPO / "slurm" / "vllm.sbatch"), "--checkpoint-dir", str(ckpts), "policy", str(ep)],
        env=dict(os.environ, VLLM=str(shim), POLL_S="1", HEALTH_EVERY_S="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run = tmp_path / "run"
    label: dict[int, str] = {}

    def served() -> str | None:
        v = json.loads(ep.read_text()).get("model_version") if ep.exists() else None
        return v if v and f"step-{len(label) + 8}" in v and not v.startswith("switching") else None

    try:
        q = WorkQueue(run).init()
        q.enqueue_epoch(["a", "b", "c", "d"], 2)
        with RolloutStream(run, "tr", endpoint_file=ep) as s:
            for step in (8, 9, 10):  # each switch seen by the stream as it happens: the publish order
                if step != 8:
                    point(step)
                wait_for(lambda: served() is not None, server, f"step {step} served")
                label[step] = served()  # type: ignore[assignment]
                assert s.current_version().label == label[step]
            assert ("@step-" in label[8]) is with_step and ("@files-" in label[8]) is not with_step
            for step in (8, 9, 10, 9):  # committed in this order
                lease = q.claim("w")
                recs = [
                    EpisodeRecord(
                        run_name="run",
                        task_id=lease.unit.task_id,
                        sample=i,
                        group_id=lease.unit.group_id,
                        status="ok",
                        reward=float(i),
                        policy_version=label[step],
                        prompt_token_ids=[[1]],  # exact tokens: the stream hands out only trainable groups
                        token_ids=[[2]],
                    )
                    for i in range(2)
                ]
                q.commit(lease, records_to_table(recs))
            got = s.next_batch(2, timeout_s=1, max_staleness=1)
            assert [g.policy_version for g in got] == [label[9], label[10]] and s.counts["discarded_stale"] == 1  # 8: 2 behind
            assert [g.position for g in got] == [2, 3]
            point(11)
            wait_for(lambda: served() is not None, server, "the switch to 11")
            label[11] = served()  # type: ignore[assignment]
            assert s.current_version().label == label[11] and s.current_version().position == 4
            got = s.next_batch(2, timeout_s=1, max_staleness=1)
            assert got == [] and s.counts["discarded_stale"] == 2  # 9 is 2 behind 11 now
            assert s.telemetry["staleness"] == {"1": 1, "0": 1}
    finally:
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=60)


def test_trainer_versions_are_the_ones_current_while_each_episode_ran(tmp_path: Path) -> None:
    """Trainer-owned in-place switches (publish without a model): each episode carries the version
    current at its start plus those published before its end, whatever its group started under; an
    episode that starts after a publish belongs to the new version (it used to keep the group's)."""
    import time

    from et_hpc.record import EpisodeRecord, Timings
    from et_hpc.rollouts import publish_version
    from et_hpc.rollouts.queue import Lease, Unit
    from et_hpc.rollouts.versions import VersionReader
    from et_hpc.rollouts.worker import UNVERSIONED, Worker, _InFlight
    from et_hpc.runner.config import RunConfig

    run = tmp_path / "run"
    w = Worker.__new__(Worker)
    w.lock = threading.Lock()
    w.versions = VersionReader(run)
    w.cfg = RunConfig()  # the run's reward rule (binary) is applied with the tags
    unit = Unit(uid="e000000-000000", task_id="t", epoch=0, pos=0, samples=3)
    lease = Lease(unit=unit, attempt="x", path=Path("/nonexistent"))

    def rec(sample: int, t0: float, t1: float) -> EpisodeRecord:
        times = Timings(start_s=t0, stop_s=t1)
        return EpisodeRecord(
            run_name="r", task_id="t", sample=sample, status="ok", reward=1.0, policy_version="srv@sha256-0", timings=times
        )

    # no publish yet: the policy's own record is kept (server-owned)
    assert w._tag(rec(0, 1.0, 2.0), unit, _InFlight(lease=lease, start_version=None)).policy_version == "srv@sha256-0"
    v1 = publish_version(run)
    time.sleep(0.05)
    v2 = publish_version(run)
    t1, t2 = v1.published_at, v2.published_at
    # the group was claimed under version 1; version 2 was published at t2
    fl = _InFlight(lease=lease, start_version=v1)
    a, b, c = (
        w._tag(rec(i, x, y), unit, fl) for i, (x, y) in enumerate([(t1 + 0.01, t2 - 0.01), (t2 - 0.01, t2 + 1), (t2 + 0.01, t2 + 1)])
    )
    assert (a.policy_version, a.policy_versions, a.crossed_version) == ("1", ["1"], False)
    assert (b.policy_version, b.policy_versions, b.crossed_version) == ("1", ["1", "2"], True)
    assert (c.policy_version, c.policy_versions, c.crossed_version) == ("2", ["2"], False)  # started after the publish
    assert {r.version_source for r in (a, b, c)} == {"trainer"} and a.group_id == c.group_id == "t@e0"
    # every record: policy_version is the first of policy_versions, never an endpoint label beside trainer ones
    d = w._tag(rec(0, t1 - 10, t1 + 0.01), unit, _InFlight(lease=lease, start_version=None))
    assert d.policy_versions == [UNVERSIONED, "1"] and d.crossed_version is True and d.policy_version == UNVERSIONED
    for r in (a, b, c, d):
        assert r.policy_version == r.policy_versions[0]
    # a version that named its model (publish_version(model=...)): the unit asked for those weights throughout
    v3 = publish_version(run, model="ckpt-3")
    fl = _InFlight(lease=lease, start_version=v3)
    v4 = publish_version(run, model="ckpt-4")
    e = w._tag(rec(0, v4.published_at + 0.01, v4.published_at + 1), unit, fl)
    assert (e.policy_version, e.policy_versions, e.crossed_version) == ("3", ["3"], False)
    # a unit on the default model (claimed under in-place version 2): publishes naming a model do not
    # change its weights, so it stays on 2
    f = w._tag(rec(1, v4.published_at + 0.01, v4.published_at + 1), unit, _InFlight(lease=lease, start_version=v2))
    assert (f.policy_version, f.policy_versions, f.crossed_version) == ("2", ["2"], False)
