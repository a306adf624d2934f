"""Replay agreement: replay every recorded run of the native fixtures and compare with its success.

Each task's recorded runs (its first ``solutions/*_summary.json``) are replayed through real
sandboxes with ``et-hpc run SOURCE --policy replay --samples N`` (sample i replays run i), one run
per task in the same store, so rerunning resumes. Our reward (1.0 iff every final test passes) is
then compared with the recorded ``success``, and ``bench/REPLAY.md`` gets the per-task table,
the overall agreement and, for every disagreement, the evidence: which final tests failed, the
recorded test output, and the first turn where our observation differs from the recorded one.

    python bench/replay_agreement.py                       # all native fixtures, writes bench/REPLAY.md
    python bench/replay_agreement.py --tasks task_000000_9cc1e5be --out /tmp/r.md
    python bench/replay_agreement.py --report-only         # rebuild the report from the store

Explanations of the known disagreements live in ``EXPLAINED`` below (by task id and run index);
a disagreement that has none is flagged as unexplained in the report.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from et_hpc.agent.policies import recorded_runs  # noqa: E402
from et_hpc.runs.store import open_run  # noqa: E402
from et_hpc.tasks.loader import load_tasks  # noqa: E402
from et_hpc.util import tail_lines  # noqa: E402

DEFAULT_SOURCE = Path(os.environ.get("ET_HPC_FIXTURES", HERE.parent / "tests" / "fixtures" / "endless-terminals")) / "native"

# (task id, recorded run index) -> why our reward differs from the recorded success.
# Task-wide explanations use index None.
_TEST_BROKEN = (
    "the fixture's final test is broken: test_final_state.py uses `TODAY`, which it never defines, so "
    "collection fails with NameError and every episode scores 0 (the recorded runs were scored by a "
    "working version of the test). With the test repaired (see the diagnostic line above) these runs agree."
)
_PTY_STUCK = (
    "upstream harness artifact: the recorded final-test step shows `Command timed out` and a screen of `> ` "
    "continuation prompts: upstream's single PTY shell was left inside an unfinished multi-line input by an "
    "earlier command, so the test never ran and the run was recorded as failed. Our shell runs each command "
    "to completion (per-command markers, process groups), the final tests run in a separate exec, and the "
    "state the agent left passes them."
)
EXPLAINED: dict[tuple[str, int | None], str] = {
    ("task_000000_3bb4337a", None): _TEST_BROKEN,
    ("task_000000_6eba56f8", 6): _PTY_STUCK,
    ("task_000000_6eba56f8", 7): _PTY_STUCK,
    ("task_000000_c79e7c5d", 0): _PTY_STUCK,
}
# Why the repaired rerun of 3bb4337a still differs on some runs (shown in the report's diagnostic line).
REPAIR_NOTES = {
    "task_000000_3bb4337a": (
        "Runs 3, 9 and 11 `mv temp CHANGELOG.md`: upstream's shell is a PTY, so mv stopped at an interactive "
        "`replace ... overriding mode 0664?` prompt (the target was not writable by the upstream agent) and the "
        "command timed out, leaving CHANGELOG.md unchanged; our shell has no terminal on stdin, so mv does not "
        "ask and the change lands."
    ),
}

# Diagnostic reruns, not counted in the agreement: a task whose final test is itself broken is
# replayed again from a temporary copy with the test repaired (old text -> new text), to show
# whether the runtime agrees once the test runs at all.
REPAIRS: dict[str, tuple[str, str]] = {
    # TODAY is never defined; the recorded runs all wrote the date 2025-04-05.
    "task_000000_3bb4337a": ("# Define paths\n", '# Define paths\nTODAY = "2025-04-05"\n'),
}


@dataclass
class RunCompare:
    task_id: str
    index: int
    recorded: bool | None
    status: str | None
    reward: float | None
    failed_tests: list[str] = field(default_factory=list)
    recorded_output: str = ""
    first_diff: str = ""
    error: str | None = None

    @property
    def ours(self) -> bool | None:
        return None if self.status != "ok" else self.reward == 1.0

    @property
    def agree(self) -> bool:
        return self.status == "ok" and self.ours == bool(self.recorded)


_EXIT_RE = re.compile(r"\s+")


def _norm(text: str) -> str:
    return _EXIT_RE.sub(" ", text or "").strip()


def _observations(messages: list[dict[str, Any]]) -> list[str]:
    """The texts the shell answered with (user messages after the first assistant turn)."""
    out, seen_assistant = [], False
    for m in messages:
        if m.get("role") == "assistant":
            seen_assistant = True
        elif seen_assistant and m.get("role") in ("user", "tool"):
            out.append(str(m.get("content") or ""))
    return out


def first_difference(recorded: list[dict[str, Any]], ours: list[dict[str, Any]], width: int = 300) -> str:
    """The first turn whose observation differs (whitespace-normalised), shown side by side."""
    a, b = _observations(recorded), _observations(ours)
    cmds = [str(m.get("content") or "") for m in recorded if m.get("role") == "assistant"]
    for i in range(max(len(a), len(b))):
        ra = a[i] if i < len(a) else "(none)"
        rb = b[i] if i < len(b) else "(none)"
        if _norm(ra) != _norm(rb):
            cmd = cmds[i] if i < len(cmds) else ""
            return f"turn {i}: command {cmd[:width]!r}\n  recorded: {ra[:width]!r}\n  ours:     {rb[:width]!r}"
    return ""


def compare_task(task: Any, store_dir: Path) -> list[RunCompare]:
    """One RunCompare per recorded run of ``task`` (missing records show status None)."""
    path = task.recorded_runs[0]
    runs = recorded_runs(path)
    raw = json.loads(Path(path).read_text())["results"]
    recs = {r.sample: r for r in open_run(store_dir).records() if r.task_id == task.id} if store_dir.exists() else {}
    out = []
    for run in runs:
        rec = recs.get(run.index)
        c = RunCompare(task.id, run.index, run.success, rec.status if rec else None, rec.reward if rec else None)
        c.recorded_output = str(raw[run.index].get("output") or "")
        if rec is not None:
            c.failed_tests = [t.name for t in rec.tests if t.outcome not in ("passed", "skipped")]
            c.first_diff = first_difference(raw[run.index]["messages"], rec.messages)
            c.error = rec.error
        out.append(c)
    return out


def repaired_copy(task: Any, source: Path, dest: Path) -> Path:
    """A copy of the task folder with REPAIRS applied to its final test; returns the new source."""
    import shutil

    old, new = REPAIRS[task.id]
    folder = dest / task.id
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(source / task.id, folder)
    for p in [folder, *folder.rglob("*")]:  # the fixtures are read-only; the copy need not be
        p.chmod(p.stat().st_mode | 0o200)
    test = folder / "test_final_state.py"
    text = test.read_text()
    assert old in text, f"{task.id}: repair does not apply"
    test.write_text(text.replace(old, new, 1))
    return dest


def replay_task(task: Any, source: Path, store: Path, concurrency: int, env: dict[str, str], run_name: str | None = None) -> float:
    n = len(recorded_runs(task.recorded_runs[0]))
    cmd = [
        sys.executable,
        "-m",
        "et_hpc.cli",
        "run",
        str(source),
        "--policy",
        "replay",
        "--samples",
        str(n),
        "--run-name",
        run_name or f"replay-{task.id}",
        "--store",
        str(store),
        "--concurrency",
        str(concurrency),
        "--set",
        f"tasks.ids=[{task.id}]",
        "--json",
    ]
    t = time.monotonic()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stderr[-2000:], file=sys.stderr)
        raise SystemExit(f"replay of {task.id} failed (exit {r.returncode})")
    return time.monotonic() - t


def report(results: dict[str, list[RunCompare]], seconds: dict[str, float], repaired: dict[str, list[RunCompare]] | None = None) -> str:
    total = sum(len(v) for v in results.values())
    agree = sum(c.agree for v in results.values() for c in v)
    lines = [
        "# Replay agreement",
        "",
        "Every recorded run of the native fixtures replayed through a real sandbox (`et-hpc run "
        "--policy replay`, Debian-based base image, network none) and scored by the task's final "
        "tests; compared with the run's recorded `success`. Generated by `bench/replay_agreement.py`.",
        "",
        "| task | runs | recorded success | our reward 1.0 | errors | agree | agreement | replay s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for tid, comps in results.items():
        n = len(comps)
        a = sum(c.agree for c in comps)
        secs = f"{seconds[tid]:.0f}" if tid in seconds else "-"
        lines.append(
            f"| {tid} | {n} | {sum(bool(c.recorded) for c in comps)} | "
            f"{sum(c.ours is True for c in comps)} | {sum(c.status not in ('ok',) for c in comps)} | "
            f"{a}/{n} | {a / n:.1%} | {secs} |"
        )
    lines += ["", f"**Overall: {agree}/{total} = {agree / total:.1%} agreement** (target >= 90%).", ""]
    for tid, comps in (repaired or {}).items():
        a = sum(c.agree for c in comps)
        old, new = REPAIRS[tid]
        lines += [
            f"Diagnostic, not counted above: {tid} replayed again with its final test repaired "
            f"(`{old.strip()!r}` -> `{new.strip()!r}`): **{a}/{len(comps)} agree**"
            + (f"; still disagreeing: runs {[c.index for c in comps if not c.agree]}" if a < len(comps) else "")
            + ".",
            "",
        ]
        if tid in REPAIR_NOTES and a < len(comps):
            lines += [REPAIR_NOTES[tid], ""]
    bad = [c for v in results.values() for c in v if not c.agree]
    lines += [
        "Runtime fixes this comparison led to: the agent's shell runs with umask 002 as upstream's did "
        "(task_000000_dfbcff7a went from 5/32 to 32/32: its tests expect the 0664 modes upstream's agents "
        "produced); in images without a `user` account the uid-1000 account is mapped to the agent's uid, as "
        "upstream's agent ran as it (task_000000_6eba56f8: `chown artifactmgr` failed with EINVAL before, "
        "11/16 -> 14/16).",
        "",
        "Differences in observations that did not change any reward: a command that is not found exits "
        "127 here and 1 upstream, bash names itself `/usr/bin/bash: line N:`, and `ls -l` shows other "
        "dates and no SELinux `.`.",
        "",
    ]
    lines += ["## Disagreements", ""]
    if not bad:
        lines.append("None.")
    for c in bad:
        why = EXPLAINED.get((c.task_id, c.index)) or EXPLAINED.get((c.task_id, None)) or "UNEXPLAINED"
        lines += [
            f"### {c.task_id} run {c.index}: recorded success={c.recorded}, ours: status={c.status} reward={c.reward}",
            "",
            f"Why: {why}",
            "",
        ]
        if c.error:
            lines += [f"Error: `{c.error[:300]}`", ""]
        if c.failed_tests:
            lines += [f"Our failing final tests: {', '.join(c.failed_tests)}", ""]
        lines += ["Recorded test output (tail):", "```", "\n".join(tail_lines(c.recorded_output, 12)), "```"]
        if c.first_diff:
            lines += ["First differing observation:", "```", c.first_diff, "```"]
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="folder of native tasks")
    ap.add_argument("--tasks", nargs="*", help="task ids (default: every task with recorded runs)")
    ap.add_argument("--store", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "et-hpc-replay-store")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--out", type=Path, default=HERE / "REPLAY.md")
    ap.add_argument("--report-only", action="store_true", help="do not run; report what the store has")
    args = ap.parse_args(argv)
    tasks = [t for t in load_tasks(str(args.source)).tasks if t.recorded_runs]
    if args.tasks:
        tasks = [t for t in tasks if t.id in set(args.tasks)]
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    results: dict[str, list[RunCompare]] = {}
    seconds: dict[str, float] = {}
    for task in tasks:
        if not args.report_only:
            seconds[task.id] = replay_task(task, args.source, args.store, args.concurrency, env)
        results[task.id] = compare_task(task, args.store / f"replay-{task.id}")
        a = sum(c.agree for c in results[task.id])
        print(f"{task.id}: {a}/{len(results[task.id])} agree", file=sys.stderr)
    repaired: dict[str, list[RunCompare]] = {}
    for task in tasks:
        if task.id in REPAIRS:
            name = f"replay-{task.id}-repaired"
            if not args.report_only:
                src = repaired_copy(task, args.source, args.store / "repaired-tasks")
                replay_task(task, src, args.store, args.concurrency, env, run_name=name)
            repaired[task.id] = compare_task(task, args.store / name)
    text = report(results, seconds, repaired)
    args.out.write_text(text)
    print(text.split("## Disagreements")[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
