"""The old scoring entry (``apptainer exec instance://`` + the pristine python), kept for the red
team's positive controls: an attack that fools it but not ``scoring.score`` shows the defence works.
"""

from __future__ import annotations

import json
import secrets
import subprocess
from pathlib import Path

from et_hpc.sandbox.sandbox import Sandbox
from et_hpc.scoring import live as scoring

# The old scoring driver (entered through apptainer exec): only the positive controls use it.
LEGACY_DRIVER = r"""
import json, os, subprocess, sys, tempfile
cfg = json.loads(sys.stdin.read())
d = tempfile.mkdtemp(prefix="et-score-", dir="/tmp")
path = os.path.join(d, "test_final_state.py")
open(path, "w").write(cfg["source"])
junit = os.path.join(d, "junit.xml")
ver = "python%d.%d" % sys.version_info[:2]
boot = ("import os, site, sys\nfor d in %r:\n    os.path.isdir(d) and site.addsitedir(d)\n"
        "import pytest\nsys.exit(pytest.main())\n") % ([sys.prefix + "/lib/python3/dist-packages"],)
argv = cfg["python"] + ["-I", "-S", "-B", "-c", boot, "-p", "no:cacheprovider", "--rootdir", d,
                        "-c", "/dev/null", "--noconftest", "--junitxml", junit, "-q", path]
env = {"PATH": "/usr/bin:/bin", "HOME": "/home/user", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
res = {"killed": 0, "rc": None, "timed_out": False, "junit": None, "out": "", "error": None}
try:
    p = subprocess.run(argv, cwd="/home/user", env=env, capture_output=True, timeout=cfg["timeout"])
    res["rc"] = p.returncode
    res["out"] = (p.stdout + p.stderr).decode("utf-8", "replace")[-2000:]
except subprocess.TimeoutExpired:
    res["timed_out"] = True
try:
    res["junit"] = open(junit).read()
except OSError:
    pass
sys.stdout.write("\n" + cfg["marker"] + json.dumps(res) + "\n")
"""


def legacy_score(sb: Sandbox, final: Path, timeout: float = 20) -> scoring.ScoreResult:
    """The old entry path: ``apptainer exec instance://`` (runtime scripts, /bin/sh) + pristine python."""
    loader, libdirs = scoring.pristine_layout()
    py = [loader, "--inhibit-cache", "--library-path", ":".join(libdirs), scoring.PRISTINE + "/usr/bin/python3"]
    marker = "ET-SCORE-" + secrets.token_hex(12) + ":"
    cfg = {"source": final.read_text(), "marker": marker, "python": py, "timeout": timeout}
    try:
        cp = sb.exec([*py, "-I", "-S", "-B", "-c", LEGACY_DRIVER], input=json.dumps(cfg).encode(), timeout=timeout + 30, pwd="/")
    except subprocess.TimeoutExpired:
        return scoring.ScoreResult(status="error", reward=None, error="timed out")
    out = cp.stdout.decode("utf-8", "replace")
    i = out.rfind(marker)
    if i < 0:
        return scoring.ScoreResult(status="error", reward=None, error=out[-500:])
    res = json.loads(out[i + len(marker) :].strip().splitlines()[0])
    if res.get("timed_out") or not res.get("junit"):
        return scoring.ScoreResult(status="error", reward=None, error=str(res)[-500:])  # the old blame
    return scoring._result(res, 0.0)
