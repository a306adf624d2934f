"""Scoring: run a task's pytest file in the episode's instance, entered through nothing the agent wrote.

``score(sandbox, final_tests)`` starts ``et_hpc.sandbox.enter`` on the host: our own Python joins
the instance's namespaces (user first: we own it), takes a private copy of its mounts, kills every
process left in it, writes the test file to a fresh tmpfs on the pristine read-only image tree
(``/.et-pristine``, the SIF bound at start) and runs pytest with that tree's own dynamic loader and
Python (``-I -S -B``, no conftest, no plugin autoload, an empty ini, a clean environment, cwd
``/home/user`` when the agent's uid can use it, else ``/``), under scoring rlimits and without
capabilities. Nothing of the instance's writable layer is run before the tests: not apptainer's
``/.singularity.d`` actions and env scripts, not ``/bin/sh``, not rc files, not the writable
``python3``, pytest, libc, ``ld.so.preload`` or NSS modules (see that module's doc for each step).
There is no fallback to the instance's own ``python3``.

Who is to blame decides the result (SECURITY.md has the table):

- the tests ran and pytest wrote its report: ``ok``, reward 1.0 iff every test passed (at least one);
- the state the agent left stops the tests (they exceed the verifier timeout, pytest dies without
  a report, a symlinked ``/etc/ld.so.preload``, the instance ended from inside): ``ok``, reward
  0.0, ``note`` says what happened;
- anything outside the agent's reach (apptainer or /proc failing on the host, the pristine tree
  or its pytest missing, our bugs): ``error``, reward ``None``.

``interpreter`` names what ran the tests: ``"pristine"`` or ``"none"`` (nothing ran).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import secrets
import subprocess
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field

from et_hpc.errors import InfraError
from et_hpc.record import TestOutcomeName, TestResult
from et_hpc.sandbox import enter

if TYPE_CHECKING:
    from et_hpc.sandbox.sandbox import Sandbox

log = logging.getLogger(__name__)

PRISTINE = "/.et-pristine"
CLEAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_LOADERS = {
    "x86_64": ("x86_64-linux-gnu", "ld-linux-x86-64.so.2"),
    "aarch64": ("aarch64-linux-gnu", "ld-linux-aarch64.so.1"),
}
# Scoring rlimits when the sandbox does not set its own (``vmem_mb``, ``nproc``, ``fsize_mb``).
DEFAULT_LIMITS = {"vmem_mb": 8192, "nproc": 512, "fsize_mb": 4096}
GONE_NOTE = ("the instance ended before scoring (its init exited while the sandbox was live; "
             "an agent can do this from inside, e.g. kill -TERM 1)")


class TestOutcome(TestResult):
    message: str | None = None


class ScoreResult(BaseModel):
    status: Literal["ok", "error"]
    reward: float | None
    passed: int = 0
    total: int = 0
    tests: list[TestOutcome] = Field(default_factory=list)
    error: str | None = None
    note: str | None = None  # status ok, reward 0 by the agent's doing: what happened
    notes: list[str] = Field(default_factory=list)  # what scoring saw or changed (events)
    output_tail: str = ""
    duration_s: float = 0.0
    interpreter: str = "none"  # "pristine" (the image's read-only copy) or "none" (nothing ran)
    killed_processes: int = 0
    # seconds from the start of scoring at which each stage ended (host, helper, driver, pytest);
    # for benchmarks and telemetry, never part of a record
    stages: dict[str, float] = Field(default_factory=dict, exclude=True)


def pristine_layout(pristine: str = PRISTINE) -> tuple[str, list[str]]:
    """(the pristine dynamic loader, its library dirs) for this machine's architecture."""
    arch, ld = _LOADERS.get(platform.machine(), _LOADERS["x86_64"])
    libdirs = [f"{pristine}/usr/lib/{arch}", f"{pristine}/lib/{arch}", f"{pristine}/usr/lib64",
               f"{pristine}/usr/lib", f"{pristine}/lib"]
    return f"{pristine}/usr/lib/{arch}/{ld}", libdirs


def scoring_limits(sandbox: Sandbox, timeout_s: float) -> dict[str, int]:
    """The rlimits of the test run: the sandbox's where it sets them, CPU time from the timeout."""
    lim = dict(DEFAULT_LIMITS)
    for k in lim:
        v = getattr(sandbox, k, None)
        if v:
            lim[k] = int(v)
    lim["cpu_s"] = int(timeout_s) + 30
    return lim


def run_tests(
    sandbox: Sandbox,
    tests: Path,
    *,
    timeout_s: float = 120.0,
    kill_first: bool = True,
    tail_chars: int = 4000,
) -> ScoreResult:
    """Run one pytest file in the instance (see the module doc) and turn it into a ScoreResult.

    ``kill_first`` is kept for callers; the entry always kills what is left in the instance.
    """
    t0 = time.monotonic()
    tests = Path(tests)
    try:
        source = tests.read_text(encoding="utf-8")
    except OSError as e:
        return ScoreResult(status="error", reward=None, error=f"cannot read {tests}: {e}")
    host: dict[str, float] = {}
    if not sandbox.pristine_bound:
        sandbox.close_shells()
        return _error("the image's pristine copy is not bound at /.et-pristine (apptainer could not "
                      "find its root partition), so no untouched interpreter exists", "", t0)
    try:
        sandbox.prepare()  # a no-op once the agent's first shell did it
        pid, start = sandbox.init_process()
    except InfraError as e:
        sandbox.close_shells()
        return _gone_or_error(sandbox, f"could not reach the instance: {e}", t0)
    host["instance_found"] = time.monotonic()
    # Ended if it still runs (waiting for it would read the same files twice when the agent was
    # quick); whatever it read stays in the page cache
    sandbox.stop_warmup()
    marker = "ET-SCORE-" + secrets.token_hex(12) + ":"
    loader, libdirs = pristine_layout()
    cfg = {
        "pid": pid, "starttime": start, "marker": marker, "pristine": PRISTINE, "loader": loader,
        "libdirs": libdirs, "source": source,
        "name": tests.name if tests.name.startswith("test_") else "test_" + tests.name,
        "home": sandbox.home, "path": CLEAN_PATH, "timeout": timeout_s, "tail": tail_chars,
        "limits": scoring_limits(sandbox, timeout_s),
    }
    argv = enter.helper_argv()
    host["config"] = time.monotonic()
    cfg_r, cfg_w = os.pipe()  # the config goes through a pipe only we hold
    try:
        proc = subprocess.Popen(argv, stdin=cfg_r, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, close_fds=True, env={})
    except OSError as e:
        os.close(cfg_w)
        sandbox.close_shells()
        return _error(f"could not start the scoring helper: {e}", "", t0)
    finally:
        os.close(cfg_r)
    host["helper_spawned"] = time.monotonic()
    _feed(cfg_w, json.dumps(cfg).encode())
    # The shells are closed while the helper starts up: its kill sweep, after it entered the
    # instance, ends whatever they left either way.
    sandbox.close_shells()
    host["shells_closed"] = time.monotonic()
    try:
        out, err = proc.communicate(timeout=timeout_s + 120)
    except subprocess.TimeoutExpired:
        from et_hpc.sandbox.shell import kill_session

        kill_session(proc.pid)
        proc.kill()
        proc.communicate()
        return _error("the scoring helper did not finish", "", t0)
    text = out.decode("utf-8", "replace")
    i = text.rfind(marker)
    if i < 0:
        return _error(f"the scoring helper failed (exit {proc.returncode}): "
                      f"{(text + err.decode('utf-8', 'replace')).strip()[-500:]}", "", t0)
    res = json.loads(text[i + len(marker):].strip().splitlines()[0])
    host["helper_done"] = time.monotonic()
    if res.get("kind") == "infra" and res.get("stage") == "enter" and "is gone" in (res.get("error") or ""):
        return _gone_or_error(sandbox, res["error"], t0)
    r = _result(res, t0, timeout_s=timeout_s)
    r.stages = _stages(t0, {**(res.get("stages") or {}), **host, "result": time.monotonic()})
    return r


def _stages(t0: float, marks: dict) -> dict[str, float]:
    """Stage marks (``time.monotonic()`` of this host, which the helper shares) as seconds from t0."""
    out = {}
    for k, v in marks.items():
        try:
            out[str(k)] = round(float(v) - t0, 4)
        except (TypeError, ValueError):
            continue
    return dict(sorted(out.items(), key=lambda kv: kv[1]))


def start_warmup(sandbox: Sandbox, timeout_s: float = 120.0) -> subprocess.Popen | None:
    """Load the image's pristine python and pytest once in the background, once the agent's first
    shell started (``Sandbox.shell``), so the final tests find them in the page cache of its pristine mount (a
    fresh squashfuse mount per instance: read cold, they are most of the time scoring takes).

    The entry helper in warm-up mode (``et_hpc.sandbox.enter``) joins the instance as scoring does
    but kills nothing, and runs the pristine interpreter as the agent's uid, without capabilities,
    niced, importing only pytest and its plugins (never a task's file), output to /dev/null; only
    its exit status is read, so nothing the agent does to it can reach a score. Scoring ends it
    first if it still runs (``Sandbox.stop_warmup``). Returns the helper (``Sandbox.stop`` reaps it), or None
    when there is no pristine tree.
    """
    if not sandbox.pristine_bound:
        return None
    pid, start = sandbox.init_process()
    loader, libdirs = pristine_layout()
    cfg = {"mode": "warm", "pid": pid, "starttime": start, "marker": "ET-WARM-" + secrets.token_hex(12) + ":",
           "pristine": PRISTINE, "loader": loader, "libdirs": libdirs, "path": CLEAN_PATH,
           "timeout": timeout_s, "limits": scoring_limits(sandbox, timeout_s)}
    cfg_r, cfg_w = os.pipe()
    try:
        proc = subprocess.Popen(enter.helper_argv(), stdin=cfg_r, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True, env={})
    except OSError:
        os.close(cfg_w)
        raise
    finally:
        os.close(cfg_r)
    _feed(cfg_w, json.dumps(cfg).encode())
    return proc


def _feed(fd: int, payload: bytes) -> None:
    """Write the config to the helper's stdin and close it (a helper that died early is seen later:
    it prints no result). It reads all of it before anything else, so a large config cannot block."""
    try:
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view):]
    except OSError:
        pass
    finally:
        os.close(fd)


def score(sandbox: Sandbox, final_tests: Path, *, timeout_s: float = 120.0) -> ScoreResult:
    """Score the episode: kill what the agent left, then run ``final_tests`` (reward 1.0 iff all pass)."""
    return run_tests(sandbox, final_tests, timeout_s=timeout_s, kill_first=True)


def run_initial_tests(sandbox: Sandbox, path: Path, *, timeout_s: float = 120.0) -> ScoreResult:
    """Run a task's initial-state tests in a fresh sandbox (they should all pass before any agent)."""
    return run_tests(sandbox, path, timeout_s=timeout_s, kill_first=True)


def _error(msg: str, tail: str, t0: float, interp: str = "none") -> ScoreResult:
    return ScoreResult(status="error", reward=None, error=msg, output_tail=tail,
                       duration_s=time.monotonic() - t0, interpreter=interp)


def _agent(note: str, tail: str, t0: float, interp: str = "none", **kw) -> ScoreResult:
    return ScoreResult(status="ok", reward=0.0, note=note, output_tail=tail,
                       duration_s=time.monotonic() - t0, interpreter=interp, **kw)


def _gone_or_error(sandbox: Sandbox, msg: str, t0: float) -> ScoreResult:
    """The instance could not be entered: the agent's doing if it ended by itself, else infra."""
    health = sandbox.health()
    if health == "gone":
        return _agent(GONE_NOTE, "", t0)
    return _error(f"{msg} (instance {health})", "", t0)


def _result(res: dict, t0: float, interp: str = "pristine", *, timeout_s: float | None = None) -> ScoreResult:
    tail = res.get("out") or ""
    killed = int(res.get("killed") or 0)
    notes = list(res.get("notes") or [])
    kind = res.get("kind", "ran")
    if kind == "infra":
        return _error(res.get("error") or "scoring failed", tail, t0,
                      "pristine" if res.get("stage") == "tests" else "none")
    if kind == "agent":
        return _agent(res.get("error") or "the state left cannot be scored", tail, t0,
                      "pristine" if res.get("stage") == "tests" else "none", notes=notes, killed_processes=killed)
    common = {"notes": notes, "killed_processes": killed, "output_tail": tail, "interpreter": interp}
    if res.get("timed_out"):
        what = f" ({timeout_s:g} s)" if timeout_s is not None else ""
        return _agent(f"tests exceeded the verifier timeout{what}", tail, t0, interp,
                      notes=notes, killed_processes=killed)
    if not res.get("junit"):
        how = f"signal {res['signal']}" if res.get("signal") else f"exit {res.get('rc')}"
        return _agent(_with_notes(f"pytest ended ({how}) without writing its report", notes), tail, t0,
                      interp, notes=notes, killed_processes=killed)
    try:
        tests = parse_junit(res["junit"])
    except ET.ParseError as e:
        return _agent(_with_notes(f"pytest's report is unreadable ({e})", notes), tail, t0, interp,
                      notes=notes, killed_processes=killed)
    passed = sum(t.outcome == "passed" for t in tests)
    counted = [t for t in tests if t.outcome != "skipped"]
    total = len(counted)
    all_ok = total > 0 and passed == total and res.get("rc") == 0
    note = None
    if not all_ok and notes:
        note = "; ".join(notes)
    elif not all_ok and total == 0:
        note = f"pytest collected no test (exit {res.get('rc')})"
    return ScoreResult(
        status="ok",
        reward=1.0 if all_ok else 0.0,
        passed=passed,
        total=total,
        tests=tests,
        note=note,
        duration_s=time.monotonic() - t0,
        **common,
    )


def _with_notes(msg: str, notes: list[str]) -> str:
    return "; ".join([msg, *notes])


def parse_junit(xml_text: str) -> list[TestOutcome]:
    """Per-test outcomes from pytest's JUnit XML (``testcase`` elements)."""
    root = ET.fromstring(xml_text)
    out: list[TestOutcome] = []
    for case in root.iter("testcase"):
        name = case.get("name", "?")
        cls = case.get("classname", "")
        full = f"{cls.rsplit('.', 1)[-1]}::{name}" if cls else name
        outcome: TestOutcomeName = "passed"
        message = None
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "failed" if child.tag == "failure" else child.tag  # type: ignore[assignment]
                message = (child.get("message") or "")[:500] or None
                break
        out.append(TestOutcome(name=full, outcome=outcome, message=message))
    return out
