"""A continuous run exports exactly the groups its stream handed out: same count, sizes, members.

Real parts: ``et-hpc run --continuous`` (local worker, real apptainer instances on a demo task's
image), the scripted chat server behind an endpoint file (exact token ids), the stream, the
store's Atropos and SkyRL exports. Every unit is one task's epoch, so under the older grouping
rule (task, policy version) all of them would have merged into one group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from helpers import REPO

DEMO = REPO / "defs" / "demo"
TASK = "demo_hello_file"
SOLVE = "printf 'Hello, et-hpc!\\n' > /home/user/greeting.txt"


@pytest.mark.apptainer
@pytest.mark.slow
def test_continuous_run_exports_the_streamed_groups(base_sif: Path, tmp_path: Path) -> None:
    from et_hpc.images.store import ImageStore
    from et_hpc.rollouts import RolloutStream
    from et_hpc.runs.export import export_atropos, export_skyrl, generator_output
    from et_hpc.runs.store import RunStore
    from et_hpc.tasks.loader import load_tasks
    from et_hpc.testing.scripted_server import ScriptedServer

    ImageStore().ensure(next(t for t in load_tasks(str(DEMO)).tasks if t.id == TASK))
    store = tmp_path / "store"
    # one turn solves it, or not: members of a group differ (cat first, or write first)
    with ScriptedServer({"greeting.txt": [{"command": SOLVE}, "Done."]}) as srv:
        ep = tmp_path / "endpoint.json"
        srv.write_endpoint_file(ep)
        cfg = tmp_path / "c.yaml"
        cfg.write_text(f"""\
name: cont
tasks: {{source: {DEMO}, ids: [{TASK}]}}
samples: 2
policy: {{kind: openai, endpoint_file: {ep}, logprobs: true, return_token_ids: true, temperature: 0}}
budgets: {{max_turns: 4}}
concurrency: 2
continuous: {{heartbeat_s: 1, poll_s: 0.5, lease_s: 30}}
""")
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "et_hpc.cli",
                "run",
                "--config",
                str(cfg),
                "--continuous",
                "--target-groups",
                "3",
                "--store",
                str(store),
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "ET_HPC_STORE": str(store)},
        )
        assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    run_dir = store / "cont"
    with RolloutStream(run_dir, "audit") as s:
        streamed = s.next_batch(10_000, timeout_s=1)
    assert len(streamed) >= 3
    assert all(len(g.records) == 2 for g in streamed)
    assert len({g.group_id for g in streamed}) == len(streamed)  # one group per unit (epoch)

    out = tmp_path / "a.jsonl"
    res = export_atropos(RunStore(run_dir), out, drop_zero_variance=False)
    exported = [json.loads(line) for line in out.read_text().splitlines()]
    want = sorted((g.group_id, tuple(r.episode_id for r in g.records)) for g in streamed)
    got = sorted((g["et_hpc"]["group_id"], tuple(g["et_hpc"]["episode_ids"])) for g in exported)
    assert res.groups == len(exported) == len(streamed) and got == want
    assert Counter(len(g["tokens"]) for g in exported) == Counter({2: len(streamed)})
    assert all(t for g in exported for t in g["tokens"])
    # SkyRL: one instance per streamed group, its members as repetitions
    export_skyrl(RunStore(run_dir), tmp_path / "s.parquet")
    go = generator_output(tmp_path / "s.parquet")
    by_instance: dict[str, list[int]] = {}
    for t in go["trajectory_ids"]:
        by_instance.setdefault(t.instance_id, []).append(t.repetition_id)
    assert {k: sorted(v) for k, v in by_instance.items()} == {g.group_id: sorted(r.sample for r in g.records) for g in streamed}
    # RolloutGroup.scored_data(): every member has exact tokens, nothing dropped
    for g in streamed:
        d = g.scored_data()
        assert len(d["tokens"]) == 2 and d["dropped_no_tokens"] == 0
