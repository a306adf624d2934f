"""``sandbox.binds``: the one way a host directory gets into a sandbox, read-only unless ``:rw``."""

from __future__ import annotations

from pathlib import Path

import pytest

from et_hpc.sandbox.config import SandboxConfig
from et_hpc.sandbox.sandbox import Sandbox

pytestmark = pytest.mark.apptainer


def test_binds_are_read_only_unless_marked_rw(base_sif: Path, tmp_path: Path) -> None:
    ro, rw = tmp_path / "ro", tmp_path / "rw"
    for d in (ro, rw):
        d.mkdir()
    (ro / "given.txt").write_text("from the host\n")
    opts = SandboxConfig(binds=[f"{ro}:/data", f"{rw}:/out:rw"]).bind_options()
    with Sandbox(base_sif, run_prefix="t-binds", scratch=tmp_path / "scratch", warm_scoring=False, binds=opts) as sb:
        sh = sb.shell()
        assert sh.run("cat /data/given.txt").output.strip() == "from the host"
        denied = sh.run("echo x > /data/new.txt")
        assert denied.exit_code != 0
        assert sh.run("echo y > /out/result.txt").exit_code == 0
    assert not (ro / "new.txt").exists()
    assert (rw / "result.txt").read_text() == "y\n"
