"""A plain clone carries everything its tests, benches and README use."""

from __future__ import annotations

import os

from helpers import FIXTURES, REPO

SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis", "node_modules"}


def tree_files() -> list[str]:
    """Every file below the checkout (the tests may run as a user git refuses to serve this tree to)."""
    out = []
    for top, dirs, names in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        out += [os.path.relpath(os.path.join(top, n), REPO) for n in names]
    return out


def test_no_file_points_outside_the_repository():
    files = tree_files()
    assert "README.md" in files and "tests/test_self_contained.py" in files  # positive control: the walk sees the tree
    outside = "../" + "shared"
    hits = [f for f in files if (REPO / f).is_file() and outside in (REPO / f).read_text(errors="replace")]
    assert hits == [], f"files that refer to a folder beside the clone: {hits}"


def test_fixtures_are_in_the_repository():
    assert FIXTURES.resolve().is_relative_to(REPO.resolve()) or FIXTURES.is_dir()
    for kind in ("native", "harbor"):
        tasks = [p for p in (FIXTURES / kind).iterdir() if p.is_dir()]
        assert len(tasks) >= 6, f"{kind}: {len(tasks)} task folders"
    assert (FIXTURES / "skyrl" / "train.parquet").stat().st_size > 0
