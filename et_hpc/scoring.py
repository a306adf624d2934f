"""Scoring: run a task's pytest file inside the episode's instance, after the agent, hardened.

``score(sandbox, final_tests)`` does everything in one ``apptainer exec``: a driver run by the
image's *pristine* Python (the read-only copy of the image bound at ``/.et-pristine``, started
through its own dynamic loader, so nothing the agent changed in the writable layer: python,
pytest, libc, sitecustomize, is used) kills every process left in the instance, writes the test
file (sent over stdin) into a fresh private directory, and runs
``python -I -m pytest -p no:cacheprovider --rootdir=D -c /dev/null --noconftest --junitxml=...``
with a clean environment, cwd ``/home/user`` and a timeout. Python runs with ``-I -S``: the
``site`` hooks (sitecustomize, usercustomize, .pth files outside the image's own site dirs) are
never consulted, because some of them resolve into the agent-writable tree. The JUnit XML comes back in the
driver's output and is parsed here.

Reward is 1.0 iff every test passed (and there was at least one). Anything that stops us from
knowing (exec failed, no JUnit, timeout) gives status ``error`` and reward ``None``, never 0.
"""

from __future__ import annotations

import json
import logging
import platform
import secrets
import subprocess
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field

from et_hpc.errors import InfraError

if TYPE_CHECKING:
    from et_hpc.sandbox.sandbox import Sandbox

log = logging.getLogger(__name__)

PRISTINE = "/.et-pristine"
CLEAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_LOADERS = {
    "x86_64": ("x86_64-linux-gnu", "ld-linux-x86-64.so.2"),
    "aarch64": ("aarch64-linux-gnu", "ld-linux-aarch64.so.1"),
}


class TestOutcome(BaseModel):
    name: str
    outcome: Literal["passed", "failed", "error", "skipped"]
    message: str | None = None


class ScoreResult(BaseModel):
    status: Literal["ok", "error"]
    reward: float | None
    passed: int = 0
    total: int = 0
    tests: list[TestOutcome] = Field(default_factory=list)
    error: str | None = None
    output_tail: str = ""
    duration_s: float = 0.0
    interpreter: str = ""  # "pristine" (image's read-only copy) or "instance" (fallback)
    killed_processes: int = 0


# The driver runs inside the instance. Python >= 3.6, stdlib only.
DRIVER = r'''
import json, os, signal, subprocess, sys, tempfile, time
cfg = json.loads(sys.stdin.read())
me = os.getpid()
res = {"killed": 0, "rc": None, "timed_out": False, "junit": None, "out": "", "error": None}

def others():
    out = []
    for n in os.listdir("/proc"):
        if not n.isdigit() or int(n) in (1, me):
            continue
        try:
            with open("/proc/%s/stat" % n) as f:
                st = f.read()
        except (OSError, IOError):
            continue
        if st[st.rfind(")") + 2:].split()[:1] not in (["Z"], ["X"]):
            out.append(int(n))
    return out

def kill_all():
    for _ in range(200):
        left = others()
        if not left:
            return True
        res["killed"] += len(left)
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
        time.sleep(0.02)
    return not others()

def finish():
    sys.stdout.write("\n" + cfg["marker"] + json.dumps(res) + "\n")
    sys.stdout.flush()
    sys.exit(0)

if cfg["kill"] and not kill_all():
    res["error"] = "processes left by the agent could not be killed"
    finish()
d = None
for base in ("/tmp", "/dev/shm", cfg["home"]):
    try:
        d = tempfile.mkdtemp(prefix="et-score-", dir=base)
        path = os.path.join(d, cfg["name"])
        with open(path, "w") as f:
            f.write(cfg["source"])
        break
    except (OSError, IOError) as e:
        res["error"] = "cannot write the test file: %s" % e
        d = None
if d is None:
    finish()
res["error"] = None
junit = os.path.join(d, "junit.xml")
# No `site` (-S): its sitecustomize/usercustomize hooks are agent-writable (Debian's
# sitecustomize.py is a symlink into /etc). Only the interpreter's own site dirs are added.
ver = "python%d.%d" % sys.version_info[:2]
pre = sys.prefix
sitedirs = [pre + "/local/lib/" + ver + "/dist-packages", pre + "/lib/python3/dist-packages",
            pre + "/lib/" + ver + "/dist-packages", pre + "/local/lib/" + ver + "/site-packages",
            pre + "/lib/" + ver + "/site-packages"]
boot = ("import os, site, sys\n"
        "for d in %r:\n"
        "    if os.path.isdir(d) and not os.path.islink(d):\n"
        "        site.addsitedir(d)\n"
        "import pytest\n"
        "sys.exit(pytest.main())\n") % (sitedirs,)
argv = cfg["python"] + ["-I", "-S", "-B", "-c", boot, "-p", "no:cacheprovider", "--rootdir", d,
                        "-c", "/dev/null", "--noconftest", "--junitxml", junit, "-q", path]
env = {"PATH": cfg["path"], "HOME": cfg["home"], "LANG": "C.UTF-8",
       "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
cwd = cfg["home"] if os.path.isdir(cfg["home"]) else "/"
try:
    p = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = p.communicate(timeout=cfg["timeout"])
        res["rc"] = p.returncode
    except subprocess.TimeoutExpired:
        res["timed_out"] = True
        kill_all()
        out, _ = p.communicate()
    res["out"] = out.decode("utf-8", "replace")[-cfg["tail"]:]
except OSError as e:
    res["error"] = "cannot run pytest: %s" % e
if cfg["kill"]:
    kill_all()  # nothing the tests started outlives them
try:
    with open(junit) as f:
        res["junit"] = f.read()
except (OSError, IOError):
    pass
import shutil
shutil.rmtree(d, ignore_errors=True)
finish()
'''


def pristine_python() -> list[str]:
    """Argv prefix that runs the pristine image's python3 through the pristine dynamic loader."""
    arch, ld = _LOADERS.get(platform.machine(), _LOADERS["x86_64"])
    libdirs = [f"{PRISTINE}/usr/lib/{arch}", f"{PRISTINE}/lib/{arch}", f"{PRISTINE}/usr/lib64",
               f"{PRISTINE}/usr/lib", f"{PRISTINE}/lib"]
    return [f"{PRISTINE}/usr/lib/{arch}/{ld}", "--inhibit-cache", "--library-path", ":".join(libdirs),
            f"{PRISTINE}/usr/bin/python3"]


def run_tests(
    sandbox: Sandbox,
    tests: Path,
    *,
    timeout_s: float = 120.0,
    kill_first: bool = True,
    tail_chars: int = 4000,
) -> ScoreResult:
    """Run one pytest file in the instance (see the module doc) and turn it into a ScoreResult."""
    t0 = time.monotonic()
    tests = Path(tests)
    try:
        source = tests.read_text(encoding="utf-8")
    except OSError as e:
        return ScoreResult(status="error", reward=None, error=f"cannot read {tests}: {e}")
    marker = "ET-SCORE-" + secrets.token_hex(12) + ":"
    sandbox.close_shells()
    sandbox.prepare()
    cfg = {
        "source": source,
        "name": tests.name if tests.name.startswith("test_") else "test_" + tests.name,
        "home": sandbox.home,
        "path": CLEAN_PATH,
        "timeout": timeout_s,
        "kill": kill_first,
        "marker": marker,
        "tail": tail_chars,
    }
    attempts: list[tuple[str, list[str]]] = []
    if sandbox.pristine_bound:
        attempts.append(("pristine", pristine_python()))
    attempts.append(("instance", ["/usr/bin/python3"]))
    last_err = ""
    for label, py in attempts:
        cfg["python"] = py
        argv = [*py, "-I", "-S", "-B", "-c", DRIVER]
        try:
            cp = sandbox.exec(argv, timeout=timeout_s + 60, input=json.dumps(cfg).encode(), pwd="/")
        except subprocess.TimeoutExpired:
            return _error("scoring did not finish in time", "", t0, label)
        except InfraError as e:
            return _error(f"could not run the tests: {e}", "", t0, label)
        out = cp.stdout.decode("utf-8", "replace")
        i = out.rfind(marker)
        if i < 0:
            last_err = f"{label} python failed (exit {cp.returncode}): {out.strip()[-500:]}"
            log.debug("scoring attempt failed: %s", last_err)
            continue
        res = json.loads(out[i + len(marker):].strip().splitlines()[0])
        return _result(res, t0, label)
    return _error(f"no usable python3 in the image: {last_err}", "", t0, "")


def score(sandbox: Sandbox, final_tests: Path, *, timeout_s: float = 120.0) -> ScoreResult:
    """Score the episode: kill what the agent left, then run ``final_tests`` (reward 1.0 iff all pass)."""
    return run_tests(sandbox, final_tests, timeout_s=timeout_s, kill_first=True)


def run_initial_tests(sandbox: Sandbox, path: Path, *, timeout_s: float = 120.0) -> ScoreResult:
    """Run a task's initial-state tests in a fresh sandbox (they should all pass before any agent)."""
    return run_tests(sandbox, path, timeout_s=timeout_s, kill_first=True)


def _error(msg: str, tail: str, t0: float, interp: str) -> ScoreResult:
    return ScoreResult(status="error", reward=None, error=msg, output_tail=tail,
                       duration_s=time.monotonic() - t0, interpreter=interp)


def _result(res: dict, t0: float, interp: str) -> ScoreResult:
    tail = res.get("out") or ""
    killed = int(res.get("killed") or 0)
    if res.get("error"):
        r = _error(res["error"], tail, t0, interp)
        r.killed_processes = killed
        return r
    if res.get("timed_out"):
        r = _error("the tests did not finish within the verifier timeout", tail, t0, interp)
        r.killed_processes = killed
        return r
    if not res.get("junit"):
        r = _error(f"pytest wrote no JUnit report (exit {res.get('rc')})", tail, t0, interp)
        r.killed_processes = killed
        return r
    try:
        tests = parse_junit(res["junit"])
    except ET.ParseError as e:
        return _error(f"unreadable JUnit report: {e}", tail, t0, interp)
    passed = sum(t.outcome == "passed" for t in tests)
    counted = [t for t in tests if t.outcome != "skipped"]
    total = len(counted)
    all_ok = total > 0 and passed == total and res.get("rc") == 0
    return ScoreResult(
        status="ok",
        reward=1.0 if all_ok else 0.0,
        passed=passed,
        total=total,
        tests=tests,
        output_tail=tail,
        duration_s=time.monotonic() - t0,
        interpreter=interp,
        killed_processes=killed,
    )


def parse_junit(xml_text: str) -> list[TestOutcome]:
    """Per-test outcomes from pytest's JUnit XML (``testcase`` elements)."""
    root = ET.fromstring(xml_text)
    out: list[TestOutcome] = []
    for case in root.iter("testcase"):
        name = case.get("name", "?")
        cls = case.get("classname", "")
        full = f"{cls.rsplit('.', 1)[-1]}::{name}" if cls else name
        outcome: Literal["passed", "failed", "error", "skipped"] = "passed"
        message = None
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "failed" if child.tag == "failure" else child.tag  # type: ignore[assignment]
                message = (child.get("message") or "")[:500] or None
                break
        out.append(TestOutcome(name=full, outcome=outcome, message=message))
    return out
