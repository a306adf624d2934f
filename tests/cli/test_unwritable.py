"""A store, scratch or output place this user cannot write: one line and exit 2, nothing lost."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers.demo import DEMO

ET = [sys.executable, "-m", "et_hpc.cli"]


def test_unwritable_store_is_one_line_and_keeps_what_is_there(base_sif: Path, tmp_path: Path) -> None:
    b = subprocess.run([*ET, "build", str(DEMO)], capture_output=True, text=True, timeout=900)
    assert b.returncode == 0, b.stderr[-2000:]
    locked = tmp_path / "locked"
    (locked / "old-run").mkdir(parents=True)
    (locked / "old-run" / "kept.txt").write_text("kept")
    locked.chmod(0o555)
    try:
        # the positive control: this user really cannot create anything there
        assert not os.access(locked, os.W_OK)
        r = subprocess.run(
            [*ET, "run", str(DEMO), "--policy", "oracle", "--samples", "1", "--run-name", "x", "--store", str(locked / "runs")],
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        locked.chmod(0o755)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("et-hpc: error:"), r.stderr
    assert "Permission denied" in lines[0] and str(locked) in lines[0], lines[0]
    assert (locked / "old-run" / "kept.txt").read_text() == "kept"
