"""What Slurm lets this user queue now: the site's submit limits and the jobs each one counts.

``submit_limits(slurm_cfg)`` reads MaxArraySize and MaxJobCount (``scontrol show config``), the
association's and the QOS's MaxSubmitJobs/GrpSubmitJobs and MaxJobs (``sacctmgr``), and counts the
jobs each limit covers (``squeue -r``: every array element counts, as Slurm counts them).
``Pacer`` keeps to ``slurm.max_submits_per_min``. ``SUBMIT_LIMIT_RE`` matches sbatch's refusals
for a full queue (try again later). Every query goes through ``et_hpc.host.slurm.query``; a
missing answer means "no such limit". Specification: docs/runner.md ("Submitting within limits").
"""

from __future__ import annotations

import collections
import getpass
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from et_hpc.errors import UserError
from et_hpc.host import slurm as host_slurm
from et_hpc.host.slurm import SlurmConfig

DEFAULT_MAX_ARRAY_SIZE = 1001  # Slurm's defaults, when scontrol does not answer
DEFAULT_MAX_JOB_COUNT = 10000
# sbatch's refusals that mean "the queue is full for you now": wait and submit again
SUBMIT_LIMIT_RE = re.compile(
    r"MaxSubmitJob|GrpSubmitJob|SubmitJobsLimit|job submit limit|MaxJobCount|temporarily unable to accept", re.IGNORECASE
)


def parse_sacctmgr(text: str, fields: list[str]) -> list[dict[str, str]]:
    """Rows of ``sacctmgr -n -P show ... format=<fields>`` as dicts (empty string: no limit)."""
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = line.split("|")
        rows.append({f: (cells[i].strip() if i < len(cells) else "") for i, f in enumerate(fields)})
    return rows


def _int(v: Any) -> int | None:
    try:
        return int(str(v).strip())
    except (TypeError, ValueError):
        return None


def max_array_size() -> int:
    """Slurm's MaxArraySize (an array holds indices 0..MaxArraySize-1)."""
    return _int(host_slurm.scontrol_config().get("MaxArraySize")) or DEFAULT_MAX_ARRAY_SIZE


def count_jobs(*filters: str) -> int | None:
    """Jobs in the queue matching squeue ``filters``, each array task counted (as Slurm does)."""
    out = host_slurm.query(["squeue", "-h", "-r", "-o", "%i", *filters])
    return None if out is None else len([ln for ln in out.splitlines() if ln.strip()])


@dataclass
class SubmitLimits:
    """How many array tasks Slurm accepts now, and why (the tightest limit)."""

    max_array_size: int
    free: int | None = None  # array tasks that may still be queued; None: no limit known
    why: str = ""  # the binding limit, e.g. "MaxJobCount=10000, 9990 jobs queued"
    limits: list[tuple[int, str]] = field(default_factory=list)  # (free, description) of each limit
    running: list[str] = field(default_factory=list)  # MaxJobs limits: more jobs wait, none is refused

    def add(self, limit: int | None, queued: int | None, name: str) -> None:
        if limit is None:
            return
        q = queued or 0
        self.limits.append((limit - q, f"{name}={limit}" + (f", {q} jobs queued" if q else "")))
        self.free, self.why = min(self.limits)

    def describe(self) -> str:
        """One line: every submit limit found and what of it is free, then the MaxJobs limits."""
        parts = [f"{d} ({max(0, f)} free)" for f, d in sorted(self.limits, key=lambda x: x[1])]
        parts += [f"{r} (running at once; more wait)" for r in self.running]
        return "; ".join(parts) or "no submit limit found"


class _Counter:
    """squeue counts, each asked once per ``submit_limits`` call."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, ...], int | None] = {}

    def __call__(self, *filters: str) -> int | None:
        if filters not in self.seen:
            self.seen[filters] = count_jobs(*filters)
        return self.seen[filters]


def _assoc_limits(lim: SubmitLimits, user: str, account: str, partition: str | None, count: _Counter) -> str | None:
    """The user's association limits in ``account``; returns its default QOS (or None)."""
    fields = ["account", "user", "partition", "max_submit", "grp_submit", "max_jobs", "default_qos"]
    cmd = ["sacctmgr", "-n", "-P", "show", "assoc", "where", f"user={user}", f"account={account}"]
    out = host_slurm.query([*cmd, "format=Account,User,Partition,MaxSubmit,GrpSubmit,MaxJobs,DefaultQOS"]) or ""
    qos = None
    for r in parse_sacctmgr(out, fields):
        if r["user"] != user or r["partition"] not in ("", partition or ""):
            continue
        where = ("-u", user, "-A", account, *(("-p", r["partition"]) if r["partition"] else ()))
        name = f"association {account}/{user}"
        if _int(r["max_submit"]) is not None:
            lim.add(_int(r["max_submit"]), count(*where), f"MaxSubmitJobs of {name}")
        if _int(r["grp_submit"]) is not None:
            lim.add(_int(r["grp_submit"]), count(*where), f"GrpSubmitJobs of {name}")
        if _int(r["max_jobs"]) is not None:
            lim.running.append(f"MaxJobs of {name}={r['max_jobs']}")
        qos = qos or r["default_qos"] or None
    return qos


def _qos_limits(lim: SubmitLimits, user: str, account: str | None, qos: str, count: _Counter) -> None:
    fields = ["name", "max_submit_pu", "max_submit_pa", "grp_submit", "max_jobs_pu"]
    out = host_slurm.query(["sacctmgr", "-n", "-P", "show", "qos", qos, "format=Name,MaxSubmitPU,MaxSubmitPA,GrpSubmit,MaxJobsPU"]) or ""
    for r in parse_sacctmgr(out, fields):
        if r["name"] != qos:
            continue
        if _int(r["max_submit_pu"]) is not None:
            lim.add(_int(r["max_submit_pu"]), count("-u", user, "-q", qos), f"MaxSubmitJobsPerUser of QOS {qos}")
        if _int(r["max_submit_pa"]) is not None and account:
            lim.add(_int(r["max_submit_pa"]), count("-A", account, "-q", qos), f"MaxSubmitJobsPerAccount of QOS {qos}")
        if _int(r["grp_submit"]) is not None:
            lim.add(_int(r["grp_submit"]), count("-q", qos), f"GrpSubmitJobs of QOS {qos}")
        if _int(r["max_jobs_pu"]) is not None:
            lim.running.append(f"MaxJobsPerUser of QOS {qos}={r['max_jobs_pu']}")


def submit_limits(s: SlurmConfig, *, own: int = 0) -> SubmitLimits:
    """Query Slurm for how many more array tasks this user may queue under ``s`` (module doc);
    ``own``: this array's tasks still queued or running (counted against ``slurm.max_submit_jobs``)."""
    conf = host_slurm.scontrol_config()
    real_size = _int(conf.get("MaxArraySize")) or DEFAULT_MAX_ARRAY_SIZE
    lim = SubmitLimits(max_array_size=min(s.max_array_size, real_size) if s.max_array_size else real_size)
    if s.max_submit_jobs:
        lim.add(s.max_submit_jobs, own, "slurm.max_submit_jobs")
    if not conf:  # Slurm does not answer: sbatch will say why
        return lim
    user = getpass.getuser()
    count = _Counter()
    lim.add(_int(conf.get("MaxJobCount")) or DEFAULT_MAX_JOB_COUNT, count(), "MaxJobCount")
    account, qos = s.account, s.qos
    if not account:
        out = host_slurm.query(["sacctmgr", "-n", "-P", "show", "user", user, "format=User,DefaultAccount"]) or ""
        users = parse_sacctmgr(out, ["user", "account"])
        account = users[0]["account"] if users else None
    if account:
        qos = qos or _assoc_limits(lim, user, account, s.partition, count)
    qos = qos or ("normal" if account else None)
    if qos:
        _qos_limits(lim, user, account, qos, count)
    return lim


def check_fits(n_units: int, units_per_task: int, limits: SubmitLimits, *, detach: bool = False) -> int:
    """Array tasks the units need; ``UserError`` naming the units_per_task that fits when too many
    (a submission that returns at once cannot wait for room: ``--detach``, ``submit``)."""
    n_tasks = math.ceil(n_units / units_per_task)
    if limits.free is None or n_tasks <= limits.free:
        return n_tasks
    alt = "rerun without --detach (et-hpc then submits them as queued jobs end)" if detach else ""
    if limits.free <= 0:
        raise UserError(f"Slurm accepts no more jobs now ({limits.why}): wait for queued jobs to end ('squeue --me'), or {alt or 'rerun'}")
    fit = math.ceil(n_units / limits.free)
    raise UserError(
        f"{n_units} units at slurm.units_per_task={units_per_task} need {n_tasks} array tasks but "
        f"Slurm accepts {limits.free} more ({limits.why}): "
        + (f"{alt}, or " if alt else "rerun with ")
        + f"--set slurm.units_per_task={fit}"
    )


class Pacer:
    """At most ``per_min`` array tasks submitted in any 60 s (``slurm.max_submits_per_min``; None: no cap)."""

    def __init__(self, per_min: int | None, clock: Callable[[], float] = time.monotonic):
        self.per_min = per_min
        self.clock = clock
        self.sent: collections.deque[tuple[float, int]] = collections.deque()

    def room(self) -> int | None:
        if not self.per_min:
            return None
        now = self.clock()
        while self.sent and now - self.sent[0][0] >= 60.0:
            self.sent.popleft()
        return max(0, self.per_min - sum(n for _, n in self.sent))

    def add(self, n: int) -> None:
        self.sent.append((self.clock(), n))
