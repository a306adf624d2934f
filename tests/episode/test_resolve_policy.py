"""An episode's policy settings survive the endpoint lookup: resolving the endpoint file (once per
process) fills in the address, the served model and the key, and nothing else of the config is
taken from whichever episode resolved it first."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from et_hpc.agent.policies import PolicyConfig
from et_hpc.episode.run import resolve_policy_config
from et_hpc.testing.scripted_server import ScriptedServer

ENDPOINT_FIELDS = {"base_url", "model", "api_key"}
COUNT = itertools.count()


@pytest.fixture(scope="module")
def srv():
    with ScriptedServer({"x": ["done"]}, model="served") as s:
        yield s


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    configs=st.lists(
        st.fixed_dictionaries(
            {
                "seed": st.one_of(st.none(), st.integers(0, 2**31 - 1)),
                "temperature": st.floats(0, 2),
                "top_p": st.floats(0.01, 1),
                "max_tokens": st.one_of(st.none(), st.integers(1, 4096)),
                "mode": st.sampled_from(["text", "tools"]),
                "logprobs": st.booleans(),
            }
        ),
        min_size=1,
        max_size=5,
    )
)
def test_only_the_endpoint_fields_come_from_the_endpoint_file(srv, tmp_path: Path, configs: list[dict]) -> None:
    ep = tmp_path / "ep" / f"endpoint-{next(COUNT)}.json"  # a file of its own: the process resolves each once
    srv.write_endpoint_file(ep)
    for c in configs:  # episodes of one process, one after another: the first resolves the file
        cfg = PolicyConfig(kind="openai", endpoint_file=ep, **c)
        got = resolve_policy_config(cfg)
        assert got.model_dump(exclude=ENDPOINT_FIELDS) == cfg.model_dump(exclude=ENDPOINT_FIELDS)
        assert got.base_url == srv.base_url and got.model == "served"
