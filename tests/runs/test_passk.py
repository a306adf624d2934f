"""pass@1 with its 95% Wilson interval and the unbiased pass@k, checked against brute force and the
definitions, and through the store summary of a real parquet run."""

from __future__ import annotations

import itertools
import math

from hypothesis import given
from hypothesis import strategies as st

from et_hpc.runs.passk import evaluate, pass_at_k, wilson


@given(n=st.integers(1, 9), data=st.data())
def test_pass_at_k_is_the_chance_a_random_k_subset_holds_a_pass(n, data):
    c = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, n))
    outcomes = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    brute = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
    assert math.isclose(pass_at_k(n, c, k), brute, abs_tol=1e-12)


@given(n=st.integers(1, 500), data=st.data())
def test_wilson_holds_the_rate_and_is_the_score_interval(n, data):
    k = data.draw(st.integers(0, n))
    lo, hi = wilson(k, n)
    assert 0 <= lo <= k / n <= hi <= 1
    # the bounds are where the score statistic equals z (those not clipped at 0 or 1)
    for b in (lo, hi):
        if 0 < b < 1:
            assert math.isclose(abs(k / n - b) / math.sqrt(b * (1 - b) / n), 1.959963984540054, rel_tol=1e-6)


def test_per_task_and_overall_with_errors_left_out():
    rows = [("a", "ok", 1.0), ("a", "ok", 0.0), ("a", "ok", 1.0), ("a", "ok", 0.0), ("b", "ok", 0.0), ("b", "policy_error", None)]
    e = evaluate(rows)
    a, b = e.per_task["a"], e.per_task["b"]
    assert (a.n, a.solved, a.pass1) == (4, 2, 0.5) and a.pass_at == {2: 1 - 1 / 6, 4: 1.0}
    assert (b.n, b.solved, b.pass_at) == (1, 0, {})  # one ok sample: no pass@2; the error is not a failure
    assert (e.overall.n, e.overall.solved) == (5, 2) and e.overall.pass1_ci == wilson(2, 5)
    assert e.overall.pass_at == {2: 1 - 1 / 6, 4: 1.0} and e.overall.tasks == {2: 1, 4: 1}


def test_the_store_summary_carries_them(tmp_path):
    from et_hpc.record import EpisodeRecord
    from et_hpc.runs.store import RunStore

    rs = RunStore(tmp_path / "run")
    recs = [
        EpisodeRecord(episode_id=f"e{t}{s}", run_name="run", task_id=t, sample=s, group_id=f"g{t}", status="ok", reward=float(s % 2 == 0))
        for t in ("x", "y")
        for s in range(4)
    ]
    rs.write(recs)
    ev = rs.summary().evaluation
    assert ev is not None and ev.overall.pass1 == 0.5 and ev.per_task["x"].pass_at[4] == 1.0
