"""``et-hpc run --help`` lists the run config keys read from the config models, and every key it
lists is one the config accepts; the old names of the moved models still resolve."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys

import pytest

from et_hpc.errors import UserError
from et_hpc.runner.config import RunConfig, config_keys, load_config
from et_hpc.sandbox.config import SandboxConfig


def _help() -> str:
    r = subprocess.run(
        [sys.executable, "-m", "et_hpc.cli", "run", "--help"], capture_output=True, text=True, env=dict(os.environ, COLUMNS="100")
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_help_lists_every_field_of_the_models() -> None:
    text = _help()
    block = text[text.index("Run config keys:") : text.index("Exit status:")]
    flat = re.sub(r"\s+", "", block)
    for name in SandboxConfig.model_fields:
        assert name in flat
    assert "sandbox.{overlay_mb,writable_tmpfs,network(none|host)," in flat
    assert "api_key," not in flat  # secrets never go in a config file
    assert all(len(line) <= 100 for line in block.splitlines())


def test_every_listed_key_is_accepted_and_a_wrong_one_refused() -> None:
    for key in config_keys():
        name = key.split(" ")[0].split(".")[0]
        assert name in RunConfig.model_fields
    cfg = load_config(None, [(["sandbox", "overlay_mb"], 64)])
    assert cfg.sandbox.overlay_mb == 64
    with pytest.raises(UserError):
        load_config(None, [(["sandbox", "overlay_megabytes"], 64)])


def test_old_names_resolve_to_the_same_classes() -> None:
    from et_hpc.host.slurm import SlurmConfig
    from et_hpc.rollouts.options import ContinuousOptions
    from et_hpc.runner.config import ContinuousConfig, SandboxOptions, SlurmOptions, TaskSelection
    from et_hpc.tasks.loader import TaskSelectionConfig

    assert SandboxOptions is SandboxConfig and SlurmOptions is SlurmConfig
    assert TaskSelection is TaskSelectionConfig and ContinuousOptions is ContinuousConfig
    import et_hpc.images.cli as old_build
    import et_hpc.store as old_store
    from et_hpc.images.slurm_build import BuildChunk
    from et_hpc.runs.store import RunStore

    assert old_build.BuildChunk is BuildChunk and old_store.RunStore is RunStore
    # what submitit pickled before the moves still loads: a pickle names a class by module path
    assert pickle.loads(b"cet_hpc.images.cli\nBuildChunk\n.") is BuildChunk
    assert pickle.loads(b"cet_hpc.store\nRunStore\n.") is RunStore
    with pytest.raises(AttributeError):
        old_store.no_such_name  # noqa: B018
