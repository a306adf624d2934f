"""``et-hpc tasks check``: prove that each task is sound before it is used for training.

``check_task(task, store, settings) -> CheckResult`` runs the stages of ``STAGES`` in order and
stops at the first that fails: ``load`` (the task and its recipe), ``build`` (its image),
``start`` (a sandbox), ``initial`` (``test_initial_state.py`` passes, when present),
``untouched`` (``test_final_state.py`` FAILS in a fresh sandbox) and ``solution``
(``solution/solve.sh``, sent as the oracle policy sends it, makes the final tests pass; skipped
without one). ``check_tasks`` checks many in parallel; the CLI is ``et_hpc.cli.check``. Details:
docs/sandbox.md, "Checking tasks".
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from et_hpc.errors import InfraError, UserError
from et_hpc.sandbox.config import DEFAULT_OVERLAY_MB
from et_hpc.util import file_tail, tail_lines

log = logging.getLogger(__name__)

STAGES = ("load", "build", "start", "initial", "untouched", "solution")
StageStatus = Literal["ok", "failed", "skipped", "not_run"]
TAIL_LINES = 6
TRIVIAL = "trivially solved"
# pytest lines that say nothing about why: progress dots, section rules, the JUnit file notice
_PYTEST_NOISE = re.compile(r"^([.FEsxX]+\s*(\[\s*\d+%\])?|[-=_]{3,}(?!.* in [\d.]+s\b).*|.*generated xml file.*)$")


class CheckConfig(BaseModel):
    """What a check may tune."""

    build: bool = True  # False: only use images already in the cache
    retry_failed: bool = False  # build again images whose build failed before
    test_timeout_s: float = 120.0  # one pytest run (a task's verifier timeout wins when larger)
    solution_timeout_s: float = 600.0  # solution/solve.sh
    overlay_mb: int = DEFAULT_OVERLAY_MB  # writable layer of each sandbox (a task's storage limit wins)
    build_slots: int = 1  # image builds at once (each build is itself multi-threaded)


_NOT_RUN: StageStatus = "not_run"


class CheckResult(BaseModel):
    """The verdict on one task. ``stage`` is the failing stage (None when ok)."""

    task_id: str
    ok: bool
    stage: str | None = None
    detail: str = ""
    stages: dict[str, StageStatus] = Field(default_factory=lambda: dict.fromkeys(STAGES, _NOT_RUN))
    tail: list[str] = Field(default_factory=list)  # the last lines of the failing stage's output
    seconds: float = 0.0

    @property
    def trivially_solved(self) -> bool:
        return self.stage == "untouched" and self.detail.startswith(TRIVIAL)


class _Failed(Exception):
    """A stage failed: ``detail`` is one line, ``tail`` the last lines of its output."""

    def __init__(self, detail: str, tail: list[str] | None = None):
        super().__init__(detail)
        self.detail = " ".join(detail.split())
        self.tail = tail or []


def _pytest_tail(text: str | None, n: int = TAIL_LINES) -> list[str]:
    """The assertion lines (``E   ...``) of a pytest run and its closing line, else its last lines."""
    lines = tail_lines(text, drop=lambda ln: bool(_PYTEST_NOISE.match(ln.strip())))
    errs = [ln for ln in lines if ln.startswith("E ")]
    if not errs:
        return [ln[:200] for ln in lines[-n:]]
    return [ln[:200] for ln in errs[: n - 1] + lines[-1:]]


def _failed_at(record: Path) -> float:
    """When the failure record of a build was written (infinity when there is none)."""
    try:
        return float(json.loads(record.read_text()).get("failed_at_epoch", 0))
    except (OSError, ValueError, AttributeError):
        return float("inf")


def _failing_tests(sc: Any) -> str:
    bad = [t for t in sc.tests if t.outcome in ("failed", "error")]
    names = ", ".join(t.name for t in bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
    first = next((t.message for t in bad if t.message), None)
    out = f"{len(bad)} of {sc.total} failed: {names}" if bad else f"{sc.passed} of {sc.total} passed"
    if first:
        out += f" ({first.splitlines()[0][:150]})"
    return out


class _Checker:
    """Runs the stages of one task; ``stages`` and the result fields are filled as it goes."""

    def __init__(self, task: Any, store: Any, settings: CheckConfig, build_gate: threading.Semaphore):
        self.task, self.store, self.s, self.build_gate = task, store, settings, build_gate
        self.res = CheckResult(task_id=task.id, ok=False)
        self.image: Any = None
        self.current = "load"

    def run(self) -> CheckResult:
        t0 = time.monotonic()
        steps: list[tuple[str, Callable[[], StageStatus]]] = [
            ("load", self.load),
            ("build", self.build),
            ("start", self.start_and_initial),
            ("untouched", self.untouched),
            ("solution", self.solution),
        ]
        try:
            for name, fn in steps:
                self.current = name
                status = fn()
                if name != "start":  # start_and_initial records both of its stages itself
                    self.res.stages[name] = status
        except _Failed as e:
            self._fail(self.current, e.detail, e.tail)
        except Exception as e:  # noqa: BLE001 - one broken task must not stop the others
            log.exception("checking %s", self.task.id)
            self._fail(self.current, f"{type(e).__name__}: {e}", [])
        else:
            self.res.ok = True
        self.res.seconds = round(time.monotonic() - t0, 2)
        return self.res

    def _fail(self, stage: str, detail: str, tail: list[str]) -> None:
        self.res.stages[stage] = "failed"
        self.res.stage, self.res.detail, self.res.tail = stage, detail, tail

    # -- stages ----------------------------------------------------------------------------
    def load(self) -> StageStatus:
        if self.task.final_tests is None:
            raise _Failed(f"{self.task.source}: no test_final_state.py; add the final-state tests")
        try:
            self.store.normalised(self.task)
        except UserError as e:
            raise _Failed(str(e)) from None
        return "ok"

    def build(self) -> StageStatus:
        started = time.time()
        with self.build_gate:
            r = self.store.ensure(self.task, retry_failed=self.s.retry_failed, build=self.s.build)
        if r.status in ("built", "cached") and r.path is not None:
            self.image = r
            return "ok"
        if r.status == "missing":
            raise _Failed("image not built (--no-build); run 'et-hpc build' first or drop --no-build")
        before = r.key is not None and _failed_at(self.store.failed_path(r.key)) < started
        again = " (failed in an earlier build; --retry-failed builds it again)" if before else ""
        log_note = f"; log: {r.log_path}" if r.log_path and Path(r.log_path).exists() else ""
        raise _Failed(f"{r.reason or 'build failed'}{again}{log_note}", file_tail(r.log_path, TAIL_LINES, width=200))

    def _sandbox(self) -> Any:
        from et_hpc.sandbox.sandbox import Sandbox

        mb = self.task.limits.storage_mb or self.s.overlay_mb
        return Sandbox(self.image.path, run_prefix="et-check", overlay_mb=max(mb, 64), network_none=True)

    def _timeout(self) -> float:
        v = self.task.limits.verifier_timeout_s
        return max(self.s.test_timeout_s, v or 0)

    def _started(self) -> Any:
        box = self._sandbox()
        try:
            box.start()
        except (InfraError, OSError) as e:
            raise _Failed(f"sandbox did not start: {e}") from None
        return box

    def start_and_initial(self) -> StageStatus:
        from et_hpc.scoring.live import run_initial_tests

        box = self._started()
        try:
            self.res.stages["start"] = "ok"
            self.current = "initial"
            if self.task.initial_tests is None:
                self.res.stages["initial"] = "skipped"
                return "ok"
            box.prepare()  # a fresh image, no agent: what an episode's first shell does
            sc = run_initial_tests(box, self.task.initial_tests, timeout_s=self._timeout())
        finally:
            box.stop()
        if sc.status != "ok":
            raise _Failed(f"test_initial_state.py could not run: {sc.error}", _pytest_tail(sc.output_tail))
        if sc.reward != 1.0:
            raise _Failed(f"test_initial_state.py fails on the fresh image: {_failing_tests(sc)}", _pytest_tail(sc.output_tail))
        self.res.stages["initial"] = "ok"
        return "ok"

    def untouched(self) -> StageStatus:
        from et_hpc.scoring.live import score

        box = self._started()
        try:
            box.prepare()  # a fresh image, no agent: what an episode's first shell does
            sc = score(box, self.task.final_tests, timeout_s=self._timeout())
        finally:
            box.stop()
        if sc.status != "ok":
            raise _Failed(f"test_final_state.py could not run: {sc.error}", _pytest_tail(sc.output_tail))
        if sc.reward == 1.0:
            raise _Failed(
                f"{TRIVIAL}: test_final_state.py passes on the untouched state "
                f"({sc.passed} of {sc.total} tests); the image already holds the answer",
                _pytest_tail(sc.output_tail),
            )
        return "ok"

    def solution(self) -> StageStatus:
        from et_hpc.agent.policies import OraclePolicy
        from et_hpc.scoring.live import score

        if self.task.solution is None:
            return "skipped"
        command = OraclePolicy(self.task, timeout_s=self.s.solution_timeout_s).command()
        box = self._started()
        try:
            shell = box.shell()
            out = shell.run(command, timeout=self.s.solution_timeout_s)
            sc = score(box, self.task.final_tests, timeout_s=self._timeout())
        finally:
            box.stop()
        ran = "timed out" if out.timed_out else f"exit {out.exit_code}"
        if sc.status != "ok":
            raise _Failed(f"after solve.sh ({ran}) the final tests could not run: {sc.error}", _pytest_tail(sc.output_tail))
        if sc.reward != 1.0:
            tail = [f"solve.sh: {ln}" for ln in tail_lines(out.output, 3, width=200)] + _pytest_tail(sc.output_tail, TAIL_LINES - 2)
            raise _Failed(f"solution/solve.sh ({ran}) does not solve the task: {_failing_tests(sc)}", tail)
        return "ok"


def check_task(task: Any, store: Any, settings: CheckConfig | None = None, build_gate: threading.Semaphore | None = None) -> CheckResult:
    """Check one task through every stage (see the module docstring); never raises."""
    return _Checker(task, store, settings or CheckConfig(), build_gate or threading.Semaphore(1)).run()


def load_failure(task_id: str, detail: str) -> CheckResult:
    """The result for a task that did not even load."""
    r = CheckResult(task_id=task_id, ok=False, stage="load", detail=" ".join(detail.split()))
    r.stages["load"] = "failed"
    return r


def check_tasks(
    tasks: list[Any],
    store: Any,
    settings: CheckConfig | None = None,
    *,
    jobs: int | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
) -> list[CheckResult]:
    """``check_task`` for many tasks, ``jobs`` at a time; results in input order."""
    settings = settings or CheckConfig()
    gate = threading.Semaphore(max(1, settings.build_slots))
    results: list[CheckResult | None] = [None] * len(tasks)

    def one(i: int) -> None:
        results[i] = r = check_task(tasks[i], store, settings, gate)
        if on_result is not None:
            on_result(r)

    with ThreadPoolExecutor(max_workers=max(1, jobs or default_jobs())) as ex:
        list(ex.map(one, range(len(tasks))))
    return [r for r in results if r is not None]


def default_jobs() -> int:
    """Tasks checked at once: one per core (checks mostly wait on apptainer subprocesses)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, n)
