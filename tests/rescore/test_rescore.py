"""Kept final states and ``et-hpc rescore``, end to end: real oracle episodes of the demo tasks with
``sandbox.keep_final_state``, rescored with the tasks' own tests (every reward stays 1.0: the kept
state holds the solution) and with inverted tests (every reward flips to 0), the source run left
byte-for-byte unchanged; the size bound; a damaged state; bad input."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from et_hpc.cli.app import main
from et_hpc.record import records_from_table
from et_hpc.runs import final_state as fs
from et_hpc.runs.store import RunStore
from helpers import REPO, with_tests_on_path
from helpers.inverted import inverted_dir
from helpers.units import et_hpc

DEMO = REPO / "defs" / "demo"
TASKS = sorted(p.name for p in DEMO.iterdir() if (p / "test_final_state.py").is_file())
KEEP = ["--set", "sandbox.keep_final_state=true"]

pytestmark = [pytest.mark.apptainer]


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _snapshot(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): _sha(p) for p in sorted(d.rglob("*")) if p.is_file()}


def _records(run_dir: Path) -> dict[tuple[str, int], object]:
    return {(r.task_id, r.sample): r for r in records_from_table(RunStore(run_dir).read())}


@pytest.fixture(scope="module")
def kept_run(base_sif: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """One oracle episode per demo task, with their final states kept."""
    root = tmp_path_factory.mktemp("rescore")
    env = dict(with_tests_on_path(os.environ), ET_HPC_STORE=str(root / "store"))
    b = et_hpc(["build", str(DEMO)], env, timeout=900)
    assert b.returncode == 0, b.stderr[-2000:]
    r = et_hpc(["run", str(DEMO), "--policy", "oracle", "--run-name", "src", "--concurrency", "2", *KEEP], env)
    assert r.returncode == 0, r.stderr[-2000:]
    return root / "store" / "src", env


def test_kept_states_flip_under_inverted_tests_and_the_source_is_untouched(kept_run, tmp_path: Path) -> None:
    src_dir, env = kept_run
    src = _records(src_dir)
    assert sorted(t for t, _ in src) == TASKS
    for (tid, _), r in src.items():
        assert r.status == "ok" and r.reward == 1.0, (tid, r.error, r.score_note)
        archive = fs.archive_path(src_dir, r.final_state)  # content-addressed: named by its sha256
        assert archive.is_file() and _sha(archive) == fs.digest_of(r.final_state)
        assert r.tests_digest == "sha256:" + _sha(DEMO / tid / "test_final_state.py")
        assert fs.kept_tests(src_dir, r.tests_digest) == (DEMO / tid / "test_final_state.py").read_text()
    before = _snapshot(src_dir)

    # control: the tasks' own tests on the kept states give the live rewards back
    same = et_hpc(["rescore", "src", "--task-source", str(DEMO), "--run-name", "same", "--json"], env)
    assert same.returncode == 0, same.stderr[-2000:]
    rep = json.loads(same.stdout)
    assert rep["rescored"] == len(TASKS) and rep["flipped"] == 0 and rep["not_rescored"] == 0
    assert all(r.reward == 1.0 for r in _records(src_dir.parent / "same").values())

    inv = inverted_dir(DEMO, tmp_path / "inverted")
    r = et_hpc(["rescore", "src", "--tests", str(inv), "--run-name", "inv", "--json"], env)
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(r.stdout)
    assert rep["rescored"] == len(TASKS) and rep["flipped"] == len(TASKS)
    for tid in TASKS:
        t = rep["tasks"][tid]
        assert [(f["old_reward"], f["new_reward"]) for f in t["flipped"]] == [(1.0, 0.0)]
        assert "+def test_the_original_tests_fail():" in t["diff"] and "-def test_" in t["diff"]
    new_dir = src_dir.parent / "inv"
    new = _records(new_dir)
    assert sorted(new) == sorted(src)
    for key, n in new.items():
        o = src[key]
        assert n.status == "ok" and n.reward == 0.0 and n.run_name == "inv"
        assert n.tests and all(t.outcome == "failed" for t in n.tests)
        assert n.rescored_from == f"src/{o.episode_id}" and n.episode_id != o.episode_id
        assert n.tests_digest == "sha256:" + _sha(inv / key[0] / "test_final_state.py")
        assert (n.messages, n.turns, n.policy_kind, n.policy_version, n.versions, n.prompt_tokens, n.token_ids) == (
            o.messages,
            o.turns,
            o.policy_kind,
            o.policy_version,
            o.versions,
            o.prompt_tokens,
            o.token_ids,
        )
        assert n.final_state == o.final_state and fs.archive_path(new_dir, n.final_state).is_file()
    assert _snapshot(src_dir) == before, "the source run changed"

    # resumable: the same command again scores nothing and writes nothing
    shards = sorted(p.name for p in new_dir.glob("part-*.parquet"))
    again = et_hpc(["rescore", "src", "--tests", str(inv), "--run-name", "inv"], env)
    assert again.returncode == 0 and "0 episode(s) to score" in again.stderr, again.stderr
    assert sorted(p.name for p in new_dir.glob("part-*.parquet")) == shards
    diff = et_hpc(["rescore", "inv", "--diff"], env)
    assert diff.returncode == 0 and f"{len(TASKS)} flipped" in diff.stdout and "1 -> 0" in diff.stdout


def test_a_damaged_state_is_an_error_not_a_zero(kept_run, tmp_path: Path) -> None:
    src_dir, env = kept_run
    copy = tmp_path / "store" / "copy"
    shutil.copytree(src_dir, copy)
    rec = _records(copy)[("demo_hello_file", 0)]
    archive = fs.archive_path(copy, rec.final_state)
    data = bytearray(archive.read_bytes())
    data[len(data) // 2] ^= 0xFF
    archive.write_bytes(bytes(data))
    tests = tmp_path / "t"
    inverted_dir(DEMO, tests)
    for d in tests.iterdir():
        if d.name != "demo_hello_file":
            shutil.rmtree(d)
    e = dict(env, ET_HPC_STORE=str(tmp_path / "store"))
    r = et_hpc(["rescore", "copy", "--tests", str(tests), "--run-name", "dmg", "--json"], e)
    rep = json.loads(r.stdout)
    t = rep["tasks"]["demo_hello_file"]
    assert len(t["errors"]) == 1 and "does not match its digest" in t["errors"][0]["error"], t
    n = _records(tmp_path / "store" / "dmg")[("demo_hello_file", 0)]
    assert n.status == "infra_error" and n.reward is None
    assert {s["why"] for s in rep["tasks"]["demo_csv_sum"]["not_rescored"]} == {"no new tests for its task"}


def test_size_bound_and_bad_input(kept_run, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src_dir, env = kept_run
    r = et_hpc(
        [
            "run",
            str(DEMO),
            "--policy",
            "oracle",
            "--run-name",
            "tiny",
            *KEEP,
            "--set",
            "sandbox.final_state_mb=0.001",
            "--set",
            "tasks.ids=[demo_hello_file]",
        ],
        env,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rec = _records(src_dir.parent / "tiny")[("demo_hello_file", 0)]
    assert rec.status == "ok" and rec.reward == 1.0  # never fails the episode
    assert rec.final_state.startswith("not kept: larger than sandbox.final_state_mb=0.001")
    assert any(e.startswith("final_state: not kept") for e in rec.events)
    assert not list((src_dir.parent / "tiny" / "final-state").glob("*.tar.gz"))

    bad_py = tmp_path / "bad" / "demo_hello_file"
    bad_py.mkdir(parents=True)
    (bad_py / "test_final_state.py").write_text("def test_x(:\n")
    cases = {
        "missing run": ["rescore", "nope", "--tests", str(DEMO)],
        "no kept state": ["rescore", "tiny", "--tests", str(DEMO)],
        "tests dir missing": ["rescore", "src", "--tests", str(tmp_path / "none")],
        "no tests for its tasks": ["rescore", "src", "--tests", str(tmp_path)],
        "tests not python": ["rescore", "src", "--tests", str(tmp_path / "bad")],
        "no tests given": ["rescore", "src"],
        "diff of a plain run": ["rescore", "src", "--diff"],
        "other tests into a rescored run": ["rescore", "src", "--task-source", str(DEMO), "--run-name", "guard"],
    }
    guard = src_dir.parent / "guard"  # a run rescored earlier with other tests of demo_hello_file
    guard.mkdir()
    (guard / "rescore.json").write_text(
        json.dumps({"source_dir": str(src_dir.resolve()), "tests": {"demo_hello_file": {"digest": "sha256:" + "0" * 64}}})
    )
    capsys.readouterr()
    for what, args in cases.items():
        rc = main([*args, "--store", str(src_dir.parent)])
        err = capsys.readouterr().err
        assert rc == 2, (what, err)
        assert err.startswith("et-hpc: error:") and len(err.splitlines()) == 1, (what, err)
    assert not [p for p in src_dir.parent.iterdir() if p.name.startswith("src-rescore")]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-x", "-q"]))
