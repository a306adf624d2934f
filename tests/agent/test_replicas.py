"""Many policy servers from one endpoint directory (``policy.endpoint_dir``, et_hpc.agent.replicas).

Real processes throughout: scripted servers (``python -m et_hpc.scripted_server --endpoint-dir``)
on 127.0.0.1, each writing its own endpoint file into one directory; the replica set and the
OpenAI policy talk to them over HTTP. Covers spreading episodes by outstanding requests, stickiness,
bad files ignored with one warning, a dead replica revived by a rewritten file or a probe, the
same turn failing over to another server, ``vllm.sbatch --endpoint-dir``, the config errors, and
``et-hpc run`` end to end: episodes spread evenly, and a server SIGKILLed mid-run loses no episode.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from helpers import REPO, until
from helpers.servers import vllm_shim

DEMO = REPO / "defs" / "demo"
ET_HPC = [sys.executable, "-m", "et_hpc.cli"]
TASKS = ["demo_hello_file", "demo_csv_sum", "demo_log_filter"]
SECRET = "sk-et-hpc-replica-7f3a"
FAST = ["--set", "policy.backoff_base_s=0.05", "--set", "policy.backoff_max_s=0.2"]


class Server:
    """One scripted server process writing ``<dir>/scripted-<port>.json``; ``served()`` reads its log."""

    def __init__(self, directory: Path, script: Path, log: Path, key: str | None = None):
        self.log = log
        env = dict(os.environ, VLLM_API_KEY=key or "")  # as vllm serve: the key from the environment
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "et_hpc.scripted_server",
                    "--script",
                    str(script),
                    "--port",
                    "0",
                    "--endpoint-dir",
                    str(directory),
                    "--log-requests",
                    "--model-version",
                    "v1",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )

        def started():
            m = re.search(r"serving http://127\.0\.0\.1:(\d+)/v1", log.read_text())
            return m and (directory / f"scripted-{m.group(1)}.json").exists() and m

        self.port = int(until(f"server {log.name} to start", started, 30, 0.05).group(1))
        self.name = f"scripted-{self.port}"
        self.path = directory / f"{self.name}.json"
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def served(self, turn: int | None = None) -> int:
        lines = [ln for ln in self.log.read_text().splitlines() if ln.startswith("served chat turn=")]
        return sum(1 for ln in lines if turn is None or ln == f"served chat turn={turn}")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


def _servers(tmp: Path, script: dict, n: int = 3, key: str | None = None) -> tuple[Path, list[Server]]:
    d = tmp / "replicas"
    s = tmp / "script.json"
    s.write_text(json.dumps(script))
    return d, [Server(d, s, tmp / f"server{i}.log", key and f"{key}-{i}") for i in range(n)]


@pytest.fixture
def three(tmp_path: Path):
    d, servers = _servers(tmp_path, {"": [{"command": "ls"}, {"command": "pwd"}, "All done."]})
    yield d, servers
    for s in servers:
        s.stop()


def test_assignment_by_outstanding_requests_and_fair_ties(three) -> None:
    from et_hpc.agent.replicas import ReplicaSet

    d, servers = three
    rs = ReplicaSet(d)
    first = [rs.acquire() for _ in range(3)]
    assert {r.name for r in first} == {s.name for s in servers}  # all idle: one new episode each
    assert all(r.state == "live" and r.model == "scripted" and r.model_version == "v1" for r in first)
    a, b, c = first
    with rs.inflight(a), rs.inflight(a), rs.inflight(b):
        assert rs.stats()[a.name]["outstanding"] == 2
        assert rs.acquire() is c  # the only one without requests in flight
        assert rs.acquire() is c  # still: outstanding requests come before fairness
    assert rs.stats()[a.name]["outstanding"] == 0
    got = Counter(rs.acquire().name for _ in range(7))  # idle again: c is 2 ahead, ties are fair
    assert got == {a.name: 3, b.name: 3, c.name: 1}, got
    before = rs.reads
    rs.refresh(force=True)
    rs.refresh(force=True)
    assert rs.reads == before  # unchanged files are not read again (stat only)


def test_policies_are_sticky_and_spread(three) -> None:
    from et_hpc.agent.openai_policy import OpenAIPolicy
    from et_hpc.agent.replicas import ReplicaSet

    d, servers = three
    rs = ReplicaSet(d)
    policies = [OpenAIPolicy(None, replicas=rs, max_retries=2, backoff_base_s=0.05) for _ in range(3)]
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}]
    try:
        for p in policies:
            conv = list(msgs)
            for _ in range(3):
                a = p.act(conv)
                conv.append(a.message)
                if a.tool_call_id:
                    conv.append({"role": "tool", "tool_call_id": a.tool_call_id, "content": "ok"})
            assert p.events == [] and p.model == "scripted"
            assert p.turn_versions == [("v1", "v1")] * 3
    finally:
        for p in policies:
            p.close()
    assert sorted(s.served() for s in servers) == [3, 3, 3]  # each episode all its turns on one server
    assert sorted(p.tokenize_url for p in policies) == sorted(f"http://127.0.0.1:{s.port}/tokenize" for s in servers)
    assert all(v["episodes"] == 0 for v in rs.stats().values())  # close() gave them back


def test_bad_files_are_ignored_with_one_warning(three, caplog) -> None:
    from et_hpc.agent.endpoint import endpoint_record
    from et_hpc.agent.replicas import ReplicaSet

    d, servers = three
    shared = d / "shared.json"  # a key others can read
    shared.write_text(json.dumps(endpoint_record("127.0.0.1", servers[0].port, "m", api_key="sk-shared-4d1e")))
    shared.chmod(0o640)
    (d / "torn.json").write_text('{"host": "127.0.0.1", "po')
    (d / "torn.json").chmod(0o600)
    secret = d / "unreadable.json"
    secret.write_text("{}")
    secret.chmod(0)
    (d / ".endpoint.123.456").write_text("{}")  # a writer's temp file: not even looked at
    (d / "notes.txt").write_text("not an endpoint")
    rs = ReplicaSet(d)
    with caplog.at_level(logging.WARNING, logger="et_hpc.agent.replicas"):
        for _ in range(3):
            rs.refresh(force=True)
    assert set(rs.replicas) == {s.name for s in servers}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 3, warnings
    assert any("shared.json" in w and "chmod 600" in w for w in warnings)
    assert any("torn.json" in w and "not an endpoint record" in w for w in warnings)
    assert any("unreadable.json" in w and "cannot be read" in w for w in warnings)
    assert not any("sk-shared-4d1e" in w for w in warnings)
    shared.chmod(0o600)  # fixed: used from the next scan on
    rs.refresh(force=True)
    assert rs.replicas["shared"].state == "live"


def test_dead_until_rewritten_or_answering_again(three, tmp_path: Path) -> None:
    from et_hpc.agent.endpoint import endpoint_record, write_endpoint_file
    from et_hpc.agent.replicas import ReplicaSet
    from et_hpc.testing.scripted_server import ScriptedServer

    d, servers = three
    rs = ReplicaSet(d, reprobe_dead_s=3600)
    rs.refresh()
    gone = servers[1]
    gone.kill()
    rs.mark_dead(rs.replicas[gone.name], "test: killed")
    assert gone.name not in {rs.acquire().name for _ in range(6)}
    rs.refresh(force=True)
    assert rs.replicas[gone.name].state == "dead"  # its file is unchanged: stays dead
    with ScriptedServer({"": ["done"]}, model="scripted") as new:  # the job restarted elsewhere
        write_endpoint_file(gone.path, endpoint_record("127.0.0.1", new.port, "scripted", model_version="v2"))
        rs.refresh(force=True)
        rep = rs.replicas[gone.name]
        assert rep.state == "live" and rep.base_url == new.base_url and rep.model_version == "v2"
        with rs.inflight(rs.replicas[servers[0].name]), rs.inflight(rs.replicas[servers[2].name]):
            assert rs.acquire() is rep
    # dead by mistake (a transient error): a later probe brings it back without a rewrite
    quick = ReplicaSet(d, reprobe_dead_s=0)
    quick.refresh()
    alive = quick.replicas[servers[0].name]
    quick.mark_dead(alive, "test: a transient error")
    quick.refresh()
    assert alive.state == "live"
    gone.path.unlink()  # a job that ended removes its file: the replica goes
    quick.refresh(force=True)
    assert gone.name not in quick.replicas


def test_same_turn_fails_over_to_another_server(three) -> None:
    from et_hpc.agent.openai_policy import OpenAIPolicy
    from et_hpc.agent.replicas import ReplicaSet

    d, servers = three
    rs = ReplicaSet(d)
    policies = [OpenAIPolicy(None, replicas=rs, max_retries=3, backoff_base_s=0.05, backoff_max_s=0.1) for _ in range(4)]
    other = policies[3]  # shares its server with one of the first three
    p = next(q for q in policies[:3] if q._replica is other._replica)
    by_port = {s.port: s for s in servers}
    first = by_port[int(p._replica.base_url.split(":")[-1].split("/")[0])]
    conv = [{"role": "user", "content": "task"}]
    a = p.act(conv)
    conv += [a.message, {"role": "tool", "tool_call_id": a.tool_call_id, "content": "x"}]
    assert first.served(0) == 1
    first.kill()
    a = p.act(conv)  # turn 1: the request to the killed server fails, the same turn goes elsewhere
    assert a.kind == "command" and a.command == "pwd"
    assert len(p.events) == 1 and p.events[0].startswith(f"failover: {first.name} (") and "connection" in p.events[0]
    second = next(s for s in servers if s is not first and s.served(1) == 1)
    assert f"-> {second.name} (" in p.events[0]
    conv += [a.message, {"role": "tool", "tool_call_id": a.tool_call_id, "content": "y"}]
    assert p.act(conv).kind == "done" and second.served(2) == 1  # sticky on the new one
    assert rs.replicas[first.name].state == "dead"
    # an episode that was on the dead server moves without trying it again
    assert other.act([{"role": "user", "content": "task"}]).kind == "command"
    assert len(other.events) == 1 and "found dead (connection failed" in other.events[0], other.events
    assert first.name not in {OpenAIPolicy(None, replicas=rs)._replica.name for _ in range(4)}
    # no server left at all: the turn ends in PolicyError within the retry budget, not a hang
    for s in servers:
        s.kill()
    from et_hpc.agent.policies import PolicyError

    p.retry_budget_s = 1.0
    with pytest.raises(PolicyError, match="no live policy server"):
        p.act(conv)
    assert "-> none: connection failed" in p.events[-1], p.events


def test_a_restarted_server_takes_its_episode_back(tmp_path: Path) -> None:
    """One server whose job restarts (a checkpoint switch): the turn waits for the republished file."""
    import threading

    from et_hpc.agent.endpoint import endpoint_record, write_endpoint_file
    from et_hpc.agent.openai_policy import OpenAIPolicy
    from et_hpc.agent.replicas import ReplicaSet
    from et_hpc.testing.scripted_server import ScriptedServer

    d, (only,) = _servers(tmp_path, {"": [{"command": "ls"}, {"command": "pwd"}, "done"]}, n=1)
    rs = ReplicaSet(d)
    p = OpenAIPolicy(None, replicas=rs, max_retries=3, backoff_base_s=0.05, retry_budget_s=60)
    conv = [{"role": "user", "content": "task"}]
    a = p.act(conv)
    conv += [a.message, {"role": "tool", "tool_call_id": a.tool_call_id, "content": "x"}]
    only.kill()
    with ScriptedServer({"": [{"command": "ls"}, {"command": "pwd"}, "done"]}) as new:
        later = threading.Timer(
            1.0, lambda: write_endpoint_file(only.path, endpoint_record("127.0.0.1", new.port, "scripted", model_version="v2"))
        )
        later.start()
        a = p.act(conv)
        later.join()
        assert a.command == "pwd" and new.chat_requests == 1
    assert len(p.events) == 1, p.events
    assert p.events[0].startswith(f"failover: {only.name} ({only.base_url}) -> {only.name} ({new.base_url}): connection failed"), p.events
    assert p.turn_versions == [("v1", "v1"), ("v1", "v2")]  # the version from the file of the server that answered


def test_vllm_script_writes_into_an_endpoint_dir(tmp_path: Path) -> None:
    from et_hpc.agent.replicas import ReplicaSet

    shim = vllm_shim(tmp_path, {"hi": ["hello"]})
    d = tmp_path / "private" / "replicas"
    procs = []
    try:
        for job in ("101", "102"):
            env = dict(os.environ, VLLM=str(shim), HEALTH_EVERY_S="1", SLURM_JOB_ID=job)
            env.pop("VLLM_API_KEY", None)
            procs.append(
                subprocess.Popen(
                    ["bash", str(REPO / "slurm" / "vllm.sbatch"), "--endpoint-dir", str(d), "my-model"],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        until("both endpoint files", lambda: (d / "101.json").exists() and (d / "102.json").exists(), 120, 0.1)
        assert d.stat().st_mode & 0o777 == 0o700
        recs = [json.loads((d / f"{j}.json").read_text()) for j in ("101", "102")]
        assert [r["job_id"] for r in recs] == ["101", "102"] and recs[0]["api_key"] != recs[1]["api_key"]
        assert all((d / f"{j}.json").stat().st_mode & 0o777 == 0o600 for j in ("101", "102"))
        rs = ReplicaSet(d)
        rs.wait_live(30)
        rs.refresh(force=True)
        assert {n: r.state for n, r in rs.replicas.items()} == {"101": "live", "102": "live"}  # each with its key
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        outs = [p.communicate(timeout=60)[0] for p in procs]
    assert not list(d.glob("*.json")), outs  # each job removed its own file
    assert not any(r["api_key"] in o for r in recs for o in outs)


def test_config_combinations_are_one_line_errors(tmp_path: Path) -> None:
    for extra in (["--set", "policy.base_url=http://127.0.0.1:9/v1"], ["--set", f"policy.endpoint_file={tmp_path}/e.json"]):
        r = subprocess.run(
            ET_HPC
            + [
                "run",
                str(DEMO),
                "--policy",
                "openai",
                "--set",
                f"policy.endpoint_dir={tmp_path}",
                *extra,
                "--store",
                str(tmp_path / "store"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2, r.stderr
        assert r.stderr.startswith("et-hpc: error:") and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "policy.endpoint_dir and policy." in r.stderr and "Value error" not in r.stderr
    from et_hpc.agent.replicas import ReplicaSet
    from et_hpc.errors import UserError

    with pytest.raises(UserError, match=f"no policy server in endpoint directory {re.escape(str(tmp_path))}.*no endpoint files"):
        ReplicaSet(tmp_path).wait_live(0.2, poll_s=0.1)


# -- et-hpc run end to end ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_images(base_sif: Path):
    from et_hpc.images.store import ImageStore
    from et_hpc.tasks.loader import load_tasks

    for t in load_tasks(str(DEMO)).tasks:
        if t.id in TASKS:
            assert ImageStore().ensure(t).path is not None


def _run_cmd(tmp: Path, d: Path, name: str, tasks: list[str], samples: int) -> list[str]:
    return ET_HPC + [
        "run",
        str(DEMO),
        "--policy",
        "openai",
        "--set",
        f"policy.endpoint_dir={d}",
        "--set",
        f"tasks.ids=[{','.join(tasks)}]",
        "--samples",
        str(samples),
        "--concurrency",
        "3",
        "--run-name",
        name,
        "--store",
        str(tmp / "store"),
        "--json",
        *FAST,
    ]


def _records(tmp: Path, name: str) -> list:
    from et_hpc.runs.store import open_run

    return open_run(tmp / "store" / name).records()


def test_run_spreads_episodes_evenly(demo_images, tmp_path: Path) -> None:
    d, servers = _servers(tmp_path, {"": [{"command": "sleep 0.5"}, "All done."]})
    try:
        r = subprocess.run(_run_cmd(tmp_path, d, "spread", TASKS, 5), capture_output=True, text=True, timeout=900)
    finally:
        for s in servers:
            s.stop()
    assert r.returncode == 0, r.stderr[-3000:]
    recs = _records(tmp_path, "spread")
    assert len(recs) == 15 and all(x.status == "ok" for x in recs), [(x.status, x.error) for x in recs]
    assert all(x.policy_version == "v1" and not any("failover" in e for e in x.events) for x in recs)
    per_server = [s.served(0) for s in servers]  # each episode's first turn, from the servers' own logs
    assert sum(per_server) == 15 and all(4 <= n <= 6 for n in per_server), per_server  # within 20% of 5


def test_run_survives_a_server_killed_mid_run(demo_images, tmp_path: Path) -> None:
    d, servers = _servers(tmp_path, {"": [{"command": "sleep 2"}, {"command": "true"}, "All done."]}, key=SECRET)
    victim = servers[0]
    try:
        p = subprocess.Popen(_run_cmd(tmp_path, d, "kill", TASKS[:2], 3), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        until("an episode on the victim", lambda: victim.served(0) >= 1 or p.poll() is not None, 300, 0.05)
        victim.kill()  # mid-episode: its agent is running `sleep 2`
        out, err = p.communicate(timeout=900)
    finally:
        for s in servers:
            s.stop()
    assert p.returncode == 0, err[-3000:]
    recs = _records(tmp_path, "kill")
    assert len(recs) == 6 and [x.status for x in recs] == ["ok"] * 6, [(x.status, x.error) for x in recs]
    assert json.loads(out)["ok"] == 6
    moved = [x for x in recs if any(e.startswith(f"failover: {victim.name} (") for e in x.events)]
    assert moved, [x.events for x in recs]
    assert all(x.turns == 3 and x.stop_reason == "done" for x in moved)
    assert victim.served() == victim.served(0)  # it answered no later turn: those went elsewhere
    later = sum(s.served(1) for s in servers[1:])
    assert later == 6  # every episode's second turn was served by a live server
    blob = json.dumps([x.model_dump(mode="json") for x in recs]) + err + out
    blob += "".join(f.read_text(errors="replace") for f in (tmp_path / "store" / "kill").rglob("*.json"))
    assert SECRET not in blob  # each server's key was used (they answer 401 without it), never written
