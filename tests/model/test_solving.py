"""The solving tier (Qwen2.5-Coder-1.5B-Instruct Q4_K_M on llama-server) acts: a grammar makes its
replies tool calls (the positive control: the same request without it makes none), it solves
``demo_hello_file`` with greedy decoding, and a group of 4 samples (seeds s..s+3) whose rewards
differ exports as a trainable group with the exact ids and logprobs. Slow on 2 cores (~20-50 s per turn
under load): few, short episodes. Determinism of llama-server: docs/policy.md, "Constrained replies".
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from helpers import REPO, need

ET_HPC = [sys.executable, "-m", "et_hpc.cli"]
DEMO = REPO / "defs" / "demo"
SOLVER = "qwen2.5-coder-1.5b"
HELLO = json.loads((DEMO / "demo_hello_file" / "task.json").read_text())["description"]


@pytest.fixture(scope="module")
def solver(tmp_path_factory):
    need(SOLVER)
    from et_hpc.model.catalog import prepare
    from et_hpc.model.server import ServerConfig, serving

    m, digest = prepare(SOLVER)
    d = tmp_path_factory.mktemp("solver")
    cfg = ServerConfig(model=m.path, digest=digest, endpoint_file=d / "ep" / "endpoint.json", log_file=d / "server.log", parallel=2)
    with serving(cfg) as srv:
        yield srv


def _policy(srv, **kw):
    from et_hpc.agent.openai_policy import OpenAIPolicy

    ep = json.loads(srv.cfg.endpoint_file.read_text())
    kw = {"temperature": 0.0, "seed": 0, "max_tokens": 96, "max_retries": 1, **kw}
    return OpenAIPolicy(ep["base_url"], api_key=ep["api_key"], **kw)


def _first_turn(policy):
    from et_hpc.agent.wire import default_system_prompt

    msgs = [{"role": "system", "content": default_system_prompt("tools")}, {"role": "user", "content": HELLO}]
    return policy.act(msgs)


def test_the_grammar_makes_the_reply_a_tool_call(solver):
    free = _first_turn(_policy(solver, mode="tools", token_in=True, constrain=False))
    assert free.kind != "command" and "<tool_call>" not in (free.message.get("content") or ""), free.message  # positive control
    p = _policy(solver, mode="tools", token_in=True)  # the default on llama-server: constrained
    a = _first_turn(p)
    assert a.kind == "command" and a.command, a.message
    assert p.constrained == ["grammar"]


def test_a_cut_off_tool_call_is_kept_in_a_form_the_server_renders(solver):
    """A reply cut off inside its tool call (its token limit): llama-server refuses a history holding
    the call as written (HTTP 500 with Qwen's template; the positive control), so an episode would end
    a masked policy error; the form the agent keeps renders."""
    from types import SimpleNamespace

    from et_hpc.agent.replies import tool_action

    ep = json.loads(solver.cfg.endpoint_file.read_text())
    auth = {"Authorization": f"Bearer {ep['api_key']}"}
    cut = '{"command": "tail -n +2 /home/user/data/sales.csv | awk -F, \'{print $3}'
    fn = SimpleNamespace(name="terminal", arguments=cut)
    action = tool_action(SimpleNamespace(content="", tool_calls=[SimpleNamespace(id="call_0", function=fn)]))
    assert action.kind == "invalid"
    head = [{"role": "system", "content": "You run shell commands."}, {"role": "user", "content": "Sum column 3."}]
    obs = {"role": "tool", "tool_call_id": "call_0", "content": action.error}
    call = {"id": "call_0", "type": "function", "function": {"name": "terminal", "arguments": cut}}
    raw = {"role": "assistant", "content": "", "tool_calls": [call]}
    url = ep["base_url"].removesuffix("/v1") + "/apply-template"
    bad = httpx.post(url, json={"messages": [*head, raw, obs]}, headers=auth, timeout=60)
    assert bad.status_code >= 400 and "argument" in bad.text.lower(), (bad.status_code, bad.text[:300])
    good = httpx.post(url, json={"messages": [*head, action.message, obs]}, headers=auth, timeout=60)
    assert good.status_code == 200 and "unparsed" in good.json()["prompt"], good.text[:300]


def test_a_chat_mode_tools_constraint_on_llama_server_is_said_not_done(solver, caplog):
    p = _policy(solver, mode="tools", token_in=False, constrain=True, max_tokens=8)
    with caplog.at_level(logging.WARNING, logger="et_hpc.agent.constrain"):
        _first_turn(p)
    assert p.constrained == ["none"]
    assert [r for r in caplog.records if "NOT constrained" in r.getMessage()]


def _run(tmp: Path, srv, name: str, task: str, samples: int, *sets: str) -> list:
    from et_hpc.runs.store import open_run

    cmd = [*ET_HPC, "run", str(DEMO), "--set", f"tasks.ids=[{task}]", "--samples", str(samples), "--run-name", name]
    cmd += ["--store", str(tmp / "store"), "--concurrency", "2", "--json", "--policy", "openai"]
    defaults = ("budgets.max_turns=4", "budgets.max_tokens_per_turn=128", "budgets.wall_time_s=900")
    for s in (f"policy.endpoint_file={srv.cfg.endpoint_file}", "policy.token_in=true", "policy.max_retries=2", *defaults, *sets):
        cmd += ["--set", s]  # the last --set of a key wins: a test's own settings after the defaults
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=tmp)
    assert r.returncode in (0, 1), r.stderr[-3000:]
    return open_run(tmp / "store" / name)


@pytest.mark.apptainer
def test_solves_hello_file_greedily(solver, base_sif, tmp_path):
    from et_hpc.images.store import ImageStore
    from et_hpc.tasks.loader import load_tasks

    [ImageStore().ensure(t) for t in load_tasks(str(DEMO)).tasks if t.id in ("demo_hello_file", "demo_csv_sum")]
    run = _run(tmp_path, solver, "greedy", "demo_hello_file", 1, "policy.temperature=0", "policy.seed=0")
    [r] = run.records()
    assert r.status == "ok" and r.reward == 1.0, (r.status, r.error, r.messages)
    assert r.sampling_params["constrained"] == ["grammar"] * r.turns
    assert (r.tokens_source, r.token_drift) == ("server-exact", None)


@pytest.mark.apptainer
def test_a_group_of_four_whose_rewards_differ_exports_as_trainable(solver, base_sif, tmp_path):
    from et_hpc.runs.export import export_atropos, validate_atropos_group

    tried = []
    for attempt, (temperature, seed) in enumerate(GROUP_DRAWS):  # another group while the rewards are equal
        sets = (f"policy.temperature={temperature}", f"policy.seed={seed}", "policy.logprobs=true", "budgets.max_turns=1")
        run = _run(tmp_path, solver, f"group{attempt}", GROUP_TASK, 4, *sets)
        recs = run.records()
        assert [r.status for r in recs] == ["ok"] * 4, [(r.status, r.error) for r in recs]
        assert sorted(r.sampling_params["seed"] for r in recs) == [seed + i for i in range(4)]
        tried.append([r.reward for r in recs])
        if len(set(tried[-1])) > 1:
            break
    assert len(set(tried[-1])) > 1, tried
    out = tmp_path / "groups.jsonl"
    res = export_atropos(run, out)  # zero-variance groups dropped: this one stays
    [g] = [json.loads(line) for line in out.read_text().splitlines()]
    validate_atropos_group(g)
    assert res.groups == 1 and len(set(g["scores"])) > 1
    exact = {r.sample: r.token_sequence() for r in recs}
    for s, toks, masks in zip(g["et_hpc"]["samples"], g["tokens"], g["masks"]):
        assert list(toks) == exact[s][0] and list(masks) == exact[s][1]
    # behaviour logprobs beside the exact ids: one per sampled token
    for r in recs:
        assert r.logprobs is not None and r.token_ids is not None, r.events
        assert [len(lp) for lp in r.logprobs] == [len(ids) for ids in r.token_ids]


# The group: demo_hello_file in one turn, sampled hot. Measured with the 1.5B on 2 cores: at
# temperature 1.0 it solved 12 of 12 and at 1.5 4 of 4; at 1.8 10 of 16 and at 2.0 4 of 12. A group
# of 4 then has equal rewards one time in four to eight, so up to six groups are drawn (all six
# equal: about 1 in 10,000); each takes about a minute.
GROUP_TASK = "demo_hello_file"
GROUP_DRAWS = ((1.7, 1), (1.9, 101), (1.7, 202), (1.9, 303), (1.7, 404), (1.9, 505))
