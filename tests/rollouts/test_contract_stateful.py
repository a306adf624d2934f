"""The trainer contract as one stateful property: hypothesis drives a run directory through batch
invocations (extended, interrupted), continuous groups (worker kills, version publishes), two
env-like writers, compactions, and consumers that read, commit, die and restart.

Real parts: the parquet store and compactor, the work queue (claim, commit, lease expiry and
sweep), ``RolloutStream`` with its on-disk cursor, ``publish_version``, ``selected_groups`` (what
the exports write) and ``export_atropos``. Episodes are records shaped as the scripted server's
(exact token ids, logprobs), built in the test so a step takes milliseconds: no sandbox or model
runs. Invariants, checked after every step: each consumer gets every trainable streamed group
once, whole, with only its own members, in slot order; exports hold every trainable group once;
no group mixes versions unless its records say ``crossed_version``; nothing trainable lacks exact
tokens. Fixed budget for CI (``derandomize``; hypothesis prints the failing steps).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from et_hpc.record import EpisodeRecord, records_to_table
from et_hpc.rollouts import RolloutStream, publish_version, read_version
from et_hpc.rollouts.queue import WorkQueue
from et_hpc.runner.plan import new_invocation, tag_record
from et_hpc.runs.export import export_atropos, selected_groups
from et_hpc.runs.groups import take_samples
from et_hpc.runs.store import RunStore

TASKS = ["a", "b", "c"]
CONSUMERS = ["tr0", "tr1"]


def _episode(task: str, sample: int, version: str | None, *, ok: bool = True, tokens: bool = True, crossed: bool = False):
    """One episode as the scripted server's records look (tokens and logprobs of two turns)."""
    tok = (
        dict(
            prompt_token_ids=[[1, 2, 3], [9]],
            token_ids=[[10 + sample % 7, 11], [12]],
            logprobs=[[-0.5, -0.25], [-0.125]],
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
        self.queue = WorkQueue(self.dir, lease_s=30, grace_s=0).init()
        self.store = RunStore(self.dir)
        self.streamed: list[tuple[str, bool]] = []  # slot order: (group_id, trainable)
        self.members: dict[str, set[int]] = {}  # every group written whole: its samples
        self.trainable: set[str] = set()  # groups a trainer may get (exports and stream)
        self.open: dict[str, RolloutStream] = {}
        self.got: dict[str, list[str]] = {c: [] for c in CONSUMERS}  # delivered since the last commit included
        self.committed: dict[str, int] = {c: 0 for c in CONSUMERS}  # how many of got are committed
        self.held: list = []  # leases of killed workers
        self.floor = 0

    def teardown(self) -> None:
        for s in self.open.values():
            s.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _version(self) -> str | None:
        v = read_version(self.dir)
        return None if v is None else str(v.version)

    def _claim(self):
        lease = self.queue.claim("w")
        if lease is None:
            self.queue.enqueue_epoch(TASKS, 2, min_sample=self.floor)
            lease = self.queue.claim("w")
        return lease

    # ---------------------------------------------------------------- producers
    @rule(errors=st.booleans(), tokens=st.booleans(), crossed=st.booleans())
    def continuous_group(self, errors: bool, tokens: bool, crossed: bool) -> None:
        lease = self._claim()
        u = lease.unit
        v = self._version()
        recs = [
            _episode(u.task_id, u.sample_index(i), v, ok=not (errors and i == 1), tokens=tokens, crossed=crossed and i == 1)
            for i in range(u.samples)
        ]
        recs = [r.model_copy(update={"group_id": u.group_id, "group_size": u.samples, "reward_rule": "binary"}) for r in recs]
        assert self.queue.commit(lease, records_to_table(recs)) is not None
        good = not errors and tokens
        self.streamed.append((u.group_id, good))
        self._wrote(u.group_id, recs, good)

    @rule()
    def worker_killed(self) -> None:
        """A worker claims a unit and dies (SIGKILL): no heartbeat, no commit."""
        self.held.append(self._claim())

    @precondition(lambda self: self.held)
    @rule()
    def leases_expire(self) -> None:
        self.queue.sweep(now=time.time() + 31)
        for lease in self.held:  # the dead attempt cannot commit any more
            assert self.queue.commit(lease, records_to_table([_episode(lease.unit.task_id, 0, None)])) is None
        self.held = []

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
            self._wrote(gid, recs, len(recs) == size)

    @rule(writer=st.sampled_from(["w0", "w1"]), task=st.sampled_from(TASKS))
    def env_group(self, writer: str, task: str) -> None:
        """An env process's group: samples from the shared counter, its writer id in the group id."""
        first = take_samples(self.dir, task, 2, self.floor)
        gid = f"{task}@w{writer}-s{first[0]}"
        recs = [_episode(task, s, self._version()).model_copy(update={"group_id": gid, "group_size": 2}) for s in first]
        self.store.write(recs)
        self._wrote(gid, recs, True)

    def _wrote(self, gid: str, recs: list, good: bool) -> None:
        assert gid not in self.members, f"group id {gid} reused"
        self.members[gid] = {r.sample for r in recs}
        if good:
            self.trainable.add(gid)
        self.floor = max(self.floor, *(r.sample + 1 for r in recs))

    @rule()
    def publish(self) -> None:
        publish_version(self.dir)

    @rule()
    def compact(self) -> None:
        self.store.compact(target_rows=1000)

    # ---------------------------------------------------------------- consumers
    def _stream(self, c: str) -> RolloutStream:
        if c not in self.open:
            self.open[c] = RolloutStream(self.dir, c, poll_s=0.01)
        return self.open[c]

    @rule(c=st.sampled_from(CONSUMERS), n=st.integers(1, 4))
    def read(self, c: str, n: int) -> None:
        s = self._stream(c)
        if s.auto_commit and s._dirty:
            self.committed[c] = len(self.got[c])
        for g in s.next_batch(n, timeout_s=0):
            assert {r.sample for r in g.records} == self.members[g.group_id]  # whole, only its own
            assert all(r.group_id == g.group_id and r.has_tokens for r in g.records)
            self.got[c].append(g.group_id)

    @rule(c=st.sampled_from(CONSUMERS))
    def commit(self, c: str) -> None:
        if c in self.open:
            self.open[c].commit()
            self.committed[c] = len(self.got[c])

    @rule(c=st.sampled_from(CONSUMERS))
    def die(self, c: str) -> None:
        """The consumer's process ends without committing: what it got since is handed out again."""
        s = self.open.pop(c, None)
        if s is not None:
            s.close()
            del self.got[c][self.committed[c] :]

    # ---------------------------------------------------------------- invariants
    @invariant()
    def consumers_get_each_trainable_group_once_in_order(self) -> None:
        want = [g for g, good in self.streamed if good]
        for c in CONSUMERS:
            assert self.got[c] == want[: len(self.got[c])], (c, self.got[c], want)

    @invariant()
    def exports_hold_every_trainable_group_once_whole(self) -> None:
        groups, counts = selected_groups(self.store)
        ids = [g[0].group_id for g in groups]
        assert len(ids) == len(set(ids)) and set(ids) == self.trainable
        for recs in groups:
            gid = recs[0].group_id
            assert {r.sample for r in recs} == self.members[gid] and all(r.group_id == gid for r in recs)
            assert all(r.has_tokens for r in recs)
            versions = {r.policy_version for r in recs}
            assert len(versions) == 1 or any(r.crossed_version for r in recs)
        assert counts.selected == len(self.trainable)

    @precondition(lambda self: len(self.members) % 5 == 4)
    @rule()
    def export_file(self) -> None:
        res = export_atropos(self.store, self.dir / "a.jsonl", drop_zero_variance=False)
        assert res.groups == len(self.trainable)


Contract.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=15,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestContract = Contract.TestCase
