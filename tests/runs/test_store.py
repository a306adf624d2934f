"""The parquet run store: atomic shards, concurrent writers, dedupe, compaction, outside readers."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from et_hpc.cli import main
from et_hpc.errors import UserError
from et_hpc.record import EPISODE_SCHEMA, EpisodeRecord
from et_hpc.runs.store import RunStore, Store, compact, open_run

T0 = datetime(2026, 12, 1, tzinfo=timezone.utc)


def rec(task: str, sample: int, status: str = "ok", reward: float | None = 1.0, minutes: int = 0, run: str = "r", **kw) -> EpisodeRecord:
    if status != "ok":
        reward = None
    return EpisodeRecord(
        run_name=run,
        task_id=task,
        sample=sample,
        status=status,
        reward=reward,
        created_at=T0 + timedelta(minutes=minutes),
        messages=[{"role": "user", "content": f"{task}/{sample}"}],
        **kw,
    )


def run_py(code: str, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], **kw)


def test_write_read_units_dedupe_and_summary(tmp_path):
    rs = Store(tmp_path).run("r")
    assert rs.read().num_rows == 0 and rs.units() == {}
    rs.write([rec("a", 0, "infra_error", minutes=1), rec("a", 1, reward=0.0), rec("b", 0, reward=1.0, passed=2, total=2)])
    retried = rec("a", 0, reward=1.0, minutes=2)  # the unit re-run after an infra error
    later_error = rec("a", 0, "timeout", minutes=3)  # an ok must still win over a newer error
    crash_copy = rec("b", 1, "policy_error", minutes=4)
    rs.write([retried])
    rs.write([later_error, crash_copy])
    rs.write([crash_copy])  # the same episode written twice (crash between write and checkpoint)
    assert rs.write([]) is None
    assert len(rs.shards()) == 4

    assert rs.units() == {("a", 0): "ok", ("a", 1): "ok", ("b", 0): "ok", ("b", 1): "policy_error"}
    t = rs.read()
    assert t.schema.equals(EPISODE_SCHEMA)
    assert t.num_rows == 4
    rows = {(r["task_id"], r["sample"]): r for r in t.to_pylist()}
    assert rows[("a", 0)]["episode_id"] == retried.episode_id
    assert rows[("b", 1)]["episode_id"] == crash_copy.episode_id
    assert rs.read(dedupe=False).num_rows == 7
    assert rs.read(columns=["task_id", "reward"]).column_names == ["task_id", "reward"]
    with pytest.raises(UserError, match="unknown column"):
        rs.read(columns=["nope"])

    s = rs.summary()
    assert (s.units, s.rows, s.ok, s.solved) == (4, 7, 3, 2)
    assert s.by_status["policy_error"] == 1 and s.by_status["timeout"] == 0
    assert s.pass_rate == pytest.approx(2 / 3) and s.mean_reward == pytest.approx(2 / 3)
    assert s.mean_test_fraction == pytest.approx(1.0)
    assert [r.episode_id for r in rs.records()] == [r["episode_id"] for r in t.to_pylist()]


def test_run_config_is_atomic_json(tmp_path):
    rs = RunStore(tmp_path / "r")
    assert rs.config() is None
    rs.write_config({"name": "r", "plan": {"units_total": 12}})
    assert rs.config()["plan"]["units_total"] == 12
    assert not [p for p in rs.path.iterdir() if p.name.startswith(".")]
    assert rs.summary().planned_units == 12
    (rs.path / "run.json").write_text("{broken")
    with pytest.raises(UserError, match="not valid JSON"):
        rs.config()


WRITER = """
import sys
from et_hpc.record import EpisodeRecord
from et_hpc.runs.store import RunStore
rs = RunStore(sys.argv[1]); w = int(sys.argv[2])
for i in range(50):
    rs.write([EpisodeRecord(run_name="r", task_id=f"t{w}", sample=i, status="ok", reward=float(i % 2),
                            messages=[{"role": "user", "content": "x" * 3000}])])
"""


def test_many_concurrent_writers_lose_nothing(tmp_path):
    run_dir = tmp_path / "r"
    procs = [run_py(WRITER, str(run_dir), str(w)) for w in range(8)]
    assert [p.wait(timeout=300) for p in procs] == [0] * 8
    rs = RunStore(run_dir)
    assert len(rs.shards()) == 400
    assert not [p for p in run_dir.iterdir() if p.name.startswith(".tmp-")]
    raw = rs.read(dedupe=False)
    assert raw.num_rows == 400
    assert len(set(raw.column("episode_id").to_pylist())) == 400
    assert len(rs.units()) == 400
    assert rs.summary().solved == 200


KILLED_WRITER = """
import os, sys
from et_hpc.record import EpisodeRecord, records_to_table
from et_hpc.runs.store import write_table_atomic
from pathlib import Path
blob = os.urandom(48_000).hex()  # incompressible, ~96 KB per record
recs = [EpisodeRecord(run_name="r", task_id="big", sample=i, status="ok", reward=1.0,
                      messages=[{"role": "tool", "content": blob[i:] + blob[:i]}]) for i in range(1200)]
table = records_to_table(recs)
print("writing", flush=True)
write_table_atomic(Path(sys.argv[1]), table)
print("done", flush=True)
"""


def test_killed_writer_leaves_only_an_ignored_temp_file(tmp_path):
    rs = RunStore(tmp_path / "r")
    rs.write([rec("a", 0), rec("a", 1)])
    p = run_py(KILLED_WRITER, str(rs.path), stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "writing"
    tmp = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and tmp is None:
        for e in os.scandir(rs.path):
            if e.name.startswith(".tmp-part-"):  # opened: the table is being encoded/written
                tmp = Path(e.path)
                break
        else:
            time.sleep(0.002)
    assert tmp is not None, "the writer never produced a partial temp file"
    time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    assert p.wait(timeout=30) == -signal.SIGKILL
    assert p.stdout.read() == ""  # it never got to "done"
    assert tmp.exists(), "the writer finished before it could be killed; make the table bigger"

    assert len(rs.shards()) == 1  # only the earlier shard is visible
    assert rs.read().num_rows == 2
    assert ds.dataset(rs.path, format="parquet").to_table().num_rows == 2  # pyarrow skips '.'-files
    # a fresh temp file may belong to a live writer: compact keeps it; an old one is removed
    assert compact(rs).removed_tmp == 0 and tmp.exists()
    old = time.time() - 2 * 3600
    os.utime(tmp, (old, old))
    assert compact(rs).removed_tmp == 1 and not tmp.exists()
    assert rs.read().num_rows == 2


READER_LOOP = """
import json, sys
from et_hpc.runs.store import RunStore
rs = RunStore(sys.argv[1]); expected = int(sys.argv[2])
reads = 0
while True:
    t = rs.read(columns=["episode_id"])
    ids = t.column("episode_id").to_pylist()
    assert len(ids) == expected == len(set(ids)), (len(ids), len(set(ids)))
    raw = rs.read(dedupe=False, columns=["episode_id"])
    assert raw.num_rows >= expected
    reads += 1
    if sys.stdin.readline().strip() == "stop":
        break
    print(sorted(ids)[0], flush=True)
print(json.dumps({"reads": reads, "ids": sorted(ids)}), flush=True)
"""


def test_compact_while_a_reader_loops(tmp_path):
    rs = RunStore(tmp_path / "r")
    all_ids = []
    for i in range(300):
        r = rec(f"t{i % 30}", i // 30, reward=float(i % 3 == 0), minutes=i)
        all_ids.append(r.episode_id)
        rs.write([r])
    rs.write([rec("t0", 0, "infra_error", minutes=999)])  # an older unit's error: loses to the ok
    reader = run_py(READER_LOOP, str(rs.path), "300", stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    comp = subprocess.Popen(
        [sys.executable, "-m", "et_hpc.cli", "store", "compact", str(rs.path), "--target-rows", "16", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    while comp.poll() is None:  # keep the reader reading for as long as the compaction runs
        reader.stdin.write("go\n")
        reader.stdin.flush()
        assert reader.stdout.readline(), "reader died during compaction"
    reader.stdin.write("go\nstop\n")
    reader.stdin.flush()
    out, _ = reader.communicate(timeout=120)
    assert reader.returncode == 0, out
    final = json.loads(out.strip().splitlines()[-1])
    assert final["reads"] >= 2
    assert final["ids"] == sorted(all_ids)
    res = json.loads(comp.stdout.read())
    assert comp.returncode == 0
    assert res["inputs"] == 301 and res["rows"] == 301 and res["shards_after"] == res["outputs"] == 19
    assert rs.read(dedupe=False).num_rows == 301
    assert sorted(rs.read().column("episode_id").to_pylist()) == sorted(all_ids)
    # compacting again finds nothing small enough left to merge (the last shard is alone)
    assert compact(rs, target_rows=16).outputs == 0


def test_compact_drops_copies_of_one_episode(tmp_path):
    rs = RunStore(tmp_path / "r")
    a = rec("a", 0)
    rs.write([a])
    rs.write([a])
    rs.write([rec("a", 1)])
    assert rs.read(dedupe=False).num_rows == 3
    res = compact(rs)
    assert (res.inputs, res.outputs, res.rows, res.shards_after) == (3, 1, 2, 1)


def test_outside_readers_read_the_store(tmp_path, monkeypatch):
    rs = RunStore(tmp_path / "r")
    for i in range(4):
        rs.write([rec("a", 2 * i, token_ids=[[1, 2]], prompt_token_ids=[[3]]), rec("b", 2 * i + 1)])
    (rs.path / ".tmp-part-partial.parquet").write_bytes(b"PAR1 half a file")
    files = sorted(glob.glob(str(rs.path / "part-*.parquet")))

    # pyarrow: a bare run dir works (hidden temp ignored) ...
    assert ds.dataset(rs.path, format="parquet").to_table().num_rows == 8
    # ... but the runner also leaves run.json and slurm/ there: pass the shard list, or skip invalid files
    rs.write_config({"name": "r"})
    (rs.path / "slurm").mkdir()
    (rs.path / "slurm" / "123_0_log.out").write_text("log")
    assert ds.dataset(files, format="parquet").to_table().num_rows == 8
    assert ds.dataset(rs.path, format="parquet", exclude_invalid_files=True).to_table().num_rows == 8

    import pandas as pd

    df = pd.read_parquet(files)
    assert len(df) == 8 and set(df["task_id"]) == {"a", "b"}

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import datasets

    d = datasets.load_dataset("parquet", data_files=str(rs.path / "part-*.parquet"), split="train")
    assert d.num_rows == 8
    assert sorted(d["sample"]) == list(range(8))
    row = [r for r in d if r["task_id"] == "a"][0]
    assert row["token_ids"] == [[1, 2]] and json.loads(row["messages"])[0]["role"] == "user"
    assert rs.read().num_rows == 8


def test_store_runs_and_bad_names(tmp_path):
    st = Store(tmp_path)
    st.run("one").write([rec("a", 0)])
    st.run("two").write_config({})
    assert st.runs() == ["one", "two"]
    for bad in ("", "../x", ".hidden", "_x"):
        with pytest.raises(UserError):
            st.run(bad)


def test_cli_summary_and_bad_paths(tmp_path, capsys):
    rs = Store(tmp_path).run("r")
    rs.write([rec("a", 0), rec("a", 1, "shell_error"), rec("b", 0, reward=0.0)])
    assert main(["store", "summary", str(rs.path), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert (s["units"], s["ok"], s["solved"], s["by_status"]["shell_error"]) == (3, 2, 1, 1)
    assert main(["store", "summary", str(rs.path)]) == 0
    out = capsys.readouterr().out
    assert "shell_error" in out and "pass rate 50.0%" in out

    for bad, why in [(tmp_path / "missing", "does not exist"), (tmp_path, "not a run directory"), (rs.shards()[0], "not a directory")]:
        assert main(["store", "summary", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("et-hpc: error: ") and why in err
    assert main(["store", "compact", str(tmp_path)]) == 2
    assert "holds runs: r" in capsys.readouterr().err


def test_open_run_accepts_a_planned_run_without_shards(tmp_path):
    rs = RunStore(tmp_path / "r")
    rs.write_config({"plan": {"units_total": 3}})
    assert open_run(rs.path).summary().units == 0
    with pytest.raises(UserError):
        open_run(tmp_path / "nothing")
    assert pq.read_schema(rs.write([rec("a", 0)])).equals(EPISODE_SCHEMA)


def test_units_cache_follows_new_and_compacted_shards(tmp_path):
    rs = RunStore(tmp_path / "r")
    for i in range(6):
        rs.write([rec("a", i, "infra_error" if i == 5 else "ok")])
    first = rs.units()
    assert len(first) == 6 and first[("a", 5)] == "infra_error"
    rs.write([rec("a", 5, minutes=9)])
    assert rs.units()[("a", 5)] == "ok"
    compact(rs)
    assert len(rs.shards()) == 1
    assert rs.units() == {("a", i): "ok" for i in range(6)}
    assert RunStore(rs.path).units() == rs.units()  # a fresh reader agrees with the cached one


def test_a_corrupt_shard_is_named(tmp_path):
    rs = RunStore(tmp_path / "r")
    rs.write([rec("a", 0)])
    bad = rs.path / "part-99999999T000000000000Z-x-1-dead.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(UserError, match="dead.parquet is not a readable parquet file"):
        rs.read()
    with pytest.raises(UserError, match="dead.parquet is not a readable parquet file"):
        rs.units()


def test_one_run_store_shared_by_threads(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    rs = RunStore(tmp_path / "r")

    def work(i: int) -> int:
        rs.write([rec(f"t{i}", 0)])
        return len(rs.units())

    with ThreadPoolExecutor(8) as ex:
        seen = list(ex.map(work, range(64)))
    assert min(seen) >= 1 and max(seen) == 64
    assert len(rs.units()) == 64
