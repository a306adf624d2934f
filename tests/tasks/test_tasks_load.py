"""Task sources: the real fixtures load, parquet rows remap, filters select, bad input is named."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from et_hpc.errors import TaskError, UserError
from et_hpc.tasks.filters import sample_tasks
from et_hpc.tasks.loader import load_task_folder, load_tasks
from helpers import REPO


def test_native_fixtures_load(fixtures_dir: Path):
    res = load_tasks(fixtures_dir / "native")
    assert res.errors == [] and res.skipped == 0
    assert len(res.tasks) == 6
    for t in res.tasks:
        assert t.source_kind == "native" and t.recipe.kind == "def"
        assert t.recipe.path.name == "container.def"
        assert t.prompt and t.truth
        assert t.initial_tests.name == "test_initial_state.py" and t.final_tests.name == "test_final_state.py"
        # the Qwen summary counts, the empty summary.json placeholder does not
        assert [p.name for p in t.recorded_runs] == ["Qwen_Qwen3-32B-AWQ_summary.json"]
        assert t.solution is None
        assert t.metadata["name"] == t.id


def test_harbor_fixtures_load(fixtures_dir: Path):
    res = load_tasks(fixtures_dir / "harbor")
    assert res.errors == []
    assert len(res.tasks) == 20
    diffs = {}
    for t in res.tasks:
        assert t.source_kind == "harbor" and t.recipe.kind == "dockerfile"
        assert t.recipe.context_dir == t.source / "environment"
        assert t.truth, t.id
        assert t.final_tests == t.source / "tests" / "test_final_state.py"
        assert t.initial_tests == t.source / "environment" / "test_initial_state.py"
        assert t.limits.wall_time_s == 300.0 and t.limits.verifier_timeout_s == 300.0
        assert t.limits.cpus == 1 and t.limits.memory_mb == 2048 and t.limits.storage_mb == 10240
        assert t.metadata["category"] == "programming"
        diffs[t.metadata["difficulty"]] = diffs.get(t.metadata["difficulty"], 0) + 1
    assert set(diffs) <= {"easy", "medium", "hard"} and sum(diffs.values()) == 20


def test_mixed_folder_and_single_task(fixtures_dir: Path, tmp_path: Path):
    for kind, name in (("native", "task_000000_9cc1e5be"), ("harbor", "task_000000_3cf0f086")):
        shutil.copytree(fixtures_dir / kind / name, tmp_path / name)
    (tmp_path / "not_a_task").mkdir()
    res = load_tasks(tmp_path)
    assert res.kind == "folder"
    assert {t.id: t.source_kind for t in res.tasks} == {"task_000000_9cc1e5be": "native", "task_000000_3cf0f086": "harbor"}
    one = load_tasks(tmp_path / "task_000000_3cf0f086")
    assert one.kind == "task" and [t.id for t in one.tasks] == ["task_000000_3cf0f086"]


def test_parquet_remaps_and_skips(fixtures_dir: Path, caplog):
    train = fixtures_dir / "skyrl" / "train.parquet"
    with caplog.at_level("WARNING"):
        res = load_tasks(train, tasks_dir=fixtures_dir / "native")
    assert res.kind == "parquet"
    assert sorted(t.id for t in res.tasks) == [
        "task_000000_6eba56f8",
        "task_000000_9cc1e5be",
        "task_000000_c79e7c5d",
        "task_000000_f6642236",
    ]
    assert res.skipped == 6 and res.errors == []
    warnings = [r for r in caplog.records if "skipped 6 of 10 rows" in r.getMessage()]
    assert len(warnings) == 1
    for t in res.tasks:
        assert t.split == "train" and t.source_kind == "parquet"
        assert t.metadata["layout"] == "native" and t.metadata["data_source"] == "endless"
        assert t.limits.wall_time_s == 300.0  # extra_info.max_time
        assert t.source.parent == (fixtures_dir / "native").resolve()


def test_parquet_folder_offline_one_level_down(fixtures_dir: Path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # tasks dir is the parent of native/ and harbor/: folders are found one level down
    res = load_tasks(fixtures_dir / "skyrl", tasks_dir=fixtures_dir)
    assert res.skipped == 6 and res.errors == []
    splits = sorted((t.split, t.id) for t in res.tasks)
    assert [s for s, _ in splits].count("validation") == 2 and [s for s, _ in splits].count("train") == 4
    val = load_tasks(fixtures_dir / "skyrl", tasks_dir=fixtures_dir, split="validation")
    assert sorted(t.id for t in val.tasks) == ["task_000000_3bb4337a", "task_000000_dfbcff7a"]


def test_parquet_wrong_columns(tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    bad = tmp_path / "train.parquet"
    pq.write_table(pa.table({"question": ["x"], "answer": ["y"]}), bad)
    res = load_tasks(bad, tasks_dir=tmp_path)
    assert res.tasks == [] and len(res.errors) == 1
    msg = str(res.errors[0])
    assert str(bad) in msg and "description" in msg and "task_dir" in msg and "\n" not in msg


def test_filters(fixtures_dir: Path):
    h = fixtures_dir / "harbor"
    ids = ["task_000000_3cf0f086", "task_000000_ff383938"]
    assert [t.id for t in load_tasks(h, ids=ids).tasks] == ids
    assert [t.id for t in load_tasks(h, glob="task_000000_4*").tasks] == ["task_000000_41566988", "task_000000_4938f8ac"]
    a = [t.id for t in load_tasks(h, sample=5, seed=7).tasks]
    b = [t.id for t in load_tasks(h, sample=5, seed=7).tasks]
    c = [t.id for t in load_tasks(h, sample=5, seed=8).tasks]
    assert a == b and len(a) == 5 and len(set(a)) == 5 and a != c
    assert len(load_tasks(h, sample=50).tasks) == 20
    missing = load_tasks(h, ids=["task_000000_3cf0f086", "nope"])
    assert [t.id for t in missing.tasks] == ["task_000000_3cf0f086"]
    assert len(missing.errors) == 1 and "'nope'" in str(missing.errors[0])


def test_sample_is_order_independent(fixtures_dir: Path):
    tasks = load_tasks(fixtures_dir / "harbor").tasks
    assert [t.id for t in sample_tasks(tasks, 4, 3)] == [t.id for t in sample_tasks(list(reversed(tasks)), 4, 3)]


# -- bad input: each gives a TaskError naming the file, and the other tasks still load ----------


def _native(root: Path, name: str, **files: str | bytes) -> Path:
    d = root / name
    d.mkdir()
    defaults = {
        "task.json": json.dumps({"description": "do it", "truth": "t", "name": name}),
        "container.def": "Bootstrap: localimage\nFrom: ./ubuntu_22.04.sif\n\n%post\n    mkdir -p /home/user\n",
        "test_final_state.py": "def test_x():\n    assert True\n",
    }
    defaults.update(files)
    for fname, content in defaults.items():
        if content is None:
            continue
        p = d / fname
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return d


@pytest.mark.parametrize(
    "name, files, expect_file, expect_words",
    [
        ("no_recipe", {"container.def": None}, "", ["no recipe", "container.def"]),
        ("no_description", {"task.json": json.dumps({"truth": "x"})}, "task.json", ["description"]),
        ("bad_json", {"task.json": '{"description": "x",'}, "task.json", ["invalid JSON", "line 1"]),
        ("not_utf8", {"task.json": b'{"description": "caf\xe9"}'}, "task.json", ["not UTF-8", "0xe9"]),
        ("json_list", {"task.json": "[1, 2]"}, "task.json", ["JSON object"]),
    ],
)
def test_bad_native_folder(tmp_path: Path, name, files, expect_file, expect_words):
    good = _native(tmp_path, "good_task")
    bad = _native(tmp_path, name, **files)
    res = load_tasks(tmp_path)
    assert [t.id for t in res.tasks] == ["good_task"] and good.exists()
    assert len(res.errors) == 1
    e = res.errors[0]
    assert isinstance(e, TaskError)
    msg = str(e)
    assert str(bad / expect_file).rstrip("/") in msg and "\n" not in msg
    for w in expect_words:
        assert w in msg


def test_unreadable_task_json(tmp_path: Path):
    d = _native(tmp_path, "t1", **{"task.json": None})
    (d / "task.json").mkdir()  # a folder where a file should be: unreadable even for root
    res = load_tasks(tmp_path)
    assert res.tasks == [] and "cannot read" in str(res.errors[0]) and str(d / "task.json") in str(res.errors[0])


def test_bad_harbor_toml(fixtures_dir: Path, tmp_path: Path):
    src = fixtures_dir / "harbor" / "task_000000_3cf0f086"
    shutil.copytree(src, tmp_path / "bad_toml")
    shutil.copytree(src, tmp_path / "ok_task")
    (tmp_path / "bad_toml" / "task.toml").chmod(0o644)
    (tmp_path / "bad_toml" / "task.toml").write_text("[agent\ntimeout_sec = 3\n")
    res = load_tasks(tmp_path)
    assert [t.id for t in res.tasks] == ["ok_task"]
    assert "invalid TOML" in str(res.errors[0]) and str(tmp_path / "bad_toml" / "task.toml") in str(res.errors[0])


def test_harbor_without_dockerfile(fixtures_dir: Path, tmp_path: Path):
    shutil.copytree(fixtures_dir / "harbor" / "task_000000_3cf0f086", tmp_path / "t")
    os.chmod(tmp_path / "t" / "environment", 0o755)
    (tmp_path / "t" / "environment" / "Dockerfile").unlink()
    with pytest.raises(TaskError, match="no recipe"):
        load_task_folder(tmp_path / "t")


def test_validate_reports_def_problems(tmp_path: Path):
    _native(tmp_path, "ok")
    _native(tmp_path, "no_bootstrap", **{"container.def": "From: x\n%post\n    true\n"})
    _native(tmp_path, "bad_section", **{"container.def": "Bootstrap: localimage\nFrom: ./ubuntu_22.04.sif\n%postt\n  true\n"})
    plain = load_tasks(tmp_path)
    assert len(plain.tasks) == 3 and plain.errors == []
    res = load_tasks(tmp_path, validate=True, base_map={"ubuntu_22.04.sif": tmp_path / "base.sif"})
    assert [t.id for t in res.tasks] == ["ok"]
    msgs = sorted(str(e) for e in res.errors)
    assert len(msgs) == 2
    assert msgs[0].startswith(str(tmp_path / "bad_section" / "container.def") + ":3:")
    assert msgs[1].startswith(str(tmp_path / "no_bootstrap" / "container.def"))
    assert any("unknown section '%postt'" in m and ":3:" in m for m in msgs)
    assert any("no 'Bootstrap:' header" in m and "no_bootstrap" in m for m in msgs)


def test_missing_tasks_dir_fails_whole_load(fixtures_dir: Path, tmp_path: Path):
    with pytest.raises(UserError, match="tasks dir"):
        load_tasks(fixtures_dir / "skyrl" / "train.parquet", tasks_dir=tmp_path / "nope")
    with pytest.raises(UserError, match="no such file"):
        load_tasks(tmp_path / "missing")


# -- CLI ----------------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "et_hpc.cli", *args], capture_output=True, text=True, env=env, timeout=300)


def test_cli_list_json_and_table(fixtures_dir: Path):
    r = _cli("tasks", "list", str(fixtures_dir / "harbor"), "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert len(data["tasks"]) == 20 and data["errors"] == []
    assert all("truth" not in t and t["has_truth"] for t in data["tasks"])
    r = _cli("tasks", "list", str(fixtures_dir / "skyrl"), "--tasks-dir", str(fixtures_dir / "native"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("task_000000_") == 6 and "validation" in r.stdout
    assert "6 parquet rows skipped" in r.stderr


def test_cli_list_bad_input_exit_2(tmp_path: Path):
    _native(tmp_path, "good")
    _native(tmp_path, "broken", **{"task.json": "{"})
    r = _cli("tasks", "list", str(tmp_path))
    assert r.returncode == 2
    assert "good" in r.stdout
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("et-hpc: error:")]
    assert len(err) == 1 and str(tmp_path / "broken" / "task.json") in err[0]
    assert "Traceback" not in r.stderr
    r = _cli("tasks", "list", str(tmp_path / "nowhere"))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "no such file" in r.stderr
    r = _cli("tasks", "list", str(tmp_path), "--tasks-dir", str(tmp_path / "nowhere"))
    assert r.returncode == 2 and "tasks dir" in r.stderr and "Traceback" not in r.stderr


def test_cli_show(fixtures_dir: Path):
    r = _cli("tasks", "show", "task_000000_9cc1e5be", str(fixtures_dir / "native"))
    assert r.returncode == 0, r.stderr
    assert "From: ./ubuntu_22.04.sif -> " in r.stdout and "%post -c /bin/bash" in r.stdout
    assert "truth hidden" in r.stdout
    truth = json.loads((fixtures_dir / "native" / "task_000000_9cc1e5be" / "task.json").read_text())["truth"]
    assert truth[:40] not in r.stdout
    r2 = _cli("tasks", "show", "task_000000_9cc1e5be", str(fixtures_dir / "native"), "--truth")
    assert truth[:40] in r2.stdout
    r3 = _cli("tasks", "show", "no_such_task", str(fixtures_dir / "native"))
    assert r3.returncode == 2 and "no_such_task" in r3.stderr and "Traceback" not in r3.stderr
