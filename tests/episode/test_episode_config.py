"""The episode's config is its own: a run config extends it with the same keys, and the runner calls
the episode as a function (a config naming it by its old string still gets it)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from et_hpc.episode.config import EpisodeConfig
from et_hpc.runner.config import RunConfig, load_config
from et_hpc.runner.local import EPISODE_RUNNER, episode_runner, resolve_runner

EPISODE_KEYS = {
    "name": "e1",
    "policy": {"kind": "null"},
    "budgets": {"max_turns": 3},
    "sandbox": {"overlay_mb": 64},
    "scoring_timeout_s": 30,
}


def test_a_run_config_is_an_episode_config_with_the_same_keys() -> None:
    ep = EpisodeConfig.model_validate(EPISODE_KEYS)
    run = RunConfig.model_validate({**EPISODE_KEYS, "samples": 2})
    assert isinstance(run, EpisodeConfig)
    for key in EPISODE_KEYS:
        assert getattr(ep, key) == getattr(run, key)
    assert ep.run_name() == run.run_name() == "e1"
    with pytest.raises(ValidationError):  # the run's keys are not the episode's
        EpisodeConfig.model_validate({**EPISODE_KEYS, "samples": 2})


def test_the_default_unit_runner_is_the_episode_function() -> None:
    cfg = load_config(None, [(["policy", "kind"], "null")])
    assert cfg.unit_runner is None
    assert resolve_runner(cfg.unit_runner) is episode_runner
    assert resolve_runner(EPISODE_RUNNER) is episode_runner  # run.json files written before
    assert resolve_runner("helpers.units:work_runner") is not episode_runner
