"""Recorded ET runs from the native fixtures: parsing all of them and replaying one in order."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from et_hpc.agent.loop import BudgetConfig, run_agent
from et_hpc.agent.policies import PolicyConfig, ReplayPolicy, make_policy, recorded_runs
from et_hpc.errors import TaskError, UserError
from et_hpc.tasks.model import Recipe, Task

CMD_RE = re.compile(r"<command>\s*(.*?)\s*</command>", re.DOTALL)
DONE_RE = re.compile(r"<action>\s*done\s*</action>", re.DOTALL)


def _summaries(fixtures_dir: Path) -> list[Path]:
    files = sorted(fixtures_dir.glob("native/*/solutions/*_summary.json"))
    return [f for f in files if f.name != "summary.json"]


def test_recorded_runs_parse_every_fixture(fixtures_dir):
    files = _summaries(fixtures_dir)
    assert len(files) == 6
    total = 0
    for f in files:
        data = json.loads(f.read_text())
        runs = recorded_runs(f)
        assert len(runs) == data["num_runs"] == len(data["results"]) >= 16
        assert [r.index for r in runs] == list(range(len(runs)))
        assert sum(bool(r.success) for r in runs) == data["num_success"]
        for r, raw in zip(runs, data["results"]):
            assert r.reward == raw["reward"]
            assert r.n_assistant_turns == sum(m["role"] == "assistant" for m in raw["messages"]) >= 1
        total += len(runs)
    # five fixtures record 16 runs; task_000000_dfbcff7a records 32
    assert total == 112


class _TranscriptShell:
    """Answers each command with the recorded observation instead of running it: recorded commands
    target /home/user of the task image and must not run on the host."""

    def __init__(self, observations: list[str]):
        self.observations = list(observations)
        self.commands: list[str] = []

    def run(self, command: str, timeout: float = 60.0):
        from et_hpc.sandbox.shell import CommandResult

        self.commands.append(command)
        return CommandResult(output=self.observations.pop(0) if self.observations else "", exit_code=0)


@pytest.mark.parametrize("task_name", ["task_000000_3bb4337a", "task_000000_dfbcff7a"])
def test_replay_emits_recorded_commands_in_order(fixtures_dir, task_name):
    path = next((fixtures_dir / "native" / task_name / "solutions").glob("*_summary.json"))
    data = json.loads(path.read_text())
    # the run with the most turns: most commands to check
    idx = max(range(len(data["results"])), key=lambda i: len(data["results"][i]["messages"]))
    msgs = data["results"][idx]["messages"]
    expected = []
    for m in msgs:
        if m["role"] == "assistant" and not DONE_RE.search(m["content"]):
            cmds = CMD_RE.findall(m["content"])
            if cmds:
                expected.append(cmds[-1])
    assert len(expected) >= 2
    sh = _TranscriptShell([])
    r = run_agent(msgs[1]["content"], sh, ReplayPolicy(path, idx), BudgetConfig(max_turns=64), system_prompt=msgs[0]["content"])
    assert sh.commands == expected
    assert r.stop_reason == "done" and r.status == "ok"
    recorded_assistant = [m["content"] for m in msgs if m["role"] == "assistant"]
    replayed = [m["content"] for m in r.messages if m["role"] == "assistant"]
    assert replayed[: len(recorded_assistant)] == recorded_assistant
    assert r.messages[0]["content"] == msgs[0]["content"] and r.messages[1] == msgs[1]


def test_replay_policy_via_task_and_range_errors(fixtures_dir, tmp_path):
    src = fixtures_dir / "native" / "task_000000_3bb4337a"
    files = sorted((src / "solutions").glob("*_summary.json"))
    runs = [f for f in files if f.name != "summary.json"]
    task = Task(id="t", prompt="p", recipe=Recipe(kind="def", path=src / "container.def", context_dir=src), recorded_runs=runs, source=src)
    pol = make_policy(PolicyConfig(kind="replay", replay_index=3), task)
    assert isinstance(pol, ReplayPolicy) and pol.run_index == 3
    with pytest.raises(UserError, match="out of range"):
        ReplayPolicy(runs[0], 99)
    with pytest.raises(TaskError, match="no 'results'"):
        recorded_runs(src / "solutions" / "summary.json")
    bad = tmp_path / "x_summary.json"
    bad.write_text("{")
    with pytest.raises(TaskError, match="not valid JSON"):
        recorded_runs(bad)
    empty = Task(id="e", prompt="p", recipe=task.recipe, source=src)
    with pytest.raises(UserError, match="no recorded runs"):
        make_policy(PolicyConfig(kind="replay"), empty)
    with pytest.raises(UserError, match="no reference solution"):
        make_policy(PolicyConfig(kind="oracle"), empty)
