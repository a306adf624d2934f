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


def ep(
    task: str,
    sample: int,
    reward: float | None,
    tokens: bool = False,
    status: str = "ok",
    version: str | None = None,
    drift: str | None = None,
    group: str = "",
) -> EpisodeRecord:
    msgs = [
        SYSTEM,
        {"role": "user", "content": f"solve {task}"},
        {"role": "assistant", "content": "<command>ls</command>"},
        {"role": "user", "content": "Command executed successfully. Output: a\n\n(exit_code=0)"},
        {"role": "assistant", "content": "<action>done</action>"},
    ]
    kw = {}
    if tokens:
        kw = dict(
            prompt_token_ids=[[10, 11, sample], [20]],
            token_ids=[[30 + sample, 31], [40]],
            logprobs=[[-0.5, -0.25], [-1.0]],
            tokens_source="server-exact",
            token_drift=drift,
        )
    return EpisodeRecord(
        run_name="r",
        task_id=task,
        sample=sample,
        status=status,
        group_id=group,
        reward=reward if status == "ok" else None,
        messages=msgs,
        turns=2,
        stop_reason="done",
        passed=int(reward or 0),
        total=1,
        model="m",
        policy_kind="text",
        policy_version=version,
        sampling_params={"temperature": 0.6},
        **kw,
    )


@pytest.fixture()
def run(tmp_path) -> RunStore:
    rs = RunStore(tmp_path / "r")
    rs.write([ep("tok", s, float(s % 2), tokens=True) for s in range(4)])  # varied scores, tokens
    rs.write([ep("same", s, 1.0, tokens=True) for s in range(3)])  # all equal: dropped by the Atropos default
    rs.write([ep("msg", 0, 1.0), ep("msg", 1, 0.0), ep("msg", 2, None, status="infra_error")])  # masked
    rs.write([ep("err", 0, None, status="timeout")])  # nothing ok: masked
    rs.write([ep("notok", 0, 1.0), ep("notok", 1, 0.0, tokens=True)])  # one member without token ids
    rs.write([ep("drift", 0, 1.0, tokens=True, drift="turn 1 position 3"), ep("drift", 1, 0.0, tokens=True)])
    return rs


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_atropos_groups_tokens_masks_validate_against_atroposlib(run, tmp_path):
    out = tmp_path / "g.jsonl"
    res = export_atropos(run, out)
    c = res.counts
    assert (c.total, c.complete, c.masked, c.zero_variance) == (6, 4, 2, 1)
    assert (res.groups, res.episodes, res.with_tokens, c.dropped_masked, c.dropped_zero_variance) == (1, 4, 1, 2, 1)
    assert c.dropped_no_tokens == 2  # "notok" and "drift": a member without exact token ids
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
    assert tok["et_hpc"]["task_id"] == tok["et_hpc"]["group_id"] == "tok" and tok["et_hpc"]["samples"] == [0, 1, 2, 3]

    kept = export_atropos(run, out, drop_zero_variance=False)
    assert (kept.groups, kept.counts.dropped_zero_variance, kept.counts.dropped_no_tokens) == (2, 0, 2)
    assert "2 without exact token ids" in kept.line()
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
    assert msg == []  # its ok members have no token ids: dropped, counted
    # counted once, as a group without tokens (error episodes are counted only in kept groups)
    assert res.counts.dropped_error_episodes == 0 and res.counts.dropped_no_tokens == 3
    for g in read_jsonl(out):
        validate_atropos_group(g)
        assert all(g["tokens"])


def test_no_export_holds_an_empty_or_drifted_token_list(run, tmp_path):
    from et_hpc.runs.export import atropos_group

    out = tmp_path / "all.jsonl"
    res = export_atropos(run, out, on_error="keep-ok", drop_zero_variance=False)
    groups = read_jsonl(out)
    assert groups and all(t for g in groups for t in g["tokens"])
    assert {g["et_hpc"]["task_id"] for g in groups} == {"tok", "same"}
    assert res.counts.dropped_no_tokens == 3  # msg (no ids), notok (one member), drift (one drifted member)
    sk = export_skyrl(run, tmp_path / "all.parquet", on_error="keep-ok")
    rows = pq.read_table(tmp_path / "all.parquet").to_pylist()
    assert sk.counts.dropped_no_tokens == 3 and rows and all(r["response_ids"] for r in rows)
    # positive control: the drifted member's ids are there, and refused when asked for directly
    drift = [r for r in run.records() if r.task_id == "drift"]
    assert drift[0].token_ids and not drift[0].has_tokens
    with pytest.raises(ValueError, match="no exact token ids"):
        atropos_group(drift)
    bad = json.loads(json.dumps(groups[0]))
    bad["tokens"][0], bad["masks"][0] = [], []
    bad["inference_logprobs"] = None
    with pytest.raises(ValueError, match="empty token list"):
        validate_atropos_group(bad)
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
    assert (res.rows, res.groups, res.with_tokens, res.counts.dropped_masked) == (7, 2, 7, 2)
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
    go = generator_output(out)
    assert set(GENERATOR_OUTPUT_COLUMNS) <= set(go)
    assert all(len(go[c]) == 7 for c in GENERATOR_OUTPUT_COLUMNS)
    for ids, m, lp in zip(go["response_ids"], go["loss_masks"], go["rollout_logprobs"]):
        assert len(ids) == len(m) == len(lp)


def test_skyrl_instance_id_is_the_sampled_group(tmp_path):
    # two groups of one task (two collect calls), one of them across a version switch
    rs = RunStore(tmp_path / "v")
    rs.write(
        [
            ep("t", 0, 1.0, True, version="step-1", group="t@s0"),
            ep("t", 1, 0.0, True, version="step-2", group="t@s0"),
            ep("t", 2, 1.0, True, version="step-2", group="t@s2"),
            ep("t", 3, 0.0, True, version="step-2", group="t@s2"),
        ]
    )
    out = tmp_path / "v.parquet"
    res = export_skyrl(rs, out)
    assert res.groups == 2
    ids = {(t.instance_id, t.repetition_id) for t in generator_output(out)["trajectory_ids"]}
    assert ids == {("t@s0", 0), ("t@s0", 1), ("t@s2", 2), ("t@s2", 3)}
    # legacy rows (schema < 4, group_id = task_id) keep task@version
    old = RunStore(tmp_path / "old")
    old.write(
        [
            x.model_copy(update={"schema_version": 3})
            for x in [
                ep("t", 0, 1.0, True, version="step-1"),
                ep("t", 1, 0.0, True, version="step-1"),
                ep("t", 2, 1.0, True, version="step-2"),
            ]
        ]
    )
    export_skyrl(old, out)
    ids = {(t.instance_id, t.repetition_id) for t in generator_output(out)["trajectory_ids"]}
    assert ids == {("t@step-1", 0), ("t@step-1", 1), ("t@step-2", 2)}
    assert export_skyrl(old, out, drop_zero_variance=True).rows == 2  # the one-member group has no variance


def test_export_output_path_errors(run, tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        export_skyrl(run, tmp_path / "no" / "x.parquet")
    with pytest.raises(UserError, match="is a directory"):
        export_atropos(run, tmp_path)


def test_cli_exports_print_counts(run, tmp_path, capsys):
    out = tmp_path / "a.jsonl"
    assert main(["export", "atropos", str(run.path), "-o", str(out), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["groups"] == 1 and got["counts"]["masked"] == 2 and got["counts"]["dropped_no_tokens"] == 2
    assert main(["export", "atropos", str(run.path), "-o", str(out), "--keep-equal-scores"]) == 0
    line = capsys.readouterr().out
    assert line.startswith("wrote 2 groups") and "of 6 groups (4 complete, 2 with an error member" in line
    assert "dropped 2 masked (mask)" in line
    assert len(read_jsonl(out)) == 2
    assert main(["export", "atropos", str(run.path), "-o", str(out), "--on-error", "keep-ok", "--keep-equal-scores"]) == 0
    assert capsys.readouterr().out.startswith("wrote 2 groups")  # msg's ok members have no token ids
    assert main(["export", "skyrl", str(tmp_path / "nope"), "-o", str(tmp_path / "x.parquet")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("et-hpc: error: run directory") and err.count("\n") == 1


def test_cli_entry_point_runs_export(run, tmp_path):
    out = tmp_path / "s.parquet"
    p = subprocess.run(
        [sys.executable, "-m", "et_hpc.cli", "export", "skyrl", str(run.path), "-o", str(out)], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("wrote 7 episodes")
    assert pq.read_metadata(out).num_rows == 7
    h = subprocess.run([sys.executable, "-m", "et_hpc.cli", "export", "atropos", "--help"], capture_output=True, text=True, timeout=120)
    assert "--keep-equal-scores" in h.stdout and "--on-error" in h.stdout and "example" in h.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "et_hpc.cli", "export", "atropos", str(run.path), "-o", str(tmp_path / "x.jsonl"), "--on-error", "ignore"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--on-error" in bad.stderr and "Traceback" not in bad.stderr


# SkyRL 0.4.0 (PyPI ``skyrl`` 0.4.0, Requires-Python >= 3.12, so not installable in this 3.11 venv):
# ``skyrl/train/generators/base.py`` of that wheel declares ``GeneratorOutput(TypedDict)`` (total:
# every key required) with these keys and types, and ``@dataclass TrajectoryID(instance_id: str,
# repetition_id: int)``. Checked field by field below; nothing of SkyRL is copied into et-hpc.
SKYRL_040_GENERATOR_OUTPUT = {
    "prompt_token_ids": "List[List[int]]",
    "response_ids": "List[List[int]]",
    "rewards": "Union[List[float], List[List[float]]]",
    "loss_masks": "List[List[int]]",
    "stop_reasons": "Optional[List[str]]",
    "rollout_metrics": "Optional[Dict[str, Any]]",
    "rollout_logprobs": "Optional[List[List[float]]]",
    "trajectory_ids": "Optional[List[TrajectoryID]]",
    "trajectory_generation_times": "Optional[List[float]]",
    "trajectory_time_splits": "Optional[Dict[str, List[float]]]",
    "rollout_expert_indices": "Optional[List[RoutedExpertIndices]]",
    "rollout_sample_support": "Optional[List[SampleSupport]]",
    "is_last_step": "Optional[List[bool]]",
    "env_metrics": "Optional[List[Dict[str, Any]]]",
    "pixel_values": "Optional[List[torch.Tensor]]",
    "image_grid_thw": "Optional[List[torch.Tensor]]",
}


def _check_skyrl_040(go: dict) -> None:
    """``go`` against SkyRL 0.4.0's own GeneratorOutput class (keys, annotations, TrajectoryID), then
    what the annotations do not say: lengths, masks, ids (raises AssertionError)."""
    from helpers import need
    from helpers.skyrl import as_skyrl

    need("skyrl")
    as_skyrl(go)
    n = len(go["response_ids"])

    def ints(x):
        return isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in x)

    assert isinstance(go["prompt_token_ids"], list) and len(go["prompt_token_ids"]) == n
    assert all(ints(p) and p for p in go["prompt_token_ids"])
    assert all(ints(r) and r for r in go["response_ids"])
    assert len(go["loss_masks"]) == n and all(ints(m) and set(m) <= {0, 1} for m in go["loss_masks"])
    assert all(len(m) == len(r) for m, r in zip(go["loss_masks"], go["response_ids"]))
    assert len(go["rewards"]) == n and all(isinstance(x, float) for x in go["rewards"])
    assert go["stop_reasons"] is None or (len(go["stop_reasons"]) == n and all(isinstance(x, str) for x in go["stop_reasons"]))
    lps = go["rollout_logprobs"]
    assert lps is None or (
        len(lps) == n and all(len(lp) == len(r) and all(isinstance(v, float) for v in lp) for lp, r in zip(lps, go["response_ids"]))
    )
    tids = go["trajectory_ids"]
    assert len(tids) == n
    for t in tids:  # SkyRL's TrajectoryID (as_skyrl) declares the fields; their values are not checked there
        assert isinstance(t.instance_id, str) and isinstance(t.repetition_id, int)
    for k in set(SKYRL_040_GENERATOR_OUTPUT) - {
        "prompt_token_ids",
        "response_ids",
        "rewards",
        "loss_masks",
        "stop_reasons",
        "rollout_logprobs",
        "trajectory_ids",
    }:
        assert go[k] is None, k


def test_skyrl_export_is_a_skyrl_040_generator_output(run, tmp_path):
    from et_hpc.runs.export import SKYRL_GENERATOR_OUTPUT_KEYS

    out = tmp_path / "go.parquet"
    export_skyrl(run, out)
    go = generator_output(out)
    assert tuple(SKYRL_040_GENERATOR_OUTPUT) == SKYRL_GENERATOR_OUTPUT_KEYS
    _check_skyrl_040(go)
    assert len(go["response_ids"]) == 7 and {t.instance_id for t in go["trajectory_ids"]} == {"tok", "same"}
    # positive controls: what the export used to give is refused
    for bad in (
        {k: v for k, v in go.items() if k != "rollout_metrics"},
        {**go, "trajectory_ids": [{"instance_id": "tok", "repetition_id": 0}] * 7},
        {**go, "response_ids": [[]] * 7},
    ):
        with pytest.raises(AssertionError):
            _check_skyrl_040(bad)


def test_skyrl_own_class_is_the_one_checked(run, tmp_path):
    """The keys and annotations come from SkyRL's own file: what it does not declare is refused."""
    from helpers import need
    from helpers.skyrl import as_skyrl, load_base

    need("skyrl")
    base = load_base()
    assert set(base.GeneratorOutput.__required_keys__) == set(SKYRL_040_GENERATOR_OUTPUT)
    out = tmp_path / "go.parquet"
    export_skyrl(run, out)
    go = generator_output(out)
    ids = as_skyrl(go)["trajectory_ids"]
    assert all(type(t) is base.TrajectoryID for t in ids)  # SkyRL's own dataclass took every id
    for bad in ({**go, "extra": None}, {**go, "rollout_metrics": [1]}, {**go, "rewards": [1] * len(go["rewards"])}):
        with pytest.raises(AssertionError):
            as_skyrl(bad)
