"""EpisodeRecord <-> parquet row round trips, validation and token sequences."""

from __future__ import annotations

from datetime import datetime, timezone

import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from et_hpc.record import (
    EPISODE_SCHEMA,
    SCHEMA_VERSION,
    EpisodeRecord,
    TestResult,
    Timings,
    prompt_deltas,
    records_from_table,
    records_to_table,
)


def full_record(**kw) -> EpisodeRecord:
    base = dict(
        run_name="run-a",
        task_id="task_000001_abcd",
        sample=3,
        split="train",
        policy_kind="vllm",
        model="Qwen/Qwen3-8B",
        sampling_params={"temperature": 0.6, "max_tokens": 2048, "stop": ["</command>"]},
        messages=[
            {"role": "system", "content": "You are a terminal agent."},
            {"role": "user", "content": "Create /home/user/out.txt — ünïcode ✓"},
            {"role": "assistant", "content": "<command>echo hi > out.txt</command>"},
            {"role": "user", "content": "Command executed successfully. Output: \n\n(exit_code=0)"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "arguments": {"a": 1}}]},
        ],
        turns=2,
        stop_reason="done",
        status="ok",
        reward=0.5,
        passed=1,
        total=2,
        tests=[TestResult(name="test_final.py::test_a", outcome="passed"), TestResult(name="test_final.py::test_b", outcome="failed")],
        prompt_tokens=120,
        completion_tokens=30,
        prompt_token_ids=[[1, 2, 3], [7, 8]],
        token_ids=[[4, 5, 6], [9]],
        logprobs=[[-0.5, -0.25, -1.0], [-0.125]],
        timings=Timings(
            start_s=1.7e9, stop_s=1.7e9 + 12.5, queue_s=0.25, setup_s=0.5, agent_s=9.0, score_s=2.0, teardown_s=0.75, total_s=12.5
        ),
        image_digest="sha256:" + "ab" * 32,
        image_path="/cache/et-hpc/images/ab.sif",
        host="node017",
        slurm_job_id="12345_7",
        slurm_array_task_id=7,
        versions={"et-hpc": "0.1.0", "apptainer": "1.4.5", "python": "3.11.2"},
        error=None,
        created_at=datetime(2026, 12, 2, 10, 0, 0, 123456, tzinfo=timezone.utc),
    )
    base.update(kw)
    return EpisodeRecord(**base)


def test_round_trip_through_parquet_keeps_every_field(tmp_path):
    recs = [
        full_record(),
        full_record(
            sample=4,
            token_ids=None,
            prompt_token_ids=None,
            logprobs=None,
            status="infra_error",
            reward=None,
            passed=None,
            total=None,
            tests=[],
            error="apptainer instance start failed: exit 255",
            timings=Timings(),
        ),
    ]
    table = records_to_table(recs)
    assert table.schema.equals(EPISODE_SCHEMA, check_metadata=True)
    pq.write_table(table, tmp_path / "x.parquet")
    back = records_from_table(pq.read_table(tmp_path / "x.parquet"))
    assert back == recs
    assert back[1].token_ids is None and back[1].logprobs is None and back[1].reward is None
    assert back[0].messages[1]["content"].endswith("ünïcode ✓")
    assert back[0].created_at.tzinfo is not None
    assert back[0].succeeded and not back[1].succeeded


def test_schema_is_explicit_and_versioned():
    assert EPISODE_SCHEMA.field("schema_version").type.bit_width == 16
    assert EPISODE_SCHEMA.metadata[b"et_hpc.schema_version"] == str(SCHEMA_VERSION).encode()
    assert str(EPISODE_SCHEMA.field("created_at").type) == "timestamp[us, tz=UTC]"
    assert str(EPISODE_SCHEMA.field("token_ids").type) == "list<item: list<item: int32>>"
    row = full_record().to_row()
    assert set(row) == set(EPISODE_SCHEMA.names)
    assert isinstance(row["messages"], str) and isinstance(row["sampling_params"], str)


def test_group_defaults_to_task_and_ids_are_unique():
    a, b = full_record(), full_record()
    assert a.group_id == a.task_id
    assert a.episode_id != b.episode_id


def test_reward_only_with_ok_status():
    with pytest.raises(ValidationError, match="reward None"):
        full_record(status="timeout", reward=0.0)
    with pytest.raises(ValidationError, match="needs a reward"):
        full_record(status="ok", reward=None)
    with pytest.raises(ValidationError):
        full_record(status="crashed", reward=None)


def test_token_sequence_masks_prompt_and_tool_output():
    tokens, masks, lps = full_record().token_sequence()
    assert tokens == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert masks == [-100, -100, -100, 4, 5, 6, -100, -100, 9]
    assert lps == [1.0, 1.0, 1.0, -0.5, -0.25, -1.0, 1.0, 1.0, -0.125]
    no_lp = full_record(logprobs=None).token_sequence()
    assert no_lp[2] is None
    with pytest.raises(ValueError):
        full_record(token_ids=None).token_sequence()


def test_prompt_deltas_from_full_prompts():
    prompts = [[1, 2, 3], [1, 2, 3, 4, 5, 6, 7, 8]]
    completions = [[4, 5, 6], [9]]
    assert prompt_deltas(prompts, completions) == [[1, 2, 3], [7, 8]]
    with pytest.raises(ValueError, match="turn 1"):
        prompt_deltas([[1, 2], [1, 3, 9]], [[5], [6]])
