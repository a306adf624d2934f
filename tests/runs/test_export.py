"""Exports: Atropos ScoredDataGroup JSONL and SkyRL/verl parquet from a real run store.

Atropos groups are checked against atroposlib's own types (the ScoredDataGroup TypedDict and the
API server's ScoredData model); SkyRL rows against GeneratorOutput's field layout (SkyRL
``skyrl/train/generators/base.py``: loss mask 1 on completion tokens, 0 on tool output).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from et_hpc.cli import main
from et_hpc.errors import UserError
from et_hpc.record import EpisodeRecord
from et_hpc.runs.export import (
    ATROPOS_KEYS,
    GENERATOR_OUTPUT_COLUMNS,
    SKYRL_SCHEMA,
    export_atropos,
    export_skyrl,
    generator_output,
    validate_atropos_group,
)
from et_hpc.runs.store import RunStore

SYSTEM = {"role": "system", "content": "You are a terminal agent."}


def ep(task: str, sample: int, reward: float | None, tokens: bool = False, status: str = "ok",
       version: str | None = None) -> EpisodeRecord:
    msgs = [SYSTEM, {"role": "user", "content": f"solve {task}"},
            {"role": "assistant", "content": "<command>ls</command>"},
            {"role": "user", "content": "Command executed successfully. Output: a\n\n(exit_code=0)"},
            {"role": "assistant", "content": "<action>done</action>"}]
    kw = {}
    if tokens:
        kw = dict(prompt_token_ids=[[10, 11, sample], [20]], token_ids=[[30 + sample, 31], [40]],
                  logprobs=[[-0.5, -0.25], [-1.0]], tokens_source="server-exact")
    return EpisodeRecord(run_name="r", task_id=task, sample=sample, status=status,
                         reward=reward if status == "ok" else None, messages=msgs, turns=2,
                         stop_reason="done", passed=int(reward or 0), total=1, model="m", policy_kind="text",
                         policy_version=version, sampling_params={"temperature": 0.6}, **kw)


@pytest.fixture()
def run(tmp_path) -> RunStore:
    rs = RunStore(tmp_path / "r")
    rs.write([ep("tok", s, float(s % 2), tokens=True) for s in range(4)])  # varied scores, tokens
    rs.write([ep("same", s, 1.0) for s in range(3)])  # all equal: dropped by the Atropos default
    rs.write([ep("msg", 0, 1.0), ep("msg", 1, 0.0), ep("msg", 2, None, status="infra_error")])  # masked
    rs.write([ep("err", 0, None, status="timeout")])  # nothing ok: masked
    return rs


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_atropos_groups_tokens_masks_validate_against_atroposlib(run, tmp_path):
    out = tmp_path / "g.jsonl"
    res = export_atropos(run, out)
    c = res.counts
    assert (c.total, c.complete, c.masked, c.zero_variance) == (4, 2, 2, 1)
    assert (res.groups, res.episodes, res.with_tokens, c.dropped_masked, c.dropped_zero_variance) == (1, 4, 1, 2, 1)
    groups = read_jsonl(out)
    assert len(groups) == 1
    tok = groups[0]
    validate_atropos_group(tok)
    assert set(ATROPOS_KEYS) <= set(tok)
    assert tok["scores"] == [0.0, 1.0, 0.0, 1.0]
    assert tok["tokens"][1] == [10, 11, 1, 31, 31, 20, 40]
    assert tok["masks"][1] == [-100, -100, -100, 31, 31, -100, 40]
    assert tok["inference_logprobs"][1] == [1.0, 1.0, 1.0, -0.5, -0.25, 1.0, -1.0]
    assert tok["group_overrides"] == {"group_size": 4}
    assert tok["generation_params"] == {"temperature": 0.6}
    assert tok["messages"][0][0] == {**SYSTEM, "reward": None}
    assert tok["et_hpc"]["task_id"] == "tok" and tok["et_hpc"]["samples"] == [0, 1, 2, 3]

    kept = export_atropos(run, out, drop_zero_variance=False)
    assert (kept.groups, kept.counts.dropped_zero_variance) == (2, 0)
    for g in read_jsonl(out):
        validate_atropos_group(g)
    assert [g["scores"] for g in read_jsonl(out) if g["et_hpc"]["task_id"] == "same"] == [[1.0, 1.0, 1.0]]


def test_group_with_one_infra_error_is_not_exported_by_default(run, tmp_path):
    out = tmp_path / "m.jsonl"
    export_atropos(run, out, drop_zero_variance=False)
    assert "msg" not in {g["et_hpc"]["task_id"] for g in read_jsonl(out)}
    # positive control: the same group is there once masking is off, without its error member
    res = export_atropos(run, out, on_error="keep-ok", drop_zero_variance=False)
    msg = [g for g in read_jsonl(out) if g["et_hpc"]["task_id"] == "msg"]
    assert len(msg) == 1 and msg[0]["scores"] == [1.0, 0.0] and msg[0]["et_hpc"]["samples"] == [0, 1]
    assert msg[0]["group_overrides"] == {"group_size": 2} and msg[0]["tokens"] == [[], []]
    validate_atropos_group(msg[0])
    assert res.counts.dropped_error_episodes == 1
    assert "err" not in {g["et_hpc"]["task_id"] for g in read_jsonl(out)}  # no ok member: nothing to keep


def test_validate_rejects_what_atropos_rejects(run, tmp_path):
    out = tmp_path / "g.jsonl"
    export_atropos(run, out)
    good = read_jsonl(out)[0]
    validate_atropos_group(good)
    bad_mask = json.loads(json.dumps(good))
    bad_mask["masks"][0][3] = 7  # neither -100 nor the token
    with pytest.raises(ValueError, match="neither -100 nor the token"):
        validate_atropos_group(bad_mask)
    short = json.loads(json.dumps(good))
    short["masks"][0] = short["masks"][0][:-1]
    with pytest.raises(ValueError, match="masks"):
        validate_atropos_group(short)
    wrong_type = json.loads(json.dumps(good))
    wrong_type["scores"] = "high"
    with pytest.raises(ValueError, match="ScoredDataGroup"):
        validate_atropos_group(wrong_type)


def test_skyrl_generator_output_columns(run, tmp_path):
    out = tmp_path / "e.parquet"
    res = export_skyrl(run, out)
    assert (res.rows, res.groups, res.with_tokens, res.counts.dropped_masked) == (7, 2, 4, 2)
    t = pq.read_table(out)
    assert t.schema.equals(SKYRL_SCHEMA)
    rows = t.to_pylist()
    assert {r["data_source"] for r in rows} == {"endless"}
    assert not [x for x in rows if x["extra_info"]["task_id"] in ("err", "msg")]  # masked groups
    r = next(r for r in rows if r["extra_info"]["task_id"] == "tok" and r["extra_info"]["sample"] == 1)
    assert r["prompt"] == [SYSTEM, {"role": "user", "content": "solve tok"}]
    assert len(r["messages"]) == 5 and r["messages"][-1]["role"] == "assistant"
    assert r["reward"] == 1.0 and r["reward_spec"] == {"method": "rule", "ground_truth": "tok"}
    # GeneratorOutput: prompt = first prompt; response = completion, tool output, completion ...
    assert r["prompt_token_ids"] == [10, 11, 1]
    assert r["response_ids"] == [31, 31, 20, 40]
    assert r["loss_masks"] == [1, 1, 0, 1]
    assert r["rollout_logprobs"] == [-0.5, -0.25, 0.0, -1.0]
    assert r["rewards"] == 1.0 and r["stop_reasons"] == "done"
    assert r["trajectory_ids"] == {"instance_id": "tok", "repetition_id": 1}
    same = next(r for r in rows if r["extra_info"]["task_id"] == "same")
    assert same["response_ids"] is None and same["loss_masks"] is None
    go = generator_output(out)
    assert set(go) == set(GENERATOR_OUTPUT_COLUMNS)
    assert all(len(v) == 7 for v in go.values())
    for ids, m, lp in zip(go["response_ids"], go["loss_masks"], go["rollout_logprobs"]):
        if ids is not None:
            assert len(ids) == len(m) == len(lp)


def test_skyrl_instance_id_carries_the_policy_version(tmp_path):
    rs = RunStore(tmp_path / "v")
    rs.write([ep("t", 0, 1.0, version="step-1"), ep("t", 1, 0.0, version="step-1"), ep("t", 2, 1.0, version="step-2")])
    out = tmp_path / "v.parquet"
    res = export_skyrl(rs, out)
    assert res.groups == 2
    ids = {(r["instance_id"], r["repetition_id"]) for r in generator_output(out)["trajectory_ids"]}
    assert ids == {("t@step-1", 0), ("t@step-1", 1), ("t@step-2", 2)}
    assert export_skyrl(rs, out, drop_zero_variance=True).rows == 2  # the one-member group has no variance


def test_export_output_path_errors(run, tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        export_skyrl(run, tmp_path / "no" / "x.parquet")
    with pytest.raises(UserError, match="is a directory"):
        export_atropos(run, tmp_path)


def test_cli_exports_print_counts(run, tmp_path, capsys):
    out = tmp_path / "a.jsonl"
    assert main(["export", "atropos", str(run.path), "-o", str(out), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["groups"] == 1 and got["counts"]["masked"] == 2
    assert main(["export", "atropos", str(run.path), "-o", str(out), "--keep-equal-scores"]) == 0
    line = capsys.readouterr().out
    assert line.startswith("wrote 2 groups") and "of 4 groups (2 complete, 2 with an error member" in line
    assert "dropped 2 masked (mask)" in line
    assert len(read_jsonl(out)) == 2
    assert main(["export", "atropos", str(run.path), "-o", str(out), "--on-error", "keep-ok",
                 "--keep-equal-scores"]) == 0
    assert capsys.readouterr().out.startswith("wrote 3 groups")
    assert main(["export", "skyrl", str(tmp_path / "nope"), "-o", str(tmp_path / "x.parquet")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("et-hpc: error: run directory") and err.count("\n") == 1


def test_cli_entry_point_runs_export(run, tmp_path):
    out = tmp_path / "s.parquet"
    p = subprocess.run([sys.executable, "-m", "et_hpc.cli", "export", "skyrl", str(run.path), "-o", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("wrote 7 episodes")
    assert pq.read_metadata(out).num_rows == 7
    h = subprocess.run([sys.executable, "-m", "et_hpc.cli", "export", "atropos", "--help"],
                       capture_output=True, text=True, timeout=120)
    assert "--keep-equal-scores" in h.stdout and "--on-error" in h.stdout and "example" in h.stdout
    bad = subprocess.run([sys.executable, "-m", "et_hpc.cli", "export", "atropos", str(run.path), "-o",
                          str(tmp_path / "x.jsonl"), "--on-error", "ignore"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--on-error" in bad.stderr and "Traceback" not in bad.stderr
