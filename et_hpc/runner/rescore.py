"""Rescoring: regrade a stored run's kept final states with other final tests, without the agent.

``plan_rescore`` makes a ``Plan`` for a new run (one unit per ``ok`` episode with a kept state and
new tests for its task) that runs on any run's executor with ``rescore_unit``, which scores the
kept state read-only through ``final_score``, the function every live episode is scored by.
Guarantees: the source run is only read; what cannot be rescored is listed with why, never
guessed; a rerun resumes only with the same source and tests; ``rescore.json`` records where it
came from, the tests and their diff, and ``diff_report`` lists the rewards that flipped. Needs
the source run's kept states (``sandbox.keep_final_state``). How: docs/rescore.md; what it
defends: SECURITY.md.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import logging
import os
import secrets
import socket
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from et_hpc.errors import InfraError, UserError
from et_hpc.record import EpisodeRecord, Status, Timings, records_from_table, solved
from et_hpc.runner.config import RunConfig, apply_setting
from et_hpc.runner.plan import OK, Plan, image_missing, load_run_tasks, open_store, read_run_json, save_run_json
from et_hpc.runs import final_state as fs
from et_hpc.scoring import start_check
from et_hpc.util import atomic_write_text

if TYPE_CHECKING:
    from collections.abc import Callable

    from et_hpc.images.store import ImageResult
    from et_hpc.scoring.live import ScoreResult
    from et_hpc.tasks.model import Task

log = logging.getLogger(__name__)

UNIT_RUNNER = "et_hpc.runner.rescore:rescore_unit"
RESCORE_JSON = "rescore.json"
TEST_FILE = "test_final_state.py"


@dataclasses.dataclass
class RescoreTask:
    """What a rescore unit needs beside its sample: the task with its new final tests, and the
    source run whose kept states it regrades (picklable: it travels to Slurm array tasks)."""

    id: str
    task: Task
    source_run: str
    tests_digest: str

    @property
    def split(self) -> str | None:
        return getattr(self.task, "split", None)


# ---------------------------------------------------------------- one unit
@functools.lru_cache(maxsize=4)
def _source_records(run_dir: str) -> dict[tuple[str, int], EpisodeRecord]:
    recs = records_from_table(open_store(Path(run_dir)).read())
    return {(r.task_id, r.sample): r for r in recs}


def _slurm_ids() -> tuple[str | None, int | None]:
    job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    task = os.environ.get("SLURM_ARRAY_TASK_ID")
    return job, int(task) if task and task.isdigit() else None


def rescore_unit(
    task: RescoreTask, sample: int, cfg: RunConfig, image: ImageResult | None, stop: threading.Event | None = None
) -> EpisodeRecord:
    """The unit runner of a rescore (docs/rescore.md). Never raises for infrastructure trouble:
    a missing or damaged kept state, a sandbox that will not start or scoring that breaks become a
    record with an error status and reward None."""
    stop = stop or threading.Event()
    t0 = time.monotonic()
    src_dir = Path(task.source_run)
    src = _source_records(str(src_dir)).get((task.id, sample))
    if src is None:
        raise InfraError(f"run {src_dir} has no episode {task.id}#{sample}")
    job, array_task = _slurm_ids()
    events = [f"rescored {src.run_name}/{src.episode_id} with tests {task.tests_digest}"]
    timings: dict[str, float] = {}

    def record(status: Status, *, sc: ScoreResult | None = None, error: str | None = None) -> EpisodeRecord:
        from et_hpc.scoring.live import score_fields  # the episode's own record fields of a score

        t = src.timings.model_copy(update={"score_s": timings.get("score_s")})
        return src.model_copy(
            update={
                "episode_id": str(uuid.uuid4()),
                "run_name": cfg.run_name(),
                "status": status,
                **score_fields(sc, status),
                "error": error,
                "events": [
                    *src.events,
                    *events,
                    *((sc.notes or []) if sc is not None else []),
                    f"rescore: setup {timings.get('setup_s', 0):.3f} s, scoring {timings.get('score_s', 0):.3f} s, "
                    f"total {time.monotonic() - t0:.3f} s",
                ],
                "image_digest": getattr(image, "digest", None) or src.image_digest,
                "image_path": str(getattr(image, "path", "") or "") or src.image_path,
                "host": socket.gethostname(),
                "worker": f"{socket.gethostname()}:{os.getpid()}",
                "slurm_job_id": job,
                "slurm_array_task_id": array_task,
                "tests_digest": task.tests_digest,
                "rescored_from": f"{src.run_name}/{src.episode_id}",
                "created_at": datetime.now(timezone.utc),
                "timings": Timings.model_validate(t.model_dump()),
            }
        )

    if image is None or getattr(image, "path", None) is None:
        return record("infra_error", error=f"no image for task {task.id}: run 'et-hpc build'")
    try:
        fs.link_into(src_dir, cfg.run_dir(), src.final_state or "")  # the new run holds the states its records name
        sc, wd_events = score_kept_state(src_dir, src.final_state or "", task.task, cfg, image, timings)
    except (InfraError, OSError) as e:
        return record("infra_error", error=str(e))
    except Exception as e:  # noqa: BLE001 - a unit must end in a record
        log.exception("rescoring %s#%s failed", task.id, sample)
        return record("infra_error", error=f"{type(e).__name__}: {e}")
    events += wd_events
    from et_hpc.scoring.live import GONE_NOTE

    if stop.is_set() and (sc.status != "ok" or sc.note == GONE_NOTE):
        return record("infra_error", error="interrupted by the run")
    if sc.status != "ok":
        return record("score_error", sc=sc, error=sc.error)
    return record(OK, sc=sc)


def score_kept_state(
    run_dir: Path, value: str, task: Task, cfg: RunConfig, image: ImageResult, timings: dict[str, float] | None = None
) -> tuple[ScoreResult, list[str]]:
    """Score the kept state ``value`` of ``run_dir`` with ``task.final_tests`` in a fresh sandbox of
    ``image`` (the kept overlay read-only under a tmpfs), through ``final_score`` as a live episode.
    Returns (score result, watchdog events); raises ``InfraError``/``OSError`` for what is outside the
    agent's reach (a missing or damaged state, a sandbox that does not start)."""
    from et_hpc.episode.run import final_score, sandbox_spec
    from et_hpc.sandbox.sandbox import Sandbox, scratch_paths
    from et_hpc.sandbox.watchdog import Watchdog

    timings = timings if timings is not None else {}
    spec = sandbox_spec(task, cfg, image)
    if spec is None:
        raise InfraError(f"no image for task {task.id}: run 'et-hpc build'")
    archive = fs.archive_path(Path(run_dir), value)
    img = scratch_paths()[1] / f"rescore-{os.getpid()}-{secrets.token_hex(4)}.img"
    t = time.monotonic()
    try:
        fs.extract(archive, value, img)
    except OSError as e:
        raise InfraError(f"kept state {archive}: {e}") from None
    timings["extract_s"] = time.monotonic() - t
    try:
        refused, left_out = start_check.check_start(img)
    except BaseException:
        img.unlink(missing_ok=True)
        raise
    if refused:  # the agent changed what starting its state would run: not started, the agent's 0
        img.unlink(missing_ok=True)
        from et_hpc.scoring.live import ScoreResult

        note = "the kept state changes what starts a sandbox (" + ", ".join(refused[:5]) + "): it is not started again, and scores 0"
        return ScoreResult(status="ok", reward=0.0, note=note, interpreter="none"), []
    events = [f"rescore: the kept {p} was left out (the image's applies)" for p in left_out]
    tree = _cas_tree(spec.image_path, spec.image_digest, img)
    sb = Sandbox(
        Path(tree if tree is not None else spec.image_path),
        run_prefix=spec.run_prefix,
        overlay_image=img,
        overlay_readonly=True,
        network_none=spec.network_none,
        nproc=spec.nproc,
        vmem_mb=spec.vmem_mb,
        fsize_mb=spec.fsize_mb,
        prepare_home=False,  # never the state's bash: the entry helper names the account (scoring.run_tests)
        warm_scoring=False,
    )
    wd = None
    t = time.monotonic()
    try:
        sb.start()  # owns the image from here: its stop deletes it
        if spec.watchdog_interval_s:
            wd = Watchdog(sb, memory_mb=spec.memory_mb, max_pids=spec.max_pids, interval_s=spec.watchdog_interval_s)
            wd.prepare()
            wd.start()
        timings["setup_s"] = time.monotonic() - t
        t = time.monotonic()
        sc, wd_events = final_score(sb, wd, task, cfg)
        timings["score_s"] = time.monotonic() - t
        events += wd_events
    finally:
        if wd is not None:
            wd.stop()
        sb.stop()
        img.unlink(missing_ok=True)
        if tree is not None:
            tree.release()
    return sc, events


def _cas_tree(image_path: str, digest: str | None, img: Path) -> Any:
    """The node-local tree of a CAS image (a leased ``LocalImage``), None for a SIF (started in place)."""
    if not image_path.endswith(".cas"):
        return None
    from et_hpc.images.cas_node import cas_tree

    try:
        return cas_tree(Path(image_path), digest)
    except BaseException:
        img.unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------- planning
def _digest_all(parts: list[str]) -> str:
    return hashlib.sha256("\n".join(sorted(parts)).encode()).hexdigest()


def _check_tests(path: Path) -> str:
    """The text of a final test file; ``UserError`` when it cannot be read or is not valid Python
    (it would fail every episode, and that must not read as the agents' zeros)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read tests {path}: {getattr(e, 'strerror', None) or e}") from None
    try:
        compile(text, str(path), "exec")
    except SyntaxError as e:
        raise UserError(f"tests {path}:{e.lineno}: not valid Python: {e.msg}") from None
    return text


def _diff(old: str | None, new: str, tid: str) -> str:
    if old is None:
        return "(the tests that scored the source episodes were not kept)"
    return "".join(
        difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"{tid}/{TEST_FILE} (source run)", f"{tid}/{TEST_FILE} (rescore)")
    )


def _read_source(src_dir: Path) -> tuple[RunConfig, list[EpisodeRecord], list[EpisodeRecord]]:
    """The source run's config, its records and the ``ok`` ones that kept their final state."""
    meta = read_run_json(src_dir)
    try:
        src_cfg = RunConfig.model_validate(meta.get("config") or {})
    except ValidationError as e:
        raise UserError(f"{src_dir}/run.json: its config does not load here: {e.errors()[0]['msg']}") from None
    recs = list(_source_records.__wrapped__(str(src_dir)).values())
    if not recs:
        raise UserError(f"run {src_dir} has no records")
    kept = [r for r in recs if r.status == OK and fs.digest_of(r.final_state)]
    if not kept:
        raise UserError(f"no episode of run {src_dir} kept its final state: run it with --set sandbox.keep_final_state=true")
    return src_cfg, recs, kept


def _new_tests(src_dir: Path, src_cfg: RunConfig, tests: Path | None, task_source: str | None) -> tuple[dict[str, Task], dict[str, Path]]:
    """The tasks by id, and the new final tests per task id (from ``--task-source`` or ``--tests``)."""
    if task_source is not None:
        from et_hpc.tasks.loader import load_tasks

        loaded = load_tasks(task_source).tasks
        by_id = {t.id: t for t in loaded}
        return by_id, {t.id: Path(t.final_tests) for t in loaded if t.final_tests is not None}
    assert tests is not None
    if not Path(tests).is_dir():
        raise UserError(f"--tests {tests}: not a directory (expected DIR/<task_id>/{TEST_FILE})")
    try:
        loaded, _ = load_run_tasks(src_cfg)
    except UserError as e:
        raise UserError(f"the tasks of run {src_dir} do not load ({e}): pass --task-source SRC") from None
    by_id = {t.id: t for t in loaded}
    return by_id, {tid: Path(tests) / tid / TEST_FILE for tid in by_id if (Path(tests) / tid / TEST_FILE).is_file()}


def _rescore_config(
    src_dir: Path, src_cfg: RunConfig, digests: dict[str, str], run_name: str | None, store: Path | None, overrides: list | None
) -> RunConfig:
    """The new run's config: the source's, renamed, with the rescore unit runner, no continuous
    mode, no warm pool, and the ``--set`` overrides applied."""
    name = run_name or f"{src_dir.name}-rescore-{_digest_all(list(digests.values()))[:8]}"
    data = src_cfg.model_dump(mode="json")
    data.update(name=name, store=str(store or src_dir.parent), unit_runner=UNIT_RUNNER, samples=src_cfg.samples)
    data["continuous"] = {}
    data["sandbox"]["warm"] = 0
    for keys, val in overrides or []:
        apply_setting(data, keys, val, "rescore")
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        raise UserError(f"--set {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    return cfg.model_copy(update={"unit_runner": UNIT_RUNNER})


def _check_resume(run_dir: Path, src_dir: Path, digests: dict[str, str]) -> None:
    """A rerun resumes only with the same source and tests: records of two test versions must not mix."""
    if run_dir.resolve() == src_dir:
        raise UserError(f"the rescore would write into its source run {src_dir}: pick another --run-name")
    try:
        before = json.loads((run_dir / RESCORE_JSON).read_text())
    except (OSError, ValueError):
        return
    changed = sorted(t for t, v in before.get("tests", {}).items() if t in digests and v.get("digest") != digests[t])
    if changed or before.get("source_dir") != str(src_dir):
        what = f"other tests for {', '.join(changed[:3])}" if changed else f"another source run ({before.get('source_dir')})"
        raise UserError(f"run {run_dir} was rescored with {what}: pick another --run-name")


def _skip_reason(
    r: EpisodeRecord, texts: dict[str, str], images: dict[str, ImageResult], lookup: Callable[[Task], ImageResult], by_id: dict[str, Task]
) -> str | None:
    """Why episode ``r`` cannot be rescored (listed, never guessed), or ``None``."""
    if r.status != OK:
        return f"status {r.status} (nothing was scored)"
    if not fs.digest_of(r.final_state):
        return "no kept state" + (f" ({r.final_state})" if r.final_state else " (keep_final_state was off)")
    if r.task_id not in texts:
        return "no new tests for its task"
    if r.task_id not in images:
        return f"no image: {image_missing(lookup(by_id[r.task_id]))}"
    digest: str | None = getattr(images[r.task_id], "digest", None)
    if r.image_digest and digest is not None and digest != r.image_digest:
        return f"its image changed ({r.image_digest[:12]} -> {digest[:12]})"
    return None


def _write_plan(
    plan: Plan,
    src_dir: Path,
    usable: list[str],
    new_tests: dict[str, Path],
    digests: dict[str, str],
    texts: dict[str, str],
    old_tests: dict[str, str | None],
    skipped: list[dict[str, Any]],
) -> None:
    """``rescore.json`` (source, tests with digests and diffs, what was not rescored) and ``run.json``."""
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    info = {
        "source_run": src_dir.name,
        "source_dir": str(src_dir),
        "tests": {
            tid: {
                "path": str(new_tests[tid].resolve()),
                "digest": digests[tid],
                "source_digest": old_tests.get(tid),
                "diff": _diff(fs.kept_tests(src_dir, old_tests.get(tid)), texts[tid], tid),
            }
            for tid in usable
        },
        "not_rescored": skipped,
    }
    atomic_write_text(plan.run_dir / RESCORE_JSON, json.dumps(info, indent=2) + "\n")
    save_run_json(plan.cfg, plan.run_dir, {**plan.summary(), "rescore_of": str(src_dir), "not_rescored": len(skipped)})


def plan_rescore(
    source: str,
    *,
    tests: Path | None = None,
    task_source: str | None = None,
    run_name: str | None = None,
    store: Path | None = None,
    overrides: list | None = None,
    image_lookup: Callable[[Task], ImageResult] | None = None,
    write: bool = True,
) -> Plan:
    """The plan of a rescore of ``source`` (docs/rescore.md). ``UserError`` (one line) for a
    missing run, a run without kept states, tests that are missing or not valid Python."""
    from et_hpc.paths import find_run_dir

    if (tests is None) == (task_source is None):
        raise UserError("give the new tests: --tests DIR or --task-source SRC (one of them)")
    src_dir = find_run_dir(source, store).resolve()
    src_cfg, recs, kept = _read_source(src_dir)
    by_id, new_tests = _new_tests(src_dir, src_cfg, tests, task_source)
    wanted = sorted({r.task_id for r in kept})
    usable = [tid for tid in wanted if tid in by_id and tid in new_tests]
    if not usable:
        where = f"--tests {tests}" if tests is not None else f"--task-source {task_source}"
        raise UserError(
            f"{where} has no final tests for any task of run {src_dir} with a kept state (expected e.g. {wanted[0]}/{TEST_FILE})"
        )
    texts = {tid: _check_tests(new_tests[tid]) for tid in usable}
    digests = {tid: fs.PREFIX + hashlib.sha256(texts[tid].encode()).hexdigest() for tid in usable}
    cfg = _rescore_config(src_dir, src_cfg, digests, run_name, store, overrides)
    run_dir = cfg.run_dir()
    _check_resume(run_dir, src_dir, digests)
    lookup = image_lookup
    if lookup is None:  # the task's pristine image, the one the episodes ran on
        from et_hpc.images.store import ImageStore

        lookup = ImageStore().lookup
    images = {tid: img for tid in usable if image_missing(img := lookup(by_id[tid])) is None}
    done = open_store(run_dir).units()
    units: list[tuple[str, int]] = []
    skipped: list[dict[str, Any]] = []
    n_done = 0
    for r in sorted(recs, key=lambda r: (r.task_id, r.sample)):
        why = _skip_reason(r, texts, images, lookup, by_id)
        if why is not None:
            skipped.append({"task_id": r.task_id, "sample": r.sample, "episode_id": r.episode_id, "why": why})
            continue
        st = done.get((r.task_id, r.sample))
        if st == OK or (st is not None and not cfg.retry_errors):
            n_done += 1
            continue
        units.append((r.task_id, r.sample))
    tasks = {
        tid: RescoreTask(
            id=tid,
            task=by_id[tid].model_copy(update={"final_tests": new_tests[tid].resolve()}),
            source_run=str(src_dir),
            tests_digest=digests[tid],
        )
        for tid in usable
    }
    plan = Plan(cfg=cfg, run_dir=run_dir, tasks=tasks, images=images, units=units, total=len(units) + n_done, done_ok=n_done)
    if write:
        _write_plan(plan, src_dir, usable, new_tests, digests, texts, {r.task_id: r.tests_digest for r in kept}, skipped)
    return plan


# ---------------------------------------------------------------- what changed
def diff_report(run_dir: Path) -> dict[str, Any]:
    """Per task: the episodes whose reward flipped between the source run and the rescore, the
    tests' diff, and the episodes not rescored (with why). ``UserError`` when ``run_dir`` is not
    a rescore."""
    p = Path(run_dir) / RESCORE_JSON
    try:
        info = json.loads(p.read_text())
    except FileNotFoundError:
        raise UserError(f"{run_dir} is not a rescored run (no {RESCORE_JSON}): run 'et-hpc rescore RUN --tests DIR' first") from None
    except ValueError as e:
        raise UserError(f"{p} is not valid JSON ({e})") from None
    src = {r.episode_id: r for r in _source_records.__wrapped__(info["source_dir"]).values()}
    new = records_from_table(open_store(Path(run_dir)).read())
    tasks: dict[str, dict[str, Any]] = {}
    for tid, t in sorted(info["tests"].items()):
        tasks[tid] = {
            "tests_digest": t["digest"],
            "source_tests_digest": t.get("source_digest"),
            "diff": t["diff"],
            "flipped": [],
            "same": 0,
            "errors": [],
            "not_rescored": [],
        }
    for r in sorted(new, key=lambda r: (r.task_id, r.sample)):
        entry = tasks.setdefault(r.task_id, {"flipped": [], "same": 0, "errors": [], "not_rescored": [], "diff": ""})
        old = src.get((r.rescored_from or "/").split("/", 1)[1])
        if r.status != OK:
            entry["errors"].append({"sample": r.sample, "status": r.status, "error": r.error})
        elif old is not None and solved(old.reward) != solved(r.reward):
            entry["flipped"].append({"sample": r.sample, "episode_id": old.episode_id, "old_reward": old.reward, "new_reward": r.reward})
        else:
            entry["same"] += 1
    for s in info.get("not_rescored", []):
        tasks.setdefault(s["task_id"], {"flipped": [], "same": 0, "errors": [], "not_rescored": [], "diff": ""})
        tasks[s["task_id"]]["not_rescored"].append(s)
    flipped = sum(len(t["flipped"]) for t in tasks.values())
    return {
        "run": Path(run_dir).name,
        "source_run": info["source_run"],
        "rescored": len(new),
        "flipped": flipped,
        "not_rescored": len(info.get("not_rescored", [])),
        "tasks": tasks,
    }


def format_diff(rep: dict[str, Any], *, show_diff: bool = True) -> str:
    lines = [
        f"rescore {rep['run']} of {rep['source_run']}: {rep['rescored']} episode(s) rescored, "
        f"{rep['flipped']} flipped, {rep['not_rescored']} not rescored"
    ]
    for tid, t in rep["tasks"].items():
        lines.append(
            f"\n{tid}: {len(t['flipped'])} flipped, {t['same']} unchanged, {len(t['errors'])} error(s), "
            f"{len(t['not_rescored'])} not rescored"
        )
        for f in t["flipped"]:
            lines.append(f"  sample {f['sample']}: {f['old_reward']:g} -> {f['new_reward']:g}  (episode {f['episode_id']})")
        for e in t["errors"]:
            lines.append(f"  sample {e['sample']}: {e['status']}: {(e['error'] or '')[:200]}")
        for s in t["not_rescored"]:
            lines.append(f"  sample {s['sample']}: not rescored: {s['why']}")
        if show_diff and t.get("diff"):
            lines += ["  " + ln for ln in t["diff"].rstrip("\n").splitlines()]
    return "\n".join(lines)
