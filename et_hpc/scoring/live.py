"""Scoring: run a task's pytest file in the episode's instance, entered through nothing the agent wrote.

``score(sandbox, final_tests)`` ends the agent from the host, then runs pytest through
``et_hpc.scoring.enter`` with the pristine image's own loader and Python, under scoring rlimits and
without capabilities: nothing of the agent's writable layer runs before the tests or decides how
they start, and there is no fallback to the instance's ``python3``. One table, ``BLAME`` (read by
``blame(Facts)``), decides the result: any state the agent can leave is ``ok`` (reward 1.0 iff
every test passed, at least one, else 0.0 with a ``note``); only what is outside the agent's
reach is ``error``, reward ``None``. ``interpreter`` names what ran the tests (``"pristine"`` or
``"none"``). Specification: docs/scoring.md; guarantees: SECURITY.md.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import secrets
import signal
import subprocess
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field

from et_hpc.errors import InfraError
from et_hpc.record import TestOutcomeName, TestResult
from et_hpc.scoring import helper_pool

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
GONE_NOTE = (
    "the instance ended after the agent's last turn (its init exited while the sandbox was "
    "live; an agent can do this from inside, e.g. kill -TERM 1)"
)


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


def score_fields(sc: ScoreResult | None, status: str) -> dict:
    """The record fields a score gives (``EpisodeRecord``), the same for an episode and a rescore:
    the reward and note only when the record's status is ``ok`` (the score that counts)."""
    counts = sc is not None and status == "ok"
    return {
        "reward": sc.reward if counts and sc is not None else None,
        "passed": sc.passed if sc is not None else None,
        "total": sc.total if sc is not None else None,
        "tests": [TestResult(name=t.name, outcome=t.outcome) for t in (sc.tests if sc is not None else [])],
        "score_note": sc.note if counts and sc is not None else None,
        "interpreter": sc.interpreter if sc is not None else None,
    }


def pristine_layout(pristine: str = PRISTINE) -> tuple[str, list[str]]:
    """(the pristine dynamic loader, its library dirs) for this machine's architecture."""
    arch, ld = _LOADERS.get(platform.machine(), _LOADERS["x86_64"])
    libdirs = [f"{pristine}/usr/lib/{arch}", f"{pristine}/lib/{arch}", f"{pristine}/usr/lib64", f"{pristine}/usr/lib", f"{pristine}/lib"]
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
    tail_chars: int = 4000,
) -> ScoreResult:
    """Run one pytest file in the instance (see the module doc) and turn it into a ScoreResult;
    every process of the agent's is ended first."""
    t0 = time.monotonic()
    tests = Path(tests)
    try:
        source = tests.read_text(encoding="utf-8")
    except OSError as e:
        return ScoreResult(status="error", reward=None, error=f"cannot read {tests}: {e}")
    host: dict[str, float] = {}
    if not sandbox.pristine_bound:
        sandbox.close_shells()
        return _error(
            "the image's pristine copy is not bound at /.et-pristine (apptainer could not "
            "find its root partition), so no untouched interpreter exists",
            "",
            t0,
        )
    try:  # no prepare, no shell, no exec: nothing of the instance runs by name (SECURITY.md)
        pid, start = sandbox.init_process()
    except InfraError as e:
        sandbox.close_shells()
        return _decide(sandbox, Facts("infra"), {"error": f"could not reach the instance: {e}"}, t0)
    host["instance_found"] = time.monotonic()
    # Nothing of ours enters the instance before every process of the agent's is stopped and
    # killed from the host, and only then are its shells closed (Sandbox.end_agent)
    swept = sandbox.end_agent()
    host["swept"] = time.monotonic()
    if swept.init_gone:
        return _decide(sandbox, Facts("infra"), {"error": "the instance's init ended before scoring"}, t0)
    if swept.left:
        return _decide(
            sandbox, Facts("swept_left"), {"error": f"{swept.left} process(es) of the instance could not be killed from the host"}, t0
        )
    marker = "ET-SCORE-" + secrets.token_hex(12) + ":"
    loader, libdirs = pristine_layout()
    cfg = {
        "pid": pid,
        "starttime": start,
        "marker": marker,
        "pristine": PRISTINE,
        "loader": loader,
        "libdirs": libdirs,
        "source": source,
        "name": tests.name if tests.name.startswith("test_") else "test_" + tests.name,
        "home": sandbox.home,
        "path": CLEAN_PATH,
        "timeout": timeout_s,
        "tail": tail_chars,
        "limits": scoring_limits(sandbox, timeout_s),
        # a kept state or a sandbox whose first shell never ran: the driver names the account
        "accounts": not getattr(sandbox, "prepared", True),
    }
    host["config"] = time.monotonic()
    try:
        helper = helper_pool.take()  # started beforehand, while the last episode was scored
    except OSError as e:
        return _error(f"could not start the scoring helper: {e}", "", t0)
    proc = helper.proc
    host["helper_spawned"] = time.monotonic()
    helper.feed(json.dumps(cfg).encode())
    try:
        out, err = proc.communicate(timeout=timeout_s + 120)
    except subprocess.TimeoutExpired:
        try:  # the helper leads a session of its own (helper_pool.spawn): all of it goes
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
        proc.communicate()
        return _decide(sandbox, Facts("infra"), {"error": "the scoring helper did not finish"}, t0)
    text = out.decode("utf-8", "replace")
    i = text.rfind(marker)
    if i < 0:  # the helper itself (a host process outside the instance's reach) failed
        return _decide(
            sandbox,
            Facts("infra"),
            {"error": f"the scoring helper failed (exit {proc.returncode}): {(text + err.decode('utf-8', 'replace')).strip()[-500:]}"},
            t0,
        )
    res = json.loads(text[i + len(marker) :].strip().splitlines()[0])
    res["killed"] = swept.killed
    host["helper_done"] = time.monotonic()
    r = _decide(sandbox, facts_of(res), res, t0, timeout_s=timeout_s)
    r.stages = _stages(t0, {**(res.get("stages") or {}), **host, "result": time.monotonic()})
    return r


# -- who is to blame: one table ----------------------------------------------------------------


@dataclass(frozen=True)
class Facts:
    """What scoring observed, as the blame table reads it.

    ``outcome``: how the helper ended: ``ran`` (pytest ran to its end or to the timeout),
    ``agent`` (the state left could not be mapped for the tests), ``survivors`` (a process of the
    instance was found after the host's sweep), ``swept_left`` (the host's sweep could not end them),
    ``disturbed`` (the driver died, failed or hung after the tests started: programs they run can
    signal or prlimit it), ``interp`` (the tests' interpreter did not start), ``infra`` (anything
    else: the host, apptainer, /proc, the pristine tree, our bugs).
    ``instance``: ``Sandbox.health()`` after a failure (``alive``, ``gone``, ``stopped``, ``host: ...``).
    ``control``: for ``interp``, whether the same interpreter started in the pristine tree alone.
    ``report``: for ``ran``, pytest's JUnit report: ``parsed``, ``none`` or ``unreadable``.
    """

    outcome: str
    instance: str = "alive"
    control: bool = False
    timed_out: bool = False
    report: str = "parsed"


@dataclass(frozen=True)
class Row:
    name: str
    when: Callable[[Facts], bool]
    status: str  # "ok" or "error"
    reward: float | None  # None with "ok": the tests' verdict decides
    note: str  # "{error}" is the helper's message
    agent: bool  # whether a state the agent can leave can produce this row


BLAME: tuple[Row, ...] = (
    Row("instance_ended", lambda f: f.instance == "gone", "ok", 0.0, GONE_NOTE, True),
    Row("stopped_by_us", lambda f: f.instance == "stopped", "error", None, "the sandbox was stopped while scoring ({error})", False),
    Row("host_failed", lambda f: f.instance.startswith("host"), "error", None, "{error} ({instance})", False),
    Row("unkillable", lambda f: f.outcome == "swept_left", "ok", 0.0, "{error}", True),
    Row("survivors", lambda f: f.outcome == "survivors", "ok", 0.0, "{error}", True),
    Row("state_unmappable", lambda f: f.outcome == "agent", "ok", 0.0, "{error}", True),
    Row(
        "driver_disturbed",
        lambda f: f.outcome == "disturbed",
        "ok",
        0.0,
        "the scoring driver was disturbed while the tests ran: {error}",
        True,
    ),
    Row(
        "interpreter_by_state",
        lambda f: f.outcome == "interp" and f.control,
        "ok",
        0.0,
        "the tests' interpreter could not start in the state left ({error})",
        True,
    ),
    Row("interpreter_by_image", lambda f: f.outcome == "interp", "error", None, "{error} (the same in the pristine image alone)", False),
    Row("timeout", lambda f: f.outcome == "ran" and f.timed_out, "ok", 0.0, "tests exceeded the verifier timeout{timeout}", True),
    Row(
        "no_report", lambda f: f.outcome == "ran" and f.report == "none", "ok", 0.0, "pytest ended ({how}) without writing its report", True
    ),
    Row(
        "bad_report", lambda f: f.outcome == "ran" and f.report == "unreadable", "ok", 0.0, "pytest's report is unreadable ({error})", True
    ),
    Row("tests", lambda f: f.outcome == "ran", "ok", None, "", True),
    # the instance alive, nothing of the agent's running (the host swept it) and its state only
    # listed and bound (errors there are state_unmappable): the host, apptainer, the image, us
    Row("infra", lambda f: True, "error", None, "{error}", False),
)


def blame(facts: Facts) -> Row:
    """The first row of ``BLAME`` whose condition holds (the last row always does)."""
    return next(r for r in BLAME if r.when(facts))


def facts_of(res: dict) -> Facts:
    """The blame table's view of the helper's result (``et_hpc.scoring.enter``)."""
    kind = res.get("kind", "ran")
    if kind == "agent":
        return Facts("survivors" if res.get("stage") == "survivors" else "agent")
    if kind == "interp":
        return Facts("interp", control=bool(res.get("control")))
    if kind in ("disturbed", "infra"):
        return Facts(kind)
    report = "none"
    if res.get("junit"):
        try:
            parse_junit(res["junit"])
            report = "parsed"
        except ET.ParseError:
            report = "unreadable"
    return Facts("ran", timed_out=bool(res.get("timed_out")), report=report)


ENDING_GRACE_S = 2.0  # apptainer's init exits about 0.1 s after SIGTERM, killing the rest first


def _health(sandbox: Sandbox, facts: Facts) -> str:
    """``Sandbox.health()``; when the driver or the entry failed while init still runs, init may be
    ending (a SIGTERM to it kills the instance's processes before init exits): it gets a moment."""
    health = sandbox.health()
    if health == "alive" and facts.outcome in ("disturbed", "infra"):
        deadline = time.monotonic() + ENDING_GRACE_S
        while health == "alive" and time.monotonic() < deadline:
            time.sleep(0.05)
            health = sandbox.health()
    return health


def _decide(sandbox: Sandbox | None, facts: Facts, res: dict, t0: float, *, timeout_s: float | None = None) -> ScoreResult:
    """The result the blame table gives for ``facts``; the instance's health is read (from the
    host) whenever the tests did not run to a report."""
    if sandbox is not None and not (facts.outcome == "ran" and facts.report == "parsed" and not facts.timed_out):
        facts = replace(facts, instance=_health(sandbox, facts))
    row = blame(facts)
    tail = res.get("out") or ""
    notes = list(res.get("notes") or [])
    interp = "pristine" if facts.outcome in ("ran", "disturbed") else "none"
    if row.name == "tests":
        return _verdict(res, t0, notes, tail, interp)
    how = f"signal {res['signal']}" if res.get("signal") else f"exit {res.get('rc')}"
    error = res.get("error") or ""
    if row.name == "bad_report":
        try:
            parse_junit(res.get("junit") or "")
        except ET.ParseError as e:
            error = str(e)
    note = row.note.format(error=error, instance=facts.instance, how=how, timeout=f" ({timeout_s:g} s)" if timeout_s is not None else "")
    if row.status == "error":
        return _error(note, tail, t0, interp)
    if row.name in ("no_report", "bad_report"):
        note = _with_notes(note, notes)
    return _agent(note, tail, t0, interp, notes=notes, killed_processes=int(res.get("killed") or 0))


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

    The entry helper in warm-up mode (``et_hpc.scoring.enter``) joins the instance as scoring does
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
    cfg = {
        "mode": "warm",
        "pid": pid,
        "starttime": start,
        "marker": "ET-WARM-" + secrets.token_hex(12) + ":",
        "pristine": PRISTINE,
        "loader": loader,
        "libdirs": libdirs,
        "path": CLEAN_PATH,
        "timeout": timeout_s,
        "limits": scoring_limits(sandbox, timeout_s),
    }
    helper = helper_pool.spawn(stdout=subprocess.DEVNULL)
    helper.feed(json.dumps(cfg).encode())
    proc = helper.proc
    return proc


def score(sandbox: Sandbox, final_tests: Path, *, timeout_s: float = 120.0) -> ScoreResult:
    """Score the episode: kill what the agent left, then run ``final_tests`` (reward 1.0 iff all pass)."""
    return run_tests(sandbox, final_tests, timeout_s=timeout_s)


def run_initial_tests(sandbox: Sandbox, path: Path, *, timeout_s: float = 120.0) -> ScoreResult:
    """Run a task's initial-state tests in a fresh sandbox (they should all pass before any agent)."""
    return run_tests(sandbox, path, timeout_s=timeout_s)


def _error(msg: str, tail: str, t0: float, interp: str = "none") -> ScoreResult:
    return ScoreResult(status="error", reward=None, error=msg, output_tail=tail, duration_s=time.monotonic() - t0, interpreter=interp)


def _agent(note: str, tail: str, t0: float, interp: str = "none", **kw) -> ScoreResult:
    return ScoreResult(status="ok", reward=0.0, note=note, output_tail=tail, duration_s=time.monotonic() - t0, interpreter=interp, **kw)


def _result(res: dict, t0: float, interp: str = "pristine", *, timeout_s: float | None = None) -> ScoreResult:
    """A helper result (or one of the same shape) through the blame table, without a sandbox."""
    return _decide(None, facts_of(res), res, t0, timeout_s=timeout_s)


def _verdict(res: dict, t0: float, notes: list[str], tail: str, interp: str) -> ScoreResult:
    """Pytest wrote its report: reward 1.0 iff every test passed (at least one) and pytest exited 0."""
    tests = parse_junit(res["junit"])
    passed = sum(t.outcome == "passed" for t in tests)
    total = sum(t.outcome != "skipped" for t in tests)
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
        notes=notes,
        killed_processes=int(res.get("killed") or 0),
        output_tail=tail,
        interpreter=interp,
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
