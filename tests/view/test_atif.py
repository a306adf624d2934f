"""``et-hpc export atif``: every document validates with Harbor's own ATIF models and reads back unchanged.

Harbor 0.25.0 (``harbor/models/trajectories/*.py``: ``Trajectory``, ``Step``, ``ToolCall``,
``Observation``, ``ObservationResult``, ``Metrics``, ``FinalMetrics``, ``Agent``; and
``harbor/utils/trajectory_validator.py``: ``TrajectoryValidator``) needs Python >= 3.12 to install,
but those modules need only pydantic; scripts/provision-debian unpacks the wheel beside the venv
(``helpers.HARBOR``) and a child Python imports them from there. A round trip is the bar:
``Trajectory.model_validate_json(file).to_json_dict() == doc`` for every exported document (how
harbor's ``trial/trial.py`` reads a trajectory file).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import HARBOR, need

ET_HPC = [sys.executable, "-m", "et_hpc.cli"]

HARBOR_CHECK = r"""
import json, sys
from pathlib import Path
from harbor.models.trajectories import Trajectory
from harbor.utils.trajectory_validator import TrajectoryValidator
out = {}
for f in sys.argv[1:]:
    doc = json.loads(Path(f).read_text())
    v = TrajectoryValidator()
    ok = v.validate(Path(f))
    try:
        # read as harbor reads a trial's trajectory (harbor/trial/trial.py: model_validate_json of the file)
        back = Trajectory.model_validate_json(Path(f).read_text()).to_json_dict()
        same = back == doc
    except Exception as e:
        same = f"{type(e).__name__}: {e}"[:2000]
    out[Path(f).name] = {"valid": ok, "errors": v.get_errors(), "round_trip": same}
print(json.dumps(out))
"""


def _harbor(files: list[Path]) -> dict:
    need("harbor")
    env = {**os.environ, "PYTHONPATH": str(HARBOR)}
    r = subprocess.run([sys.executable, "-c", HARBOR_CHECK, *map(str, files)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def _export(run: Path, out: Path, *extra: str) -> list[Path]:
    r = subprocess.run(ET_HPC + ["export", "atif", str(run), "-o", str(out), *extra], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ATIF-v1.8" in r.stdout
    return sorted(out.glob("*.json"))


@pytest.fixture(scope="module")
def exported(view_runs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Path]]:
    base = tmp_path_factory.mktemp("atif")
    return {name: _export(run, base / name) for name, run in view_runs.items()}


def test_harbor_validates_and_round_trips(exported: dict[str, list[Path]], view_runs: dict[str, Path]) -> None:
    from et_hpc.runs.store import RunStore

    files = [f for fs in exported.values() for f in fs]
    assert len(files) == sum(RunStore(r).read(columns=["episode_id"]).num_rows for r in view_runs.values())
    res = _harbor(files)
    bad = {k: v for k, v in res.items() if not (v["valid"] and v["round_trip"] is True)}
    assert not bad, json.dumps(bad, indent=1)[:4000]


def test_harbor_models_reject_a_broken_document(exported: dict[str, list[Path]], tmp_path: Path) -> None:
    """The check can fail: Harbor rejects the same document with a step out of order or an unknown field."""
    doc = json.loads(exported["hostile"][0].read_text())
    order, field = json.loads(json.dumps(doc)), json.loads(json.dumps(doc))
    order["steps"][0]["step_id"] = 2
    field["steps"][-1]["rewards"] = [1.0]
    (tmp_path / "order.json").write_text(json.dumps(order))
    (tmp_path / "field.json").write_text(json.dumps(field))
    res = _harbor([tmp_path / "order.json", tmp_path / "field.json"])
    for name, word in (("order.json", "step_id"), ("field.json", "rewards")):
        assert res[name]["valid"] is False and res[name]["round_trip"] is not True
        assert any(word in e for e in res[name]["errors"]), res[name]["errors"]


def _doc(files: list[Path], task: str, sample: int = 0) -> dict:
    (f,) = [f for f in files if f.name == f"{task}.{sample}.json"]
    return json.loads(f.read_text())


def test_steps_tokens_and_final_metrics(exported: dict[str, list[Path]], view_runs: dict[str, Path]) -> None:
    """Field by field against the record (harbor 0.25.0 models/trajectories/step.py, metrics.py, final_metrics.py)."""
    from et_hpc.runs.store import RunStore

    recs = {r.task_id: r for r in RunStore(view_runs["hostile"]).records()}
    exact, drifted = recs["demo_csv_sum"], recs["demo_hello_file"]
    doc = _doc(exported["hostile"], "demo_csv_sum")
    assert doc["schema_version"] == "ATIF-v1.8" and doc["session_id"] == exact.episode_id
    assert [s["step_id"] for s in doc["steps"]] == list(range(1, len(doc["steps"]) + 1))
    assert [s["source"] for s in doc["steps"]][:2] == ["system", "user"]
    agent = [s for s in doc["steps"] if s["source"] == "agent"]
    assert len(agent) == exact.turns == len(exact.token_ids)
    call = agent[0]["tool_calls"][0]
    assert call["function_name"] == "terminal" and call["arguments"]["command"] == "head -n 3 /home/user/data/sales.csv"
    (obs,) = agent[0]["observation"]["results"]
    assert obs["source_call_id"] == call["tool_call_id"] and "region,product,amount" in obs["content"]
    # prompt ids: the whole prompt of each request (ATIF), rebuilt from the per-turn deltas the store keeps
    seq: list[int] = []
    for step, delta, completion, lps in zip(agent, exact.prompt_token_ids, exact.token_ids, exact.logprobs):
        seq = seq + delta
        m = step["metrics"]
        assert m["prompt_token_ids"] == seq and m["prompt_tokens"] == len(seq)
        assert m["completion_token_ids"] == completion and m["completion_tokens"] == len(completion)
        assert m["logprobs"] == pytest.approx(lps)
        seq = seq + completion
    tokens, _, _ = exact.token_sequence()
    assert seq == tokens
    fm = doc["final_metrics"]
    assert fm["total_steps"] == len(doc["steps"]) and fm["total_completion_tokens"] == exact.completion_tokens
    assert fm["extra"]["reward"] == exact.reward and fm["extra"]["status"] == "ok"
    assert fm["extra"]["tests"] == [{"name": t.name, "outcome": t.outcome} for t in exact.tests]
    assert doc["extra"]["task_id"] == "demo_csv_sum" and doc["extra"]["run_name"] == "hostile"
    # a drifting episode keeps what was sampled, not prompt ids that are not one sequence
    d = _doc(exported["hostile"], "demo_hello_file")
    dm = [s["metrics"] for s in d["steps"] if s["source"] == "agent"]
    assert all("prompt_token_ids" not in m for m in dm) and [m["completion_token_ids"] for m in dm] == drifted.token_ids
    assert "drift" in d["notes"] and d["final_metrics"]["extra"]["reward"] == 1.0
    # the text protocol (oracle): its <command> is a terminal call marked as text, its output the observation
    o = _doc(exported["oracle"], "demo_csv_sum")
    step = next(s for s in o["steps"] if s.get("tool_calls"))
    assert step["tool_calls"][0]["extra"] == {"protocol": "text"} and "awk" in step["tool_calls"][0]["arguments"]["command"]
    assert "(exit_code=0)" in step["observation"]["results"][0]["content"]
    assert "metrics" not in step  # no token ids recorded


def test_index_and_ok_only(view_runs: dict[str, Path], tmp_path: Path) -> None:
    files = _export(view_runs["oracle"], tmp_path / "o", "--ok-only")
    lines = [json.loads(x) for x in (tmp_path / "o" / "index.jsonl").read_text().splitlines()]
    assert sorted(x["file"] for x in lines) == [f.name for f in files] and all(x["status"] == "ok" for x in lines)
    r = subprocess.run(
        ET_HPC + ["export", "atif", str(tmp_path / "nope"), "-o", str(tmp_path / "x")], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
