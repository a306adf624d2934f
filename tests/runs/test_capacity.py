"""Per-episode telemetry and the capacity report.

Real oracle and served-model episodes through ``et-hpc run`` fill the whole time split and the
sandbox's peak memory; capacity numbers from a real store of synthetic records match values
worked out here from the inputs; ``et-hpc status --capacity`` and ``et-hpc report`` show them;
a real ``RolloutStream`` records the trainer's wait and the staleness of what it handed out.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from et_hpc.record import EpisodeRecord, Timings, records_to_table
from et_hpc.runs.store import RunStore
from helpers import REPO

DEMO = REPO / "defs" / "demo"
TASKS = ["demo_hello_file", "demo_csv_sum"]
ET_HPC = [sys.executable, "-m", "et_hpc.cli"]
PARTS = ("setup_s", "agent_s", "score_s", "teardown_s")


@pytest.fixture(scope="module")
def demo_images(base_sif: Path):
    from et_hpc.images.store import ImageStore
    from et_hpc.tasks.loader import load_tasks

    imgs = [ImageStore().ensure(t) for t in load_tasks(str(DEMO)).tasks if t.id in TASKS]
    assert len(imgs) == len(TASKS) and all(i.path is not None for i in imgs), imgs
    return imgs


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(ET_HPC + list(args), capture_output=True, text=True, timeout=timeout)


def _run(store: Path, name: str, *args: str) -> list[EpisodeRecord]:
    r = _cli(
        "run",
        str(DEMO),
        "--set",
        f"tasks.ids=[{','.join(TASKS)}]",
        "--run-name",
        name,
        "--store",
        str(store),
        "--concurrency",
        "1",
        "--json",
        *args,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return sorted(RunStore(store / name).records(), key=lambda rec: rec.timings.start_s)


def _check_split(rec: EpisodeRecord) -> None:
    t = rec.timings
    for f in ("queue_s", "setup_s", "agent_s", "model_s", "exec_s", "score_s", "teardown_s", "total_s"):
        assert getattr(t, f) is not None and getattr(t, f) >= 0, (f, t)
    assert sum(getattr(t, f) for f in PARTS) <= t.total_s
    assert t.model_s + t.exec_s <= t.agent_s
    assert rec.peak_mem_mb is not None and rec.peak_mem_mb > 0 and rec.peak_pids and rec.peak_pids >= 1
    host, _, pid = (rec.worker or "").rpartition(":")
    assert host == rec.host and pid.isdigit()


@pytest.mark.apptainer
def test_oracle_run_fills_the_time_split_and_status_shows_capacity(demo_images, tmp_path: Path) -> None:
    store = tmp_path / "store"
    recs = _run(store, "orc", "--policy", "oracle")
    assert [r.status for r in recs] == ["ok", "ok"] and all(r.reward == 1.0 for r in recs)
    for rec in recs:
        _check_split(rec)
        assert rec.timings.exec_s > 0  # the oracle's commands ran in the shell
    # one executor, one plan: both queue times count from the same moment, so they differ by
    # exactly the difference of the starts (the second waited for the only slot)
    a, b = (r.timings for r in recs)
    assert b.queue_s - a.queue_s == pytest.approx(b.start_s - a.start_s, abs=1e-6)
    assert b.start_s >= a.stop_s

    st = _cli("status", "orc", "--store", str(store), "--capacity")
    assert st.returncode == 0, st.stderr
    assert "capacity: 2 episodes (2 ok)" in st.stdout and "projection: episodes/hour per node" in st.stdout
    js = _cli("status", str(store / "orc"), "--capacity", "--json", "--cores", "8", "--nodes", "3", "--per-node", "5", "--gpu-hours", "0.5")
    assert js.returncode == 0, js.stderr
    cap = json.loads(js.stdout)["capacity"]
    assert cap["episodes"] == 2 and cap["sandbox_mem_mb"]["max"] == max(r.peak_mem_mb for r in recs)
    assert cap["sandbox_pids_max"] == max(r.peak_pids for r in recs)
    assert cap["trainer"]["accepted_episodes"] == 2 and cap["trainer"]["accepted_per_gpu_hour"] == 4.0
    assert [(p["nodes"], p["per_node"]) for p in cap["projection"]["rows"]] == [(3, 5)]
    assert cap["projection"]["cores_per_node"] == 8
    assert [h["key"] for h in cap["by_host"]] == [recs[0].host]

    for bad in (
        ["status", "no-such-run", "--store", str(store), "--capacity"],
        ["status", "orc", "--store", str(store), "--capacity", "--nodes", "0"],
        ["status", "orc", "--store", str(store), "--capacity", "--gpu-hours", "lots"],
    ):
        r = _cli(*bad)
        assert r.returncode == 2 and r.stderr.startswith("et-hpc: error:") and len(r.stderr.splitlines()) == 1, r.stderr


@pytest.mark.apptainer
def test_served_model_time_is_recorded(demo_images, tmp_path: Path) -> None:
    from et_hpc.testing.scripted_server import ScriptedServer

    script = {
        "greeting.txt": [{"command": "printf 'Hello, et-hpc!\\n' > /home/user/greeting.txt"}, "Done."],
        "sales.csv": [{"command": "ls /home/user/data"}, "Done."],
    }
    with ScriptedServer(script) as srv:
        recs = _run(
            tmp_path / "store",
            "served",
            "--set",
            "policy.kind=openai",
            "--set",
            f"policy.base_url={srv.base_url}",
            "--set",
            "policy.mode=tools",
        )
    assert {r.policy_kind for r in recs} == {"openai-tools"} and all(r.status == "ok" for r in recs)
    for rec in recs:
        _check_split(rec)
        assert rec.timings.model_s > 0 and rec.turns == 2


# --- capacity from synthetic records with known values ---------------------------------------
# (host, worker, slurm job, array task, start, stop, queue, setup, model, exec, score, teardown, mem, pids)
EPISODES = [
    ("n1", "n1:10", None, None, 0.0, 10.0, 1.0, 2.0, 4.0, 1.0, 1.5, 0.5, 100.0, 3),
    ("n1", "n1:10", None, None, 5.0, 15.0, 2.0, 2.5, 3.0, 2.0, 1.0, 0.5, 120.0, 4),
    ("n1", "n1:10", None, None, 20.0, 30.0, 0.5, 1.0, 5.0, 1.0, 2.0, 1.0, 80.0, 2),
    ("n2", "n2:20", "77", 0, 0.0, 20.0, 3.0, 4.0, 8.0, 4.0, 2.0, 1.0, 300.0, 9),
    ("n2", "n2:21", "77", 1, 40.0, 50.0, 0.0, 1.0, 6.0, 1.0, 1.0, 0.5, 60.0, 1),
]
BASE = 1.8e9
WARM = {4: 2.5}  # episode 4 got a warm sandbox, started ahead in 2.5 s


def _synthetic_store(root: Path) -> RunStore:
    rs = RunStore(root / "syn")
    recs = []
    for i, (host, worker, job, task, a, b, q, su, m, ex, sc, td, mem, pids) in enumerate(EPISODES):
        agent = (b - a) - su - sc - td - 0.25  # a little time outside the parts
        status = "infra_error" if i == 1 else "ok"  # masks the group of task t0 (with episode 0)
        recs.append(
            EpisodeRecord(
                run_name="syn",
                task_id=f"t{i // 2}",
                sample=i % 2,
                status=status,
                reward=1.0 if status == "ok" else None,
                host=host,
                worker=worker,
                slurm_job_id=job,
                slurm_array_task_id=task,
                peak_mem_mb=mem,
                peak_pids=pids,
                timings=Timings(
                    start_s=BASE + a,
                    stop_s=BASE + b,
                    queue_s=q,
                    setup_s=su,
                    agent_s=agent,
                    model_s=m,
                    exec_s=ex,
                    score_s=sc,
                    teardown_s=td,
                    total_s=b - a,
                    warm_s=WARM.get(i),
                ),
            )
        )
    rs.write(recs[:2])
    rs.write(recs[2:])
    return rs


def _nearest_rank(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[math.ceil(p / 100 * len(s)) - 1]


def test_capacity_numbers_from_known_records(tmp_path: Path) -> None:
    from et_hpc.runs.capacity import run_capacity

    rs = _synthetic_store(tmp_path)
    cap = run_capacity(rs, cores=4, nodes=[2], per_node=[1, 3], gpu_hours=0.5)
    walls = [e[5] - e[4] for e in EPISODES]
    assert cap["episodes"] == 5 and cap["ok"] == 4
    # busy time: n1 runs [0,15] and [20,30] -> 25 s; n2 [0,20] and [40,50] -> 30 s; all: [0,20],[20,30],[40,50] -> 40 s
    assert cap["episodes_per_hour"] == pytest.approx(5 * 3600 / 40)
    hosts = {h["key"]: h for h in cap["by_host"]}
    assert hosts["n1"]["episodes_per_hour"] == pytest.approx(3 * 3600 / 25)
    assert hosts["n2"]["episodes_per_hour"] == pytest.approx(2 * 3600 / 30)
    assert hosts["n1"]["mean_concurrency"] == pytest.approx((10 + 10 + 10) / 25)
    workers = {w["key"]: w for w in cap["by_worker"]}
    assert set(workers) == {"n1:10", "77_0", "77_1"}  # a Slurm array task, else the process
    assert workers["n1:10"]["episodes"] == 3 and workers["77_0"]["episodes_per_hour"] == pytest.approx(3600 / 20)
    models = [e[8] for e in EPISODES]
    assert cap["model_share"] == pytest.approx(sum(models) / sum(walls))
    infra = [e[6] + e[7] + e[10] + e[11] for e in EPISODES]  # queue + setup + score + teardown
    assert cap["infra_overhead_s"]["median"] == pytest.approx(_nearest_rank(infra, 50))
    assert cap["infra_overhead_s"]["p95"] == pytest.approx(_nearest_rank(infra, 95))
    assert cap["node_overhead_s"]["median"] == pytest.approx(_nearest_rank([e[7] + e[10] + e[11] for e in EPISODES], 50))
    mems = [e[12] for e in EPISODES]
    assert cap["sandbox_mem_mb"] == {
        "n": 5,
        "median": _nearest_rank(mems, 50),
        "p95": _nearest_rank(mems, 95),
        "mean": pytest.approx(sum(mems) / 5),
        "max": 300.0,
    }
    assert cap["sandbox_pids_max"] == 9
    assert cap["time_split"]["queue"]["median"] == _nearest_rank([e[6] for e in EPISODES], 50)
    # projection: T = mean wall, c = mean (setup + exec + score + teardown); rate = min(K/T, C/c) per node
    t_mean = sum(walls) / 5
    c_mean = sum(e[7] + e[9] + e[10] + e[11] + WARM.get(i, 0.0) for i, e in enumerate(EPISODES)) / 5  # + warm
    proj = cap["projection"]
    assert proj["episode_s"] == pytest.approx(t_mean) and proj["cpu_s"] == pytest.approx(c_mean)
    assert proj["cpu_bound_at_k"] == pytest.approx(4 * t_mean / c_mean)
    expect = [(2, k, 2 * 3600 * min(k / t_mean, 4 / c_mean)) for k in (1, 3)]
    assert [(r["nodes"], r["per_node"], pytest.approx(r["episodes_per_hour"])) for r in proj["rows"]] == [
        (n, k, pytest.approx(v)) for n, k, v in expect
    ]
    assert [r["bound"] for r in proj["rows"]] == ["slots" if k / t_mean <= 4 / c_mean else "cpu" for k in (1, 3)]
    # accepted: t0's group has an error member (masked); t1 (2 ok) and t2 (1 ok) are kept
    assert cap["trainer"]["accepted_episodes"] == 3
    assert cap["trainer"]["accepted_per_gpu_hour"] == pytest.approx(3 / 0.5)


def test_gpu_hours_from_sacct_lines() -> None:
    from et_hpc.runs.capacity import gpu_hours_from_sacct

    lines = "5400|billing=8,cpu=16,gres/gpu=4,mem=128G,node=1\n1800|billing=1,cpu=2,gres/gpu=1,node=1\n"
    assert gpu_hours_from_sacct(lines) == pytest.approx(5400 * 4 / 3600 + 1800 * 1 / 3600)
    assert gpu_hours_from_sacct("6|billing=1,cpu=1,node=1\n") is None  # a CPU job, as this machine's


def test_report_has_a_capacity_section(tmp_path: Path) -> None:
    from et_hpc.runs.capacity import num
    from et_hpc.runs.report import build_report, format_html, format_text

    _synthetic_store(tmp_path)
    rep = build_report(tmp_path)
    (row,) = rep.runs
    assert row.capacity is not None and row.capacity["episodes"] == 5
    text = format_text(rep)
    assert "episodes/hour" in text and num(5 * 3600 / 40) in text.split("sandbox MB", 1)[1]
    assert "<h2>Capacity</h2>" in format_html(rep)
    out = subprocess.run(ET_HPC + ["report", str(tmp_path), "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["runs"][0]["capacity"]["episodes_per_hour"] == pytest.approx(5 * 3600 / 40)


# --- the stream's KPIs -----------------------------------------------------------------------
def _group(task: str, version: str) -> object:
    return records_to_table(
        [
            EpisodeRecord(
                run_name="s",
                task_id=task,
                sample=i,
                group_id=f"{task}@e0",
                status="ok",
                reward=1.0,
                policy_version=version,
                prompt_token_ids=[[1]],  # exact tokens: the stream hands out only trainable groups
                token_ids=[[2]],
            )
            for i in range(2)
        ]
    )


def test_stream_records_trainer_wait_and_staleness(tmp_path: Path) -> None:
    from et_hpc.rollouts import RolloutStream, publish_version
    from et_hpc.rollouts.queue import WorkQueue

    run = tmp_path / "s"
    q = WorkQueue(run).init()
    q.enqueue_epoch(["a", "b", "c", "d"], 2)
    publish_version(run, 1)
    for version in ("1", "1"):
        lease = q.claim("w")
        q.commit(lease, _group(lease.unit.task_id, version))
    s = RolloutStream(run, "trainer")
    first = s.next_batch(2, timeout_s=5)
    assert len(first) == 2
    publish_version(run, 2)  # the trainer moved on two steps; later groups started under 2 and 3
    publish_version(run, 3)
    for version in ("2", "3"):
        lease = q.claim("w")
        q.commit(lease, _group(lease.unit.task_id, version))
    second = s.next_batch(2, timeout_s=5)
    empty = s.next_batch(1, timeout_s=0.2)  # nothing left: the trainer waits out its timeout
    assert [g.policy_version for g in second] == ["2", "3"] and empty == []
    s.commit()
    s.close()
    saved = json.loads((run / "consumers" / "trainer.json").read_text())["telemetry"]
    # handed out at version 1: 1, 1 (0 behind); at version 3: 2 (1 behind), 3 (0 behind)
    assert saved["staleness"] == {"0": 3, "1": 1} and saved["calls"] == 3
    assert 0 < saved["wait_s"] <= saved["last_return_at"] - saved["first_call_at"]
    s = RolloutStream(run, "trainer")  # the telemetry carries on across restarts
    assert s.telemetry["calls"] == 3
    s.close()

    (run / "run.json").write_text(json.dumps({"name": "s", "config": {"executor": "local"}, "plan": {"units_total": 8}}))
    js = _cli("status", str(run), "--capacity", "--json", timeout=120)
    assert js.returncode == 0, js.stderr
    (c,) = json.loads(js.stdout)["capacity"]["trainer"]["consumers"]
    assert c["consumer"] == "trainer" and c["delivered"] == 4 and c["calls"] == 3
    # nearest rank over [0, 0, 0, 1]: p50 is the 2nd value, p95 the 4th
    assert (c["staleness_p50"], c["staleness_p95"]) == (0, 1)
    assert c["wait_fraction"] == pytest.approx(saved["wait_s"] / (saved["last_return_at"] - saved["first_call_at"]))
    text = _cli("status", str(run), "--capacity", timeout=120)
    assert text.returncode == 0 and "trainer waiting" in text.stdout
