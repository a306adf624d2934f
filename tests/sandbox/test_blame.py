"""The blame table (``et_hpc.scoring.live.BLAME``): one example per row, and a sweep of every
combination of facts showing that no state an agent can leave yields an error."""

from __future__ import annotations

import itertools

import pytest

from et_hpc.scoring import live as scoring
from et_hpc.scoring.live import BLAME, Facts, blame

JUNIT = '<testsuite><testcase classname="t" name="test_a"/></testsuite>'

# Facts that reach each row first, and the helper result they come from where there is one.
EXAMPLES: dict[str, Facts] = {
    "instance_ended": Facts("disturbed", instance="gone"),
    "stopped_by_us": Facts("infra", instance="stopped"),
    "host_failed": Facts("infra", instance="host: /proc/12: Permission denied"),
    "unkillable": Facts("swept_left"),
    "survivors": Facts("survivors"),
    "state_unmappable": Facts("agent"),
    "driver_disturbed": Facts("disturbed"),
    "interpreter_by_state": Facts("interp", control=True),
    "interpreter_by_image": Facts("interp", control=False),
    "timeout": Facts("ran", timed_out=True, report="none"),
    "no_report": Facts("ran", report="none"),
    "bad_report": Facts("ran", report="unreadable"),
    "tests": Facts("ran"),
    "infra": Facts("infra"),
}
RESULTS: dict[str, dict] = {
    "survivors": {"kind": "agent", "stage": "survivors", "error": "3 process(es) ..."},
    "state_unmappable": {"kind": "agent", "stage": "view", "error": "/etc cannot be listed"},
    "driver_disturbed": {"kind": "disturbed", "error": "the scoring driver ended (signal 9)"},
    "interpreter_by_state": {"kind": "interp", "control": True, "error": "could not start"},
    "interpreter_by_image": {"kind": "interp", "control": False, "error": "could not start"},
    "timeout": {"kind": "ran", "timed_out": True, "junit": None, "rc": None},
    "no_report": {"kind": "ran", "junit": None, "rc": None, "signal": 9},
    "bad_report": {"kind": "ran", "junit": "<testsuite", "rc": 1},
    "tests": {"kind": "ran", "junit": JUNIT, "rc": 0},
    "infra": {"kind": "infra", "stage": "prepare", "error": "no pristine python"},
}


def test_every_row_has_an_example() -> None:
    assert sorted(EXAMPLES) == sorted(r.name for r in BLAME)
    assert len({r.name for r in BLAME}) == len(BLAME)


@pytest.mark.parametrize("row", [r.name for r in BLAME])
def test_row(row: str) -> None:
    """The example reaches its row, and the result says what the row says."""
    r = blame(EXAMPLES[row])
    assert r.name == row
    if row in RESULTS:
        assert scoring.facts_of(RESULTS[row]) == EXAMPLES[row]
    res = scoring._decide(None, EXAMPLES[row], {"error": "what happened", **RESULTS.get(row, {})}, 0.0, timeout_s=5)
    assert res.status == r.status
    if row == "tests":
        assert res.reward == 1.0 and res.total == 1
    else:
        assert res.reward == r.reward
        assert res.note if r.status == "ok" else res.error
    if row == "instance_ended":
        assert res.note == scoring.GONE_NOTE
    if row == "timeout":
        assert res.note == "tests exceeded the verifier timeout (5 s)"


OUTCOMES = ("ran", "agent", "survivors", "swept_left", "disturbed", "interp", "infra")
INSTANCES = ("alive", "gone", "stopped", "host: /proc/1: I/O error")


def _space():
    for outcome, instance, control, timed_out, report in itertools.product(
        OUTCOMES, INSTANCES, (False, True), (False, True), ("parsed", "none", "unreadable")
    ):
        yield Facts(outcome, instance=instance, control=control, timed_out=timed_out, report=report)


def _outside_the_agents_reach(f: Facts) -> bool:
    """Facts no state of the agent's can produce: we or the host stopped or broke the instance,
    the helper or the host failed while the instance lives and nothing of the agent's ran (the
    host swept it first), or the image's interpreter fails in the pristine tree alone."""
    if f.instance == "gone":
        return False
    if f.instance == "stopped" or f.instance.startswith("host"):
        return True
    return f.outcome == "infra" or (f.outcome == "interp" and not f.control)


def test_no_agent_state_is_an_error() -> None:
    """Every combination of facts: an error only outside the agent's reach, and every row an
    agent can reach gives status ok with a reward (0.0 unless the tests decide)."""
    seen = set()
    for f in _space():
        row = blame(f)
        seen.add(row.name)
        if row.status == "error":
            assert _outside_the_agents_reach(f), (f, row.name)
            assert not row.agent, row.name
        else:
            assert row.agent, row.name
        if not _outside_the_agents_reach(f):
            assert row.status == "ok" and row.reward in (0.0, None), (f, row.name)
    assert seen == {r.name for r in BLAME}  # the sweep reaches every row
    for r in BLAME:
        assert (r.status == "ok") == r.agent, r.name
        assert r.status == "error" or r.reward in (0.0, None)
