"""Each turn carries the version that answered it: the versioned alias the server names in its
response (``served_model``), not the endpoint file read around the request. The scripted server
switches its weights (served names) and republishes the endpoint file while a request is on its way
(``on_request``): the request that raced the switch is stamped with the new version; with the alias
disabled (endpoint timing, the positive control) the same race labels it with the old one."""

from __future__ import annotations

from pathlib import Path

import pytest

from et_hpc.agent.openai_policy import OpenAIPolicy
from et_hpc.episode.run import policy_version_fields
from et_hpc.scripted_server import ScriptedServer

A, B = "/ck/step-10@step-10", "/ck/step-20@step-20"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


def _episode(tmp_path: Path, *, alias: bool, race_turn: int, turns: int = 3) -> tuple[OpenAIPolicy, ScriptedServer]:
    """Run ``turns`` turns; the weights switch from A to B while turn ``race_turn``'s request is on its way."""
    names = (lambda v: [f"policy@{v}", "policy"]) if alias else (lambda v: None)
    srv = ScriptedServer({"hi": ["<command>ls</command>"] * turns}, model="policy", served_names=names(A)).start()
    ep = tmp_path / "private" / "endpoint.json"
    srv.write_endpoint_file(ep, model_version=A, served_model=f"policy@{A}" if alias else None)

    def switch(req: dict) -> None:  # new weights, then their endpoint file, before the request is looked at
        if sum(m.get("role") == "assistant" for m in req.get("messages") or []) == race_turn and not switched:
            switched.append(1)
            if alias:
                srv.serve(names(B))
            srv.write_endpoint_file(ep, model_version=B, served_model=f"policy@{B}" if alias else None)

    switched: list[int] = []
    srv.on_request = switch
    policy = OpenAIPolicy(srv.base_url, "policy", endpoint_file=ep, mode="text", backoff_base_s=0.01)
    msgs = list(MESSAGES)
    for _ in range(turns):
        action = policy.act(msgs)
        msgs += [action.message, {"role": "user", "content": "ok"}]
    assert switched
    return policy, srv


@pytest.mark.parametrize("race_turn", [0, 1])
def test_the_turn_that_raced_the_switch_names_the_new_weights(tmp_path: Path, race_turn: int) -> None:
    policy, srv = _episode(tmp_path, alias=True, race_turn=race_turn)
    try:
        want = [A] * race_turn + [B] * (3 - race_turn)
        assert policy.turn_versions == [(v, v) for v in want]
        assert policy.version_sources == ["response"] * 3
        # the raced request was refused (404: the alias is gone) and sent again at once, uncounted
        assert policy.retries == 0 and policy.requests == 4
        assert [e for e in policy.events if e.startswith("version switch: ")] == [
            f"version switch: policy@{A} -> policy@{B} (HTTP 404: The model `policy@{A}` does not exist.)"
        ]
        fields = policy_version_fields(policy)
        assert fields["policy_version"] == want[0] and fields["version_source"] == "response"
        assert fields["crossed_version"] is (race_turn > 0)  # crossing is per episode, from its turns
    finally:
        policy.close()
        srv.stop()


def test_endpoint_timing_mislabels_the_raced_turn(tmp_path: Path) -> None:
    """Positive control: without an alias the race is labelled from the file around the request, so
    an episode answered by B alone starts "under" A and counts as crossing."""
    policy, srv = _episode(tmp_path, alias=False, race_turn=0)
    try:
        assert policy.turn_versions == [(A, B), (B, B), (B, B)] and policy.version_sources == ["endpoint"] * 3
        fields = policy_version_fields(policy)
        assert fields["policy_version"] == A and fields["crossed_version"] is True
        assert fields["version_source"] == "endpoint"
    finally:
        policy.close()
        srv.stop()


def test_token_in_turns_carry_the_answering_version(tmp_path: Path) -> None:
    srv = ScriptedServer({"hi": ["<command>ls</command>"] * 2}, model="policy", served_names=[f"policy@{A}", "policy"])
    ep = tmp_path / "private" / "endpoint.json"
    with srv:
        srv.write_endpoint_file(ep, model_version=A, served_model=f"policy@{A}")
        policy = OpenAIPolicy(srv.base_url, "policy", endpoint_file=ep, mode="text", token_in=True)
        msgs = list(MESSAGES)
        action = policy.act(msgs)
        srv.serve([f"policy@{B}", "policy"])  # switched between turns: the next request asks for B
        srv.write_endpoint_file(ep, model_version=B, served_model=f"policy@{B}")
        policy.act([*msgs, action.message, {"role": "user", "content": "ok"}])
        assert policy.turn_versions == [(A, A), (B, B)] and policy.version_sources == ["response"] * 2
        policy.close()


def test_an_answer_names_its_alias_even_when_the_plain_name_was_asked(tmp_path: Path) -> None:
    """A server that answers with its first served name (vLLM, llama-server): a policy fixed to
    another name still learns the version from the answer."""
    with ScriptedServer({"hi": ["done"]}, model="policy", served_names=[f"policy@{B}", "policy", "other"]) as srv:
        ep = tmp_path / "private" / "endpoint.json"
        srv.write_endpoint_file(ep, model_version=B, served_model=f"policy@{B}")
        policy = OpenAIPolicy(srv.base_url, "other", endpoint_file=ep, mode="text")
        policy.act(list(MESSAGES))
        assert policy.turn_versions == [(B, B)] and policy.version_sources == ["response"]
        assert srv.log[-1]["served"] == "reply"
        policy.close()


def test_a_replica_switch_is_followed_the_same_way(tmp_path: Path) -> None:
    """policy.endpoint_dir: the replica's own file names the alias; the raced turn names B."""
    from et_hpc.agent.replicas import ReplicaSet

    srv = ScriptedServer({"hi": ["<command>ls</command>"] * 2}, model="policy", served_names=[f"policy@{A}", "policy"])
    ep = tmp_path / "replicas" / "job1.json"
    with srv:
        srv.write_endpoint_file(ep, job_id="job1", model_version=A, served_model=f"policy@{A}")

        def switch(req: dict) -> None:
            if any(m.get("role") == "assistant" for m in req.get("messages") or []) and srv.served_names[0] != f"policy@{B}":
                srv.serve([f"policy@{B}", "policy"])
                srv.write_endpoint_file(ep, job_id="job1", model_version=B, served_model=f"policy@{B}")

        srv.on_request = switch
        policy = OpenAIPolicy(None, "policy", replicas=ReplicaSet(ep.parent), mode="text")
        action = policy.act(list(MESSAGES))
        policy.act([*MESSAGES, action.message, {"role": "user", "content": "ok"}])
        assert policy.turn_versions == [(A, A), (B, B)] and policy.version_sources == ["response"] * 2
        assert policy.retries == 0 and any(e.startswith("version switch: ") for e in policy.events)
        policy.close()


def test_odd_endpoint_records_fall_back_to_endpoint_timing() -> None:
    from et_hpc.agent.served import ServedVersions

    sv = ServedVersions()
    for rec in ({"model": ["x"], "served_model": {"a": 1}, "model_version": "v"}, {"served_model": "m@v"}, None):
        sv.learn(rec)
        assert sv.request_name("m") == "m" and sv.label("m@v", lambda: None) is None
    sv.learn({"model": "m", "served_model": "m@v", "model_version": "v"})
    assert sv.request_name("m") == "m@v" and sv.label("m@v", lambda: None) == "v"
    assert sv.request_name("other") == "other" and sv.sent is None  # another model: not this alias
