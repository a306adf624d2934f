"""Warm sandboxes (sandbox.warm): started ahead, handed out once, replaced when dead, never left behind."""

from __future__ import annotations

import getpass
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from et_hpc.host import apptainer
from helpers import REPO, until

pytestmark = pytest.mark.apptainer

ET_HPC = [sys.executable, "-m", "et_hpc.cli"]
DEMO = REPO / "defs" / "demo"
HANDOUT = re.compile(r"episode (\S+)#(\d+): sandbox (\S+) \((warm|started inline)\)")


def _env(tmp_path: Path) -> dict[str, str]:
    return dict(os.environ, ET_HPC_SCRATCH=str(tmp_path / "scratch"))


def _scratch(tmp_path: Path) -> Path:
    return tmp_path / "scratch" / f"et-hpc-{getpass.getuser()}"


def _instances(prefix: str) -> set[str]:
    return {i.name for i in apptainer.instance_list() if i.name.startswith(prefix)}


def _leftovers(scratch: Path) -> list[Path]:
    return sorted([*scratch.glob("overlays/*.img"), *scratch.glob("live/*.json")])


@pytest.fixture(scope="module")
def demo_built(base_sif: Path) -> Path:
    b = subprocess.run(ET_HPC + ["build", str(DEMO)], capture_output=True, text=True, timeout=900)
    assert b.returncode == 0, b.stderr[-2000:]
    return DEMO


def _demo_specs(tmp_path: Path, name: str) -> dict:
    """The sandbox spec of each demo task, for a run called ``name``."""
    from et_hpc.episode.run import sandbox_spec
    from et_hpc.runner.config import RunConfig
    from et_hpc.runner.plan import make_plan

    cfg = RunConfig(name=name, store=tmp_path / "store", policy={"kind": "oracle"}, tasks={"source": str(DEMO)})
    plan = make_plan(cfg)
    return {t: sandbox_spec(plan.tasks[t], cfg, plan.images[t]) for t in sorted(plan.tasks)}


def _run(tmp_path: Path, name: str, *extra: str) -> tuple[subprocess.CompletedProcess, list]:
    cp = subprocess.run(
        ET_HPC
        + [
            "-vv",
            "run",
            str(DEMO),
            "--policy",
            "oracle",
            "--concurrency",
            "2",
            "--store",
            str(tmp_path / "store"),
            "--run-name",
            name,
            *extra,
        ],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert cp.returncode == 0, cp.stderr[-3000:]
    from et_hpc.runs.store import RunStore

    return cp, RunStore(tmp_path / "store" / name).read().to_pylist()


def test_warm_run_matches_cold_and_uses_each_sandbox_once(demo_built: Path, tmp_path: Path) -> None:
    cold_cp, cold = _run(tmp_path, "warmtest-cold", "--set", "sandbox.warm=0")
    warm_cp, warm = _run(tmp_path, "warmtest-warm", "--set", "sandbox.warm=2")
    assert len(cold) == len(warm) == 4
    assert all(r["status"] == "ok" for r in cold + warm), [(r["task_id"], r["status"], r["error"]) for r in cold + warm]
    rewards = {(r["task_id"], r["sample"]): r["reward"] for r in cold}
    assert {(r["task_id"], r["sample"]): r["reward"] for r in warm} == rewards
    assert set(rewards.values()) == {1.0}

    # every episode names its sandbox once; no name twice: no sandbox served two episodes
    cold_log, warm_log = HANDOUT.findall(cold_cp.stderr), HANDOUT.findall(warm_cp.stderr)
    assert {how for *_, how in cold_log} == {"started inline"} and len(cold_log) == 4
    assert len(warm_log) == 4
    assert len({name for _, _, name, _ in warm_log}) == 4
    warmed = {(t, int(s)) for t, s, _, how in warm_log if how == "warm"}
    assert len(warmed) >= 2, warm_log  # the first episode(s) start inline, the later ones warm
    for r in warm:
        t = r["timings"]
        assert (t["warm_s"] is not None) == ((r["task_id"], r["sample"]) in warmed), r["timings"]
        assert t["setup_s"] is not None
    assert all(r["timings"]["warm_s"] is None for r in cold)

    # nothing left: instances, overlays, registry files
    assert not _instances("et-warmtest-")
    assert _leftovers(_scratch(tmp_path)) == []


def test_dead_warm_sandbox_is_replaced(demo_built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ET_HPC_SCRATCH", str(tmp_path / "scratch"))
    from et_hpc.episode.run import run_episode, sandbox_spec
    from et_hpc.runner.config import RunConfig
    from et_hpc.runner.plan import make_plan
    from et_hpc.sandbox.warm import WarmPool

    cfg = RunConfig(
        name="warmtest-dead", store=tmp_path / "store", policy={"kind": "oracle"}, tasks={"source": str(DEMO), "ids": ["demo_hello_file"]}
    )
    plan = make_plan(cfg)
    task = plan.tasks["demo_hello_file"]
    image = plan.images["demo_hello_file"]
    spec = sandbox_spec(task, cfg, image)
    with WarmPool(1) as pool:
        pool.want("test", [spec])
        ticket = pool.reserve(spec)
        pool.want("test", [])
        assert ticket is not None
        entry = ticket._entry
        assert entry.done.wait(120) and entry.ready is not None, entry.error
        victim = entry.ready.sandbox
        assert victim.health() == "alive"
        apptainer.instance_stop(victim.name, timeout_s=0)  # killed from outside before the hand-out
        until("the instance to be gone", lambda: victim.health() == "gone", 30, 0.1)
        rec = run_episode(task, 0, cfg, image, warm=ticket)
    assert rec.status == "ok" and rec.reward == 1.0, (rec.status, rec.error)
    assert rec.timings.warm_s is None  # the fresh one was started inline
    assert victim.overlay is not None and not victim.overlay.exists()
    assert victim.registry is not None and not victim.registry.exists()
    assert not _instances("et-warmtest-")
    assert _leftovers(_scratch(tmp_path)) == []


def test_pool_close_stops_warm_and_starting_sandboxes(demo_built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ET_HPC_SCRATCH", str(tmp_path / "scratch"))
    import threading

    from et_hpc.sandbox.warm import WarmPool

    specs = list(_demo_specs(tmp_path, "warmtest-close").values())
    stop = threading.Event()
    pool = WarmPool(3, stop=stop)
    pool.want("a", specs)  # 4 wanted, 3 allowed
    assert pool.started == 3
    until("a warm sandbox", lambda: _instances("et-warmtest-close"), 120, 0.1)
    stop.set()  # what SIGTERM does to a run: the pool closes itself, starts in flight included
    until("the pool to close", lambda: pool.closed, 10, 0.05)
    pool.close()  # waits for starts in flight
    assert not _instances("et-warmtest-close")
    assert _leftovers(_scratch(tmp_path)) == []
    assert pool.reserve(specs[0]) is None


def test_continuous_worker_warms_the_rest_of_its_group(demo_built: Path, tmp_path: Path) -> None:
    cp = subprocess.run(
        ET_HPC
        + [
            "-vv",
            "run",
            str(DEMO),
            "--policy",
            "oracle",
            "--continuous",
            "--target-groups",
            "2",
            "--samples",
            "3",
            "--concurrency",
            "1",
            "--set",
            "sandbox.warm=1",
            "--store",
            str(tmp_path / "store"),
            "--run-name",
            "warmtest-cont",
        ],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert cp.returncode == 0, cp.stderr[-3000:]
    from et_hpc.runs.store import RunStore

    recs = RunStore(tmp_path / "store" / "warmtest-cont").read().to_pylist()
    assert len(recs) == 6 and all(r["status"] == "ok" and r["reward"] == 1.0 for r in recs)
    # a group is 3 episodes of one task in a row: the first starts its sandbox, the others get warm ones
    for r in recs:
        assert (r["timings"]["warm_s"] is not None) == (r["sample"] > 0), (r["task_id"], r["sample"], r["timings"])
    names = [name for *_, name, _ in HANDOUT.findall(cp.stderr)]
    assert len(names) >= 6 and len(set(names)) == len(names)
    assert not _instances("et-warmtest-")
    assert _leftovers(_scratch(tmp_path)) == []


def test_shards_without_warm_s_still_read(tmp_path: Path) -> None:
    """Rows written before timings.warm_s existed read with it null, beside new rows."""
    import pyarrow as pa

    from et_hpc.record import EPISODE_SCHEMA, TIMING_FIELDS, EpisodeRecord, records_to_table
    from et_hpc.runs.store import RunStore

    old_timings = pa.struct([(f, pa.float64()) for f in TIMING_FIELDS if f != "warm_s"])
    old = pa.schema(
        [pa.field("timings", old_timings) if f.name == "timings" else f for f in EPISODE_SCHEMA], metadata=EPISODE_SCHEMA.metadata
    )
    row = records_to_table(
        [EpisodeRecord(run_name="r", task_id="t", sample=0, status="ok", reward=1.0, timings={"setup_s": 0.5})]
    ).to_pylist()[0]
    row["timings"] = {k: v for k, v in row["timings"].items() if k != "warm_s"}
    run = tmp_path / "r"
    run.mkdir()
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([row], schema=old), run / "part-20250101T000000000000Z-h-1-0.parquet")
    store = RunStore(run)
    store.write([EpisodeRecord(run_name="r", task_id="t", sample=1, status="ok", reward=1.0, timings={"setup_s": 0.002, "warm_s": 0.7})])
    got = {r.sample: r.timings for r in store.records()}
    assert got[0].setup_s == 0.5 and got[0].warm_s is None
    assert got[1].setup_s == 0.002 and got[1].warm_s == 0.7


def test_unwanted_warm_sandbox_makes_room_and_tickets_hand_out_once(
    demo_built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ET_HPC_SCRATCH", str(tmp_path / "scratch"))
    from et_hpc.sandbox.warm import WarmPool

    specs = _demo_specs(tmp_path, "warmtest-room")
    a, b = specs["demo_hello_file"], specs["demo_csv_sum"]
    assert a != b
    with WarmPool(1) as pool:
        pool.want("q", [a])
        until(
            "a warm sandbox of A", lambda: len(_instances("et-warmtest-room")) == 1 and all(e.done.is_set() for e in pool._stock), 120, 0.1
        )
        (first,) = _instances("et-warmtest-room")
        pool.want("q", [b])  # A is no longer wanted: it is stopped to make room for B
        until("A stopped", lambda: first not in _instances("et-warmtest-room"), 60, 0.1)
        assert pool.reserve(a) is None
        ticket = pool.reserve(b)
        assert ticket is not None and pool.reserve(b) is None  # reserved once
        pool.want("q", [])
        ready = ticket.take()
        assert ready is not None
        assert ready.sandbox.name != first and ready.shell.run("umask").output.strip() == "0002"
        assert ticket.take() is None  # handed out once
        ticket.discard()  # no-op once handed out: the sandbox is the taker's
        assert ready.sandbox.health() == "alive"
        ready.stop()
    assert not _instances("et-warmtest-room")
    assert _leftovers(_scratch(tmp_path)) == []


def test_finished_sandboxes_are_retired_in_the_background(demo_built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ET_HPC_SCRATCH", str(tmp_path / "scratch"))
    from et_hpc.sandbox.warm import WarmPool, start_ready

    spec = next(iter(_demo_specs(tmp_path, "warmtest-retire").values()))
    pool = WarmPool(0)
    ready = [start_ready(spec), start_ready(spec)]
    names = {r.sandbox.name for r in ready}
    assert names <= _instances("et-warmtest-retire")  # positive control: both run
    assert pool.retire(ready)  # returns at once; the pool stops them
    pool.close()  # waits for the retired ones
    assert not _instances("et-warmtest-retire") and _leftovers(_scratch(tmp_path)) == []
    late = start_ready(spec)
    assert not pool.retire([late])  # a closed pool takes nothing: the caller stops it
    assert late.sandbox.name in _instances("et-warmtest-retire")
    late.stop()
    assert not _instances("et-warmtest-retire")
