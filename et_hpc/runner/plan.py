"""Planning a run: load tasks, check their images, list the (task, sample) units the store lacks.

Tasks without an image never stop a run: a task whose image build failed is left out and each of
its units gets one ``no_image`` record (re-planned on every run, so it runs once the image
exists); ``Plan.no_image`` says which and why. Images never built at all refuse the run with the
build command, as does ``strict`` on any missing or failed image. ``prepare_run`` loads the
tasks and checks their images for batch, continuous and env runs alike. A batch invocation's
units of one task are one group (``<task>@i<invocation>``, ``group_size`` = their number;
``tag_record``). Also home of ``open_store`` and of ``run.json``. Specification: docs/runner.md.
"""

from __future__ import annotations

import logging
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from et_hpc.errors import UserError
from et_hpc.host.runtime import run_record
from et_hpc.record import EpisodeRecord, apply_reward_rule, solved, table_rows
from et_hpc.runner.config import RunConfig
from et_hpc.runs.shards import RUN_CONFIG, read_run_config, write_run_config
from et_hpc.runs.store import RunStore
from et_hpc.runs.version_log import run_versions

if TYPE_CHECKING:
    from et_hpc.images.store import ImageResult
    from et_hpc.tasks.model import Task

log = logging.getLogger(__name__)

Unit = tuple[str, int]  # (task_id, sample)
Record = EpisodeRecord | dict[str, Any]  # what a unit runner returns; a stored row read back
GroupTags = dict[str, tuple[str, int]]  # task id -> (group_id, group_size) of one invocation's units
OK: Final = "ok"
NO_IMAGE: Final = "no_image"


# ---------------------------------------------------------------- records and stores
def rec_get(rec: Record, key: str, default: Any = None) -> Any:
    if isinstance(rec, dict):
        return rec.get(key, default)
    return getattr(rec, key, default)


def rec_passed(rec: Record) -> bool:
    """An ok episode whose reward is full (Endless Terminals rewards are 0/1)."""
    if rec_get(rec, "status") != OK:
        return False
    return solved(rec_get(rec, "reward"))


def open_store(run_dir: Path) -> RunStore:
    """The record store of a run (its directory)."""
    return RunStore(Path(run_dir))


def store_records(store: RunStore) -> list[dict[str, Any]]:
    """Every unit's record (one per unit, deduped) as plain dicts."""
    return table_rows(store.read())


# ---------------------------------------------------------------- plan
@dataclass
class Plan:
    cfg: RunConfig
    run_dir: Path
    tasks: dict[str, Any]  # a Task for episodes; what the unit runner takes (rescore: RescoreTask)
    images: dict[str, ImageResult]
    units: list[Unit]  # still to run
    total: int  # tasks x samples
    done_ok: int = 0
    done_error: int = 0
    load_errors: list[str] = field(default_factory=list)
    no_image: dict[str, str] = field(default_factory=dict)  # task id -> why it has no image
    no_image_new: list[Unit] = field(default_factory=list)  # no_image units without that record yet
    sandbox: dict[str, Any] = field(default_factory=dict)  # the "auto" choices (et_hpc.runner.fastpath), binds
    planned_at: float = field(default_factory=time.time)  # when the units became runnable (queue_s)
    invocation: str = field(default_factory=lambda: new_invocation())  # names this invocation's groups

    def group_tags(self) -> GroupTags:
        """Each task's group in this invocation: ``<task>@i<invocation>``, sized by its units."""
        sizes: dict[str, int] = {}
        for tid, _ in self.units:
            sizes[tid] = sizes.get(tid, 0) + 1
        return {tid: (f"{tid}@i{self.invocation}", n) for tid, n in sizes.items()}

    def no_image_units(self) -> int:
        return len(self.no_image) * self.cfg.samples

    def summary(self) -> dict[str, Any]:
        return {
            "tasks": len(self.tasks),
            "samples": self.cfg.samples,
            "units_total": self.total,
            "done_ok": self.done_ok,
            "done_error": self.done_error,
            "to_run": len(self.units),
            "retry_errors": self.cfg.retry_errors,
            "reward": self.cfg.reward,
            "invocation": self.invocation,
            "load_errors": len(self.load_errors),
            "no_image": self.no_image_units(),
            "no_image_tasks": dict(sorted(self.no_image.items())),
            "sandbox": self.sandbox,
        }


def new_invocation() -> str:
    """A name unique to one invocation (UTC time and random bits): part of its groups' ids."""
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def tag_record(rec: Record, tags: GroupTags | None, reward_rule: str) -> Record:
    """``rec`` with its invocation's group (``tags``: none for a unit without one) and scored
    under ``reward_rule`` (``reward_rule`` recorded); a dict record gets the same keys."""
    tid = rec_get(rec, "task_id")
    group = (tags or {}).get(tid)
    if isinstance(rec, dict):
        out = {**rec, "reward_rule": reward_rule}
        if group:
            out.update(group_id=group[0], group_size=group[1])
        return out
    if group:
        rec = rec.model_copy(update={"group_id": group[0], "group_size": group[1]})
    return apply_reward_rule(rec, reward_rule)


def load_run_tasks(cfg: RunConfig) -> tuple[list[Task], list[str]]:
    from et_hpc.tasks.loader import load_tasks

    sel = cfg.tasks
    source = sel.source or (str(sel.tasks_dir) if sel.tasks_dir else None)
    if not source:
        raise UserError("no tasks given: pass SOURCE or --tasks-dir DIR, or set tasks.source in the run config")
    res = load_tasks(source, tasks_dir=sel.tasks_dir, ids=sel.ids, glob=sel.glob, split=sel.split, sample=sel.sample, seed=sel.seed)
    errors = [str(e) for e in (getattr(res, "errors", None) or [])]
    return list(res.tasks), errors


def image_missing(img: ImageResult | None) -> str | None:
    """None when the image is usable, else the reason it is not (one line)."""
    if img is None:
        return "not built"
    status = str(getattr(img, "status", "") or "")
    if status in ("missing", "failed"):
        why = getattr(img, "reason", None) or ("not built" if status == "missing" else f"build {status}")
    else:
        path = getattr(img, "path", None)
        if path is not None and Path(path).exists():
            return None
        why = getattr(img, "reason", None) or "not built"
    lines = [ln.strip() for ln in str(why).splitlines() if ln.strip()]
    return (lines[0] if lines else "not built")[:300]


def build_failed(img: ImageResult | None) -> bool:
    """The image is missing because its build failed or cannot start (not: was never tried)."""
    return img is not None and str(getattr(img, "status", "") or "") == "failed"


def default_image_lookup() -> Callable[[Task], ImageResult]:
    from et_hpc.images.store import ImageStore

    return ImageStore().lookup


def _shown(items: list[str], n: int = 5) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


@dataclass
class Prepared:
    """What ``prepare_run`` found: tasks by id, images of the tasks asked about, tasks without one."""

    tasks: dict[str, Any]
    images: dict[str, ImageResult]
    no_image: dict[str, str] = field(default_factory=dict)  # task id -> why (recorded or skipped)
    load_errors: list[str] = field(default_factory=list)


def prepare_run(
    cfg: RunConfig,
    *,
    tasks: list[Task] | None = None,
    image_lookup: Callable[[Task], ImageResult] | None = None,
    need: list[str] | None = None,
    missing: str = "record",
    done_before: int = 0,
) -> Prepared:
    """Load the run's tasks (or take ``tasks``) and look up the images of ``need`` (default: all).

    ``missing`` says what a task without an image does: ``record`` (batch) keeps a failed build
    as ``no_image`` and refuses never-built images (and, ``strict``, any); ``refuse``
    (continuous) refuses any; ``skip`` (the Atropos env) leaves it out with a warning. A run of
    which nothing can run is refused (``done_before``: units already stored). UserErrors only.
    """
    load_errors: list[str] = []
    if tasks is None:
        tasks, load_errors = load_run_tasks(cfg)
    if not tasks:
        raise UserError("no tasks were selected: check the source and the ids/glob/split filters")
    by_id = {t.id: t for t in tasks}
    images: dict[str, ImageResult] = {}
    no_image: dict[str, str] = {}
    unbuilt: list[str] = []
    todo = list(by_id) if need is None else need
    if todo:
        lookup = image_lookup or default_image_lookup()
        for tid in todo:
            img = lookup(by_id[tid])
            why = image_missing(img)
            if why is None:
                images[tid] = img
            elif missing == "skip" or (missing == "record" and build_failed(img) and not cfg.strict):
                no_image[tid] = why
            else:
                unbuilt.append(f"{tid} ({why})")
        src = cfg.tasks.source or cfg.tasks.tasks_dir or "SOURCE"
        if unbuilt or (no_image and not images and done_before == 0):
            # --strict, never-built images, or nothing at all could run: refuse
            gone = unbuilt + [f"{t} ({w})" for t, w in sorted(no_image.items())]
            whole = " (no selected task has an image)" if not images and not unbuilt else ""
            raise UserError(
                f"{len(gone)} task image(s) missing{whole}: {_shown(gone)}; build them first "
                f"with 'et-hpc build {src}' (add --slurm to build on the cluster)"
            )
    return Prepared(tasks=by_id, images=images, no_image=no_image, load_errors=load_errors)


def make_plan(
    cfg: RunConfig,
    *,
    tasks: list[Task] | None = None,
    image_lookup: Callable[[Task], ImageResult] | None = None,
    store: RunStore | None = None,
    write: bool = True,
) -> Plan:
    """Units still to run for ``cfg`` (see the module doc for tasks without an image).

    Raises ``UserError`` (before writing anything) for images never built, for a run where no
    selected task has an image, and with ``cfg.strict`` for any missing or failed image. With
    ``write``, saves run.json and the new ``no_image`` records.
    """
    run_dir = cfg.run_dir()
    load_errors: list[str] = []
    if tasks is None:
        tasks, load_errors = load_run_tasks(cfg)
    if not tasks:
        raise UserError("no tasks were selected: check the source and the ids/glob/split filters")
    store = store if store is not None else open_store(run_dir)
    done = store.units()
    todo: list[Unit] = []
    ok = err = 0
    for tid in dict.fromkeys(t.id for t in tasks):
        for s in range(cfg.samples):
            st = done.get((tid, s))
            if st == OK:
                ok += 1
            elif st is not None and st != NO_IMAGE and not cfg.retry_errors:
                err += 1
            else:
                if st is not None and st != NO_IMAGE:
                    err += 1
                todo.append((tid, s))
    prep = prepare_run(cfg, tasks=tasks, image_lookup=image_lookup, need=sorted({tid for tid, _ in todo}), done_before=ok + err)
    by_id, images, no_image = prep.tasks, prep.images, prep.no_image
    # an error unit whose image is now missing is redone as no_image (--retry-errors): not counted twice
    err -= sum(1 for u in todo if u[0] in no_image and done.get(u) not in (None, NO_IMAGE))
    no_image_new = [u for u in todo if u[0] in no_image and done.get(u) != NO_IMAGE]
    runnable = [u for u in todo if u[0] not in no_image]
    from et_hpc.runner.fastpath import check_binds, choose, resolve

    check_binds(cfg)
    choice = choose(cfg, runnable, images)
    cfg = resolve(cfg, choice)
    plan = Plan(
        cfg=cfg,
        run_dir=run_dir,
        tasks=by_id,
        images=images,
        units=runnable,
        total=len(by_id) * cfg.samples,
        done_ok=ok,
        done_error=err,
        load_errors=load_errors,
        no_image=no_image,
        no_image_new=no_image_new,
        sandbox={**choice, "binds": list(cfg.sandbox.binds)},
    )
    if write:
        write_run_json(plan)
        record_no_image(plan, store)
    return plan


def no_image_record(plan: Plan, unit: Unit) -> EpisodeRecord:
    """The record of a unit whose task has no image: status no_image, reward None, the reason."""
    tid, sample = unit
    task = plan.tasks[tid]
    kind = getattr(plan.cfg.policy, "kind", None)
    return EpisodeRecord(
        run_name=plan.cfg.run_name(),
        task_id=tid,
        sample=sample,
        status=NO_IMAGE,
        split=getattr(task, "split", None),
        policy_kind=kind,
        host=socket.gethostname(),
        stop_reason=NO_IMAGE,
        error=f"no image: {plan.no_image[tid]}",
    )


def record_no_image(plan: Plan, store: RunStore) -> int:
    """Write one ``no_image`` record per unit that lacks one (one shard); returns how many."""
    if not plan.no_image_new:
        return 0
    store.write([no_image_record(plan, u) for u in plan.no_image_new])
    n = len(plan.no_image_new)
    plan.no_image_new = []
    return n


def write_run_json(plan: Plan) -> Path:
    return save_run_json(plan.cfg, plan.run_dir, plan.summary())


def save_run_json(cfg: RunConfig, run_dir: Path, summary: dict[str, Any]) -> Path:
    """Write ``run.json`` (name, folder, time, the config, the plan's summary, the runtime it used:
    ``et_hpc.host.runtime.run_record``); the one writer of it."""
    data = {
        "name": cfg.run_name(),
        "run_dir": str(run_dir),
        "planned_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": cfg.model_dump(mode="json"),
        "plan": summary,
        "versions": run_versions(run_dir, cfg.policy.endpoint_file, cfg.policy.endpoint_dir),
        "runtime": run_record(cfg.executor),  # apptainer flavour, version and mode, kernel, slurm
    }
    return write_run_config(Path(run_dir), data)


def read_run_json(run_dir: Path) -> dict[str, Any]:
    data = read_run_config(Path(run_dir))
    if data is None:
        raise UserError(f"{Path(run_dir) / RUN_CONFIG} not found: is {run_dir} a run directory (made by 'et-hpc run')?")
    return data
