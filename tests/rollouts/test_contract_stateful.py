"""The trainer contract as one stateful property: hypothesis drives a run directory through batch
invocations (extended, interrupted), continuous groups (worker kills, logprobs asked or not),
version publishes of every label kind (server- and trainer-owned), two env-like writers,
compactions, and consumers that read (with or without ``max_staleness``), commit, die and restart.

Real parts: the parquet store and compactor, the work queue (claim, commit, lease expiry and
sweep), ``RolloutStream`` with its on-disk cursor, ``publish_version``, ``selected_groups`` (what
the exports write) and ``export_atropos``. Episodes are records shaped as the scripted server's
(exact token ids, logprobs), built in the test so a step takes milliseconds: no sandbox or model
runs. Checked after every step or read: each consumer gets exactly the trainable, fresh enough
streamed groups once, whole, with only their own members, in slot order; exports hold every
trainable group once; no group mixes versions unless its records say ``crossed_version``; the
version log holds the publishes in order; the staleness bound holds for every label kind
(``staleness_violations``); logprobs aligned with the ids whenever asked and returned; nothing
trainable lacks exact tokens. Fixed budget for CI (``derandomize``; hypothesis prints the steps).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from et_hpc.agent.endpoint import endpoint_record, write_endpoint_file
from et_hpc.errors import UserError
from et_hpc.record import EpisodeRecord, records_to_table
from et_hpc.rollouts import RolloutStream, publish_version
from et_hpc.rollouts.queue import WorkQueue
from et_hpc.rollouts.versions import VersionReader, version_step
from et_hpc.runner.plan import new_invocation, tag_record
from et_hpc.runs.export import export_atropos, selected_groups
from et_hpc.runs.groups import take_samples
from et_hpc.runs.store import RunStore
from et_hpc.runs.version_log import UNVERSIONED, VersionLog, label_of

TASKS = ["a", "b", "c"]
CONSUMERS = ["tr0", "tr1"]
HEX = "0123456789abcdef"
MOSTLY_NOT = st.sampled_from([False, False, False, True])  # most groups trainable and placed
STRAY = "stray@sha256-0000000000000000"  # a label no one publishes (the log cannot place it)

# every kind of label a server's endpoint file shows: integers, a step, a content hash, a
# checkpoint without a step, plain aliases (few values, so labels repeat: a republish keeps its place)
SERVER_LABEL = st.one_of(
    st.integers(0, 6).map(str),
    st.integers(0, 9).map(lambda n: f"/ck/step-{n}@step-{n}"),
    st.text(HEX, min_size=2, max_size=2).map(lambda h: f"SmolLM2@sha256-{h * 8}"),
    st.text(HEX, min_size=2, max_size=2).map(lambda h: f"/ck/final@files-{h * 8}"),
    st.sampled_from(["policy", "Qwen/Qwen3-8B", "lora-a"]),
)


def staleness_violations(groups, log_labels: list[str], k: int) -> list[tuple[str, object, str]]:
    """The members of ``groups`` a consumer reading with ``max_staleness=k`` must not have got:
    a label more than ``k`` places behind the newest of ``log_labels`` (publish order), or one the
    log cannot place. Nothing is stale while nothing was published."""
    if not log_labels:
        return []
    newest, out = len(log_labels), []
    for g in groups:
        for r in g.records:
            key = label_of(r.policy_version)
            place = 0 if key == UNVERSIONED else (log_labels.index(key) + 1 if key in log_labels else None)
            if place is None:
                out.append((g.group_id, r.policy_version, "not in the log"))
            elif newest - place > k:
                out.append((g.group_id, r.policy_version, f"{newest - place} behind"))
    return out


@dataclass
class Written:
    group_id: str
    records: list


def aligned_logprobs(r: EpisodeRecord) -> bool:
    """Logprobs present, one per completion token id in every turn."""
    return (
        r.logprobs is not None
        and r.token_ids is not None
        and len(r.logprobs) == len(r.token_ids)
        and all(len(lp) == len(ids) for lp, ids in zip(r.logprobs, r.token_ids))
    )


def _episode(
    task: str, sample: int, version: str | None, *, ok: bool = True, tokens: bool = True, crossed: bool = False, logprobs: bool = True
):
    """One episode as the scripted server's records look (token ids of two turns; logprobs when
    asked for and returned)."""
    tok = (
        dict(
            prompt_token_ids=[[1, 2, 3], [9]],
            token_ids=[[10 + sample % 7, 11], [12]],
            logprobs=[[-0.5, -0.25], [-0.125]] if logprobs else None,
            tokens_source="server-exact",
        )
        if tokens
        else {}
    )
    versions = [version or "0", "next"] if crossed else None
    return EpisodeRecord(
        run_name="run",
        task_id=task,
        sample=sample,
        status="ok" if ok else "infra_error",
        reward=float(sample % 2) if ok else None,
        policy_version=version,
        policy_versions=versions,
        crossed_version=crossed or None,
        **tok,
    )


class Contract(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="et-contract-"))
        self.ep = self.dir.parent / f"{self.dir.name}-ep" / "endpoint.json"  # the server's, outside the run
        self.queue = WorkQueue(self.dir, lease_s=30, grace_s=0).init()
        self.store = RunStore(self.dir)
        self.reader = VersionReader(self.dir, endpoint_file=self.ep)  # a worker's watcher
        self.published: list[str] = []  # the version log as it must be: distinct labels, publish order
        self.trainer_owned = False
        self.trainer_labels: list[str] = []
        self.streamed: list[tuple[str, bool]] = []  # slot order: (group_id, trainable)
        self.members: dict[str, set[int]] = {}  # every group written whole: its samples
        self.trainable: set[str] = set()  # groups a trainer may get (exports and stream)
        self.asked_lp: dict[str, bool] = {}  # groups whose logprobs were asked for and returned
        self.written: dict[str, Written] = {}  # every group's records as written
        self.open: dict[str, RolloutStream] = {}
        self.got: dict[str, list[str]] = {c: [] for c in CONSUMERS}  # delivered since the last commit included
        self.pos: dict[str, int] = {c: 0 for c in CONSUMERS}  # the consumer's next slot
        self.committed: dict[str, tuple[int, int]] = {c: (0, 0) for c in CONSUMERS}  # (len(got), pos) at its commit
        self.held: list = []  # leases of killed workers
        self.slow: list = []  # (lease, version at its claim) of workers still running
        self.floor = 0

    def teardown(self) -> None:
        for s in self.open.values():
            s.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self.ep.parent, ignore_errors=True)

    def _version(self) -> str | None:
        """What a worker labels its episodes with: the newest entry of the log, after observing the endpoint."""
        v = self.reader.current()
        return None if v is None else v.name

    def _claim(self):
        lease = self.queue.claim("w")
        if lease is None:
            self.queue.enqueue_epoch(TASKS, 2, min_sample=self.floor)
            lease = self.queue.claim("w")
        return lease

    # ---------------------------------------------------------------- producers
    GROUP = dict(
        errors=MOSTLY_NOT,
        tokens=MOSTLY_NOT.map(lambda b: not b),
        crossed=st.booleans(),
        lp=st.sampled_from(["asked", "not asked", "server gives none"]),
    )

    @rule(stray=MOSTLY_NOT, **GROUP)
    def continuous_group(self, errors: bool, tokens: bool, crossed: bool, lp: str, stray: bool) -> None:
        """A continuous worker's group; ``stray``: its records carry a label never published."""
        self._commit(self._claim(), STRAY if stray else self._version(), errors, tokens, crossed, lp)

    @initialize(first=st.none() | st.just("trainer") | SERVER_LABEL)
    def run_in_progress(self, first: str | None) -> None:
        """The run starts unversioned, trainer-owned or server-owned, with a unit already running."""
        if first == "trainer":
            self.trainer_publish()
        elif first is not None:
            self.server_publish(first)
        self.slow_claim()

    @rule()
    def slow_claim(self) -> None:
        """A worker claims a unit under the current version and is still running it."""
        self.slow.append((self._claim(), self._version()))

    @precondition(lambda self: self.slow)
    @rule(**GROUP)
    def slow_commit(self, errors: bool, tokens: bool, crossed: bool, lp: str) -> None:
        """The oldest running unit commits, labelled with the version it was claimed under (maybe no
        longer the newest: the stream's staleness bound must then refuse it)."""
        lease, v = self.slow.pop(0)
        self._commit(lease, v, errors, tokens, crossed, lp)

    def _commit(self, lease, v: str | None, errors: bool, tokens: bool, crossed: bool, lp: str) -> None:
        u = lease.unit
        recs = [
            _episode(
                u.task_id,
                u.sample_index(i),
                v,
                ok=not (errors and i == 1),
                tokens=tokens,
                crossed=crossed and i == 1,
                logprobs=lp == "asked",
            )
            for i in range(u.samples)
        ]
        recs = [r.model_copy(update={"group_id": u.group_id, "group_size": u.samples, "reward_rule": "binary"}) for r in recs]
        assert self.queue.commit(lease, records_to_table(recs)) is not None
        good = not errors and tokens
        self.streamed.append((u.group_id, good))
        self._wrote(u.group_id, recs, good, lp == "asked")

    @rule()
    def worker_killed(self) -> None:
        """A worker claims a unit and dies (SIGKILL): no heartbeat, no commit."""
        self.held.append(self._claim())

    @precondition(lambda self: self.held)
    @rule()
    def leases_expire(self) -> None:
        """Leases expire (the dead workers', and the running ones' as if they hung); their units go
        back to the queue and are claimed again."""
        self.queue.sweep(now=time.time() + 31)
        for lease in self.held + [lease for lease, _ in self.slow]:  # the old attempt cannot commit any more
            assert self.queue.commit(lease, records_to_table([_episode(lease.unit.task_id, 0, None)])) is None
        self.held, self.slow = [], []

    @rule(task=st.sampled_from(TASKS), samples=st.integers(1, 3), stop_after=st.none() | st.integers(0, 2))
    def batch_invocation(self, task: str, samples: int, stop_after: int | None) -> None:
        """One ``et-hpc run`` invocation's units of ``task`` (an extension or a rerun is another
        invocation); ``stop_after`` interrupts it after that many episodes."""
        first = take_samples(self.dir, task, samples, self.floor)
        gid, size = f"{task}@i{new_invocation()}", samples
        v = self._version()
        recs = [tag_record(_episode(task, s, v), {task: (gid, size)}, "binary") for s in first]
        if stop_after is not None and stop_after < samples:
            recs = recs[:stop_after]
        if recs:
            self.store.write(recs)
            self._wrote(gid, recs, len(recs) == size, True)

    @rule(writer=st.sampled_from(["w0", "w1"]), task=st.sampled_from(TASKS))
    def env_group(self, writer: str, task: str) -> None:
        """An env process's group: samples from the shared counter, its writer id in the group id."""
        first = take_samples(self.dir, task, 2, self.floor)
        gid = f"{task}@w{writer}-s{first[0]}"
        recs = [_episode(task, s, self._version()).model_copy(update={"group_id": gid, "group_size": 2}) for s in first]
        self.store.write(recs)
        self._wrote(gid, recs, True, True)

    def _wrote(self, gid: str, recs: list, good: bool, asked_lp: bool) -> None:
        assert gid not in self.members, f"group id {gid} reused"
        self.members[gid] = {r.sample for r in recs}
        self.asked_lp[gid] = asked_lp
        self.written[gid] = Written(gid, recs)
        if good:
            self.trainable.add(gid)
        self.floor = max(self.floor, *(r.sample + 1 for r in recs))

    # ---------------------------------------------------------------- versions
    @rule()
    def trainer_publish(self) -> None:
        """The trainer's in-place switch (``publish_version``): the next integer, refused when a
        server already published that very label."""
        n = max((int(x) for x in self.trainer_labels), default=0) + 1
        if str(n) in self.published:
            with pytest.raises(UserError, match="already in"):
                publish_version(self.dir, n)
            return
        publish_version(self.dir, n)
        self.trainer_labels.append(str(n))
        self.published.append(str(n))
        self.trainer_owned = True

    @rule(label=SERVER_LABEL)
    def server_publish(self, label: str) -> None:
        """The server (re)writes its endpoint file with a new ``model_version``; a worker's watcher
        sees it. A label already in the log keeps its place; a trainer-owned run takes none."""
        write_endpoint_file(self.ep, endpoint_record("127.0.0.1", 9, "policy", model_version=label))
        self.reader.current()
        if not self.trainer_owned and label not in self.published:
            self.published.append(label)

    @invariant()
    def the_log_holds_the_publishes_in_order(self) -> None:
        entries = VersionLog(self.dir).entries()
        assert [e.label for e in entries] == self.published
        assert [e.pos for e in entries] == list(range(1, len(entries) + 1))

    @rule()
    def compact(self) -> None:
        self.store.compact(target_rows=1000)

    # ---------------------------------------------------------------- consumers
    def _stream(self, c: str) -> RolloutStream:
        if c not in self.open:
            self.open[c] = RolloutStream(self.dir, c, poll_s=0.01, endpoint_file=self.ep)
        return self.open[c]

    def _expected(self, c: str, n: int, k: int | None) -> tuple[list[str], int, int]:
        """The groups a read of ``n`` with ``max_staleness=k`` must deliver, the next slot after it,
        and how many trainable groups it must refuse as stale."""
        want, pos, stale = [], self.pos[c], 0
        while len(want) < n and pos < len(self.streamed):
            gid, good = self.streamed[pos]
            pos += 1
            if good and k is not None and staleness_violations([self.written[gid]], self.published, k):
                stale += 1
            elif good:
                want.append(gid)
        return want, pos, stale

    @rule(c=st.sampled_from(CONSUMERS), n=st.integers(1, 4), k=st.sampled_from([None, 0, 0, 1]))
    def read(self, c: str, n: int, k: int | None) -> None:
        s = self._stream(c)
        if s.auto_commit and s._dirty:
            self.committed[c] = (len(self.got[c]), self.pos[c])
        want, pos, stale = self._expected(c, n, k)
        got = s.next_batch(n, timeout_s=0, max_staleness=k)
        for g in got:
            assert {r.sample for r in g.records} == self.members[g.group_id]  # whole, only its own
            assert all(r.group_id == g.group_id and r.has_tokens for r in g.records)
            if self.asked_lp[g.group_id]:
                assert all(aligned_logprobs(r) for r in g.records), g.group_id
        if k is not None:
            bad = staleness_violations(got, self.published, k)
            assert not bad, f"delivered with max_staleness={k} (log {self.published}): {bad}"
        assert [g.group_id for g in got] == want, (c, k, want)
        event(f"read: {'trainable groups refused as stale' if stale else 'none refused as stale'}")
        self.got[c] += want
        self.pos[c] = pos

    @rule(c=st.sampled_from(CONSUMERS))
    def commit(self, c: str) -> None:
        if c in self.open:
            self.open[c].commit()
            self.committed[c] = (len(self.got[c]), self.pos[c])

    @rule(c=st.sampled_from(CONSUMERS))
    def die(self, c: str) -> None:
        """The consumer's process ends without committing: what it got since is handed out again."""
        s = self.open.pop(c, None)
        if s is not None:
            s.close()
            n, self.pos[c] = self.committed[c]
            del self.got[c][n:]

    # ---------------------------------------------------------------- invariants
    @invariant()
    def consumers_get_each_group_once_in_slot_order(self) -> None:
        slot = {g: i for i, (g, good) in enumerate(self.streamed) if good}
        for c in CONSUMERS:
            order = [slot[g] for g in self.got[c]]
            assert order == sorted(set(order)), (c, self.got[c])

    @invariant()
    def exports_hold_every_trainable_group_once_whole(self) -> None:
        groups, counts = selected_groups(self.store)
        ids = [g[0].group_id for g in groups]
        assert len(ids) == len(set(ids)) and set(ids) == self.trainable
        for recs in groups:
            gid = recs[0].group_id
            assert {r.sample for r in recs} == self.members[gid] and all(r.group_id == gid for r in recs)
            assert all(r.has_tokens for r in recs)
            assert not self.asked_lp[gid] or all(aligned_logprobs(r) for r in recs), gid
            versions = {r.policy_version for r in recs}
            assert len(versions) == 1 or any(r.crossed_version for r in recs)
        assert counts.selected == len(self.trainable)

    @precondition(lambda self: len(self.members) % 5 == 4)
    @rule()
    def export_file(self) -> None:
        out = self.dir / "a.jsonl"
        res = export_atropos(self.store, out, drop_zero_variance=False)
        assert res.groups == len(self.trainable)
        lines = [json.loads(x) for x in out.read_text().splitlines()]
        with_lp = [g for g in lines if g.get("inference_logprobs") is not None]
        assert len(with_lp) == sum(self.asked_lp[g] for g in self.trainable)
        for g in with_lp:
            assert [len(x) for x in g["inference_logprobs"]] == [len(t) for t in g["tokens"]]


Contract.TestCase.settings = settings(
    max_examples=50,
    stateful_step_count=30,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestContract = Contract.TestCase


def _parse_only_stale(self, g, max_staleness: int) -> bool:
    """The filter before the log: a label's step parsed from its text (None: kept as fresh)."""
    cur = self.current_version()
    steps = [version_step(r.policy_version) for r in g.records]
    now = version_step(cur.label) if cur is not None else None
    return now is not None and any(s is not None and now - s > max_staleness for s in steps)


@pytest.mark.parametrize("wrong", [lambda self, g, k: False, _parse_only_stale], ids=["ignores-the-log", "parses-steps"])
def test_the_staleness_invariant_catches_a_stream_that_ignores_the_log(monkeypatch, wrong) -> None:
    """Positive control: with the stream's filter replaced by one that ignores the log (keeps
    everything, or orders by parsed steps as before the log), the same machine fails."""
    monkeypatch.setattr(RolloutStream, "_stale", wrong)
    with pytest.raises(AssertionError, match="delivered with max_staleness="):
        run_state_machine_as_test(
            Contract,
            settings=settings(Contract.TestCase.settings, max_examples=50, phases=[Phase.generate]),  # ends at the first failure
        )
    assert not staleness_violations([Written("g", [_episode("a", 0, "policy")])], ["policy", "lora-a"], 1)
    assert staleness_violations([Written("g", [_episode("a", 0, "policy")])], ["policy", "lora-a"], 0)
    assert staleness_violations([Written("g", [_episode("a", 0, STRAY)])], ["policy"], 5)
