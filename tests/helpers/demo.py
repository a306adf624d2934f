"""The demo task the end-to-end tests run (defs/demo/demo_hello_file), and what solves it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from helpers import REPO

DEMO = REPO / "defs" / "demo"
TASK = "demo_hello_file"
KEY = "greeting.txt"  # a substring of the task's prompt: the scripted server's script key
SOLVE = "printf 'Hello, et-hpc!\\n' > /home/user/greeting.txt"


def built_validation_set(tmp_path: Path) -> tuple[Path, str]:
    """A tasks folder holding the demo task, its image built by the et-hpc beside this Python (the
    nightly script's validation set): (the folder, that et-hpc)."""
    tasks = tmp_path / "val"
    tasks.mkdir()
    shutil.copytree(DEMO / TASK, tasks / TASK, symlinks=True)
    et_hpc = str(Path(sys.executable).parent / "et-hpc")
    b = subprocess.run([et_hpc, "build", "--tasks-dir", str(tasks)], capture_output=True, text=True, timeout=900)
    assert b.returncode == 0, b.stdout + b.stderr
    return tasks, et_hpc
