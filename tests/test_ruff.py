"""The lint rules in pyproject.toml hold for the package, the tests, the benchmarks and slurm/."""

from __future__ import annotations

import subprocess

from helpers import REPO, need, ruff_cmd


def test_ruff_check_is_clean() -> None:
    need("ruff")
    r = subprocess.run([*ruff_cmd(), "check", "--no-cache", "et_hpc", "tests", "bench", "slurm"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_sees_a_violation(tmp_path) -> None:
    """The check can fail: an unused import under the same configuration is reported."""
    need("ruff")
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n")
    r = subprocess.run(
        [*ruff_cmd(), "check", "--no-cache", "--config", str(REPO / "pyproject.toml"), str(bad)], capture_output=True, text=True
    )
    assert r.returncode == 1 and "F401" in r.stdout
