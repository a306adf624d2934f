"""``ET_HPC_APPTAINER`` names the apptainer command for sandboxes, builds and ``et-hpc doctor`` alike."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def _wrapper(tmp_path: Path) -> tuple[Path, Path]:
    """An apptainer that logs each call, then runs the real one."""
    log = tmp_path / "calls.log"
    w = tmp_path / "my-apptainer"
    w.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec {shutil.which("apptainer")} "$@"\n')
    w.chmod(0o755)
    return w, log


@pytest.mark.apptainer
def test_doctor_and_builds_use_the_configured_command(tmp_path: Path, monkeypatch) -> None:
    w, log = _wrapper(tmp_path)
    env = dict(os.environ, ET_HPC_APPTAINER=str(w))
    r = subprocess.run([sys.executable, "-m", "et_hpc.cli", "doctor", "--json"], capture_output=True, text=True, env=env)
    checks = {c["name"]: c for c in json.loads(r.stdout)}
    assert checks["apptainer"]["status"] == "OK"
    assert "--version" in log.read_text()

    from et_hpc.host import apptainer
    from et_hpc.images.store import ImageStoreConfig

    monkeypatch.setenv("ET_HPC_APPTAINER", str(w))
    assert apptainer.exe() == str(w) and ImageStoreConfig().apptainer == str(w)
    monkeypatch.delenv("ET_HPC_APPTAINER")
    assert apptainer.exe() == "apptainer" and ImageStoreConfig().apptainer == "apptainer"


def test_a_missing_command_fails_the_doctor_check(tmp_path: Path) -> None:
    env = dict(os.environ, ET_HPC_APPTAINER=str(tmp_path / "no-such-apptainer"))
    r = subprocess.run([sys.executable, "-m", "et_hpc.cli", "doctor", "--json"], capture_output=True, text=True, env=env)
    checks = {c["name"]: c for c in json.loads(r.stdout)}
    assert checks["apptainer"]["status"] == "FAIL" and r.returncode == 2
