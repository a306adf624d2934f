"""Where users are pointed to the viewer: ``et-hpc status`` and the nightly HTML of ``et-hpc report``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ET_HPC = [sys.executable, "-m", "et_hpc.cli"]


def test_status_and_report_point_to_the_viewer(view_runs: dict[str, Path], tmp_path: Path) -> None:
    run = view_runs["oracle"]
    r = subprocess.run(ET_HPC + ["status", str(run)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and f"et-hpc view {run}" in r.stdout, r.stdout + r.stderr
    out = tmp_path / "nightly.html"
    r = subprocess.run(ET_HPC + ["report", str(run.parent), "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"et-hpc view {run.parent}/RUN" in out.read_text()
