"""A plain clone carries everything its tests, benches and README use."""

from __future__ import annotations

import subprocess

from helpers import FIXTURES, REPO


def test_no_file_points_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    assert "README.md" in files  # positive control: the listing sees the tree
    outside = "../" + "shared"
    hits = [f for f in files if (REPO / f).is_file() and outside in (REPO / f).read_text(errors="replace")]
    assert hits == [], f"files that refer to a folder beside the clone: {hits}"


def test_fixtures_are_in_the_repository():
    assert FIXTURES.resolve().is_relative_to(REPO.resolve()) or FIXTURES.is_dir()
    for kind in ("native", "harbor"):
        tasks = [p for p in (FIXTURES / kind).iterdir() if p.is_dir()]
        assert len(tasks) >= 6, f"{kind}: {len(tasks)} task folders"
    assert (FIXTURES / "skyrl" / "train.parquet").stat().st_size > 0
