"""The run config: YAML and ``--set`` overrides, one-line errors, and the CLI's exit status 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from et_hpc.errors import UserError
from et_hpc.runner.config import load_config, parse_set


def test_config_yaml_and_overrides(tmp_path: Path) -> None:
    y = tmp_path / "run.yaml"
    y.write_text("name: smoke\nsamples: 3\nslurm:\n  partition: cpu\n  setup: [module load apptainer]\n")
    cfg = load_config(y, parse_set(["slurm.units_per_task=4", "executor=slurm", "policy.kind=null"]))
    assert cfg.samples == 3 and cfg.executor == "slurm"
    assert cfg.slurm.partition == "cpu" and cfg.slurm.units_per_task == 4
    assert cfg.slurm.setup == ["module load apptainer"]
    kind = cfg.policy["kind"] if isinstance(cfg.policy, dict) else cfg.policy.kind
    assert kind == "null"
    assert cfg.run_dir().name == "smoke"
    assert cfg.node_concurrency(cores=2, mem_gb=24) == 4
    assert cfg.node_concurrency(cores=16, mem_gb=8) == 4


def test_config_errors_are_one_line(tmp_path: Path) -> None:
    y = tmp_path / "run.yaml"
    y.write_text("samples: 2\nslurm:\n  partiton: cpu\n")
    with pytest.raises(UserError) as e:
        load_config(y)
    assert str(y) in str(e.value) and "slurm.partiton" in str(e.value) and "\n" not in str(e.value)
    y.write_text("samples: [1\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_config(y)
    with pytest.raises(UserError, match="KEY=VALUE"):
        parse_set(["samples"])
    with pytest.raises(UserError, match="samples"):
        load_config(None, parse_set(["samples=0"]))


def test_cli_bad_config_exits_2(tmp_path: Path, capsys) -> None:
    from et_hpc.cli import main

    y = tmp_path / "run.yaml"
    y.write_text("executor: cloud\n")
    assert main(["run", "--config", str(y)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("et-hpc: error:") and "executor" in err[0]
