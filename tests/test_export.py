"""Exports: Atropos ScoredDataGroup JSONL and SkyRL/verl parquet from a real run store."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from et_hpc.cli import main
from et_hpc.errors import UserError
from et_hpc.export import SKYRL_SCHEMA, export_atropos, export_skyrl
from et_hpc.record import EpisodeRecord
from et_hpc.store import RunStore

SYSTEM = {"role": "system", "content": "You are a terminal agent."}


def ep(task: str, sample: int, reward: float | None, tokens: bool = False, status: str = "ok") -> EpisodeRecord:
    msgs = [SYSTEM, {"role": "user", "content": f"solve {task}"},
            {"role": "assistant", "content": "<command>ls</command>"},
            {"role": "user", "content": "Command executed successfully. Output: a\n\n(exit_code=0)"},
            {"role": "assistant", "content": "<action>done</action>"}]
    kw = {}
    if tokens:
        kw = dict(prompt_token_ids=[[10, 11, sample], [20]], token_ids=[[30 + sample, 31], [40]],
                  logprobs=[[-0.5, -0.25], [-1.0]])
    return EpisodeRecord(run_name="r", task_id=task, sample=sample, status=status,
                         reward=reward if status == "ok" else None, messages=msgs, turns=2,
                         stop_reason="done", passed=int(reward or 0), total=1, model="m", policy_kind="text", **kw)


@pytest.fixture()
def run(tmp_path) -> RunStore:
    rs = RunStore(tmp_path / "r")
    rs.write([ep("tok", s, float(s % 2), tokens=True) for s in range(4)])  # varied scores, tokens
    rs.write([ep("same", s, 1.0) for s in range(3)])  # all equal: dropped by default
    rs.write([ep("msg", 0, 1.0), ep("msg", 1, 0.0), ep("msg", 2, None, status="infra_error")])  # no tokens
    rs.write([ep("err", 0, None, status="timeout")])  # nothing ok: no group at all
    return rs


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_atropos_groups_scores_masks(run, tmp_path):
    out = tmp_path / "g.jsonl"
    res = export_atropos(run, out)
    assert (res.episodes, res.groups, res.dropped_equal, res.with_tokens) == (9, 2, 1, 1)
    groups = read_jsonl(out)
    assert len(groups) == 2
    tok, msg = groups  # groups in task order: "msg" < "tok"... check by content below
    if tok["tokens"][0] == []:
        tok, msg = msg, tok
    assert tok["scores"] == [0.0, 1.0, 0.0, 1.0]
    assert tok["tokens"][1] == [10, 11, 1, 31, 31, 20, 40]
    assert tok["masks"][1] == [-100, -100, -100, 31, 31, -100, 40]
    assert tok["inference_logprobs"][1] == [1.0, 1.0, 1.0, -0.5, -0.25, 1.0, -1.0]
    assert all(len(t) == len(m) for t, m in zip(tok["tokens"], tok["masks"]))
    assert tok["group_overrides"] == {"group_size": 4}
    assert len(tok["messages"]) == 4 and tok["messages"][0][0] == SYSTEM

    assert msg["scores"] == [1.0, 0.0]  # the infra_error sample is not exported
    assert msg["tokens"] == [[], []] and msg["masks"] == [[], []]
    assert "inference_logprobs" not in msg
    assert msg["messages"][1][-1]["content"] == "<action>done</action>"

    kept = export_atropos(run, out, keep_equal_scores=True)
    assert (kept.groups, kept.dropped_equal) == (3, 0)
    same = [g for g in read_jsonl(out) if g["scores"] == [1.0, 1.0, 1.0]]
    assert len(same) == 1


def test_skyrl_parquet_columns(run, tmp_path):
    out = tmp_path / "e.parquet"
    res = export_skyrl(run, out)
    assert res.rows == 9
    t = pq.read_table(out)
    assert t.schema.equals(SKYRL_SCHEMA)
    rows = t.to_pylist()
    assert {r["data_source"] for r in rows} == {"endless"}
    r = next(r for r in rows if r["extra_info"]["task_id"] == "tok" and r["extra_info"]["sample"] == 1)
    assert r["prompt"] == [SYSTEM, {"role": "user", "content": "solve tok"}]
    assert len(r["messages"]) == 5 and r["messages"][-1]["role"] == "assistant"
    assert r["reward"] == 1.0 and r["reward_spec"] == {"method": "rule", "ground_truth": "tok"}
    assert r["extra_info"]["turns"] == 2 and r["extra_info"]["group_id"] == "tok"
    assert not [x for x in rows if x["extra_info"]["task_id"] == "err"]


def test_export_output_path_errors(run, tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        export_skyrl(run, tmp_path / "no" / "x.parquet")
    with pytest.raises(UserError, match="is a directory"):
        export_atropos(run, tmp_path)


def test_cli_exports(run, tmp_path, capsys):
    out = tmp_path / "a.jsonl"
    assert main(["export", "atropos", str(run.path), "-o", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["groups"] == 2
    assert main(["export", "atropos", str(run.path), "-o", str(out), "--keep-equal-scores"]) == 0
    assert "wrote 3 groups" in capsys.readouterr().out
    assert len(read_jsonl(out)) == 3
    assert main(["export", "skyrl", str(tmp_path / "nope"), "-o", str(tmp_path / "x.parquet")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("et-hpc: error: run directory") and err.count("\n") == 1


def test_cli_entry_point_runs_export(run, tmp_path):
    out = tmp_path / "s.parquet"
    p = subprocess.run([sys.executable, "-m", "et_hpc.cli", "export", "skyrl", str(run.path), "-o", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "wrote 9 episodes" in p.stdout
    assert pq.read_metadata(out).num_rows == 9
    h = subprocess.run([sys.executable, "-m", "et_hpc.cli", "export", "atropos", "--help"],
                       capture_output=True, text=True, timeout=120)
    assert "--keep-equal-scores" in h.stdout and "example" in h.stdout
