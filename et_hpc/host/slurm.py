"""Slurm's commands, each with a timeout so et-hpc never hangs on them: ``query`` (squeue, sacct,
scontrol, sacctmgr) and what is built on it, chiefly watching array tasks.

State comes from ``squeue`` (live jobs) and ``sacct`` (finished jobs, when accounting exists).
A task known to neither, while squeue answers, has ended (purged after MinJobAge): a task that
Slurm killed is therefore always seen as ended, result file or not. Every command has a timeout.

``SlurmConfig`` (the ``slurm`` block of a run config) says how array jobs are submitted.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from et_hpc.errors import UserError

log = logging.getLogger(__name__)

QUEUED = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "CONFIGURING"}
RUNNING = {"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING", "RESIZING", "SUSPENDED", "STOPPED"}
DONE = {"COMPLETED"}
UNKNOWN = "UNKNOWN"  # Slurm did not answer: not ended
GONE = "GONE"  # known to nobody any more: ended, outcome unknown
CMD_TIMEOUT_S = 30


def category(state: str) -> str:
    """queued | running | done | failed | unknown"""
    if state in QUEUED:
        return "queued"
    if state in RUNNING:
        return "running"
    if state in DONE:
        return "done"
    if state == UNKNOWN:
        return "unknown"
    return "failed"  # FAILED, CANCELLED, TIMEOUT, NODE_FAIL, OUT_OF_MEMORY, PREEMPTED, GONE, ...


def ended(state: str) -> bool:
    return category(state) in ("done", "failed")


def query(cmd: list[str], timeout: float = CMD_TIMEOUT_S) -> str | None:
    """stdout of a Slurm command (squeue, sacct, scontrol, sacctmgr); None when it is missing, fails
    or does not answer within ``timeout``; "" for job ids Slurm no longer knows."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.debug("%s failed: %s", cmd[0], e)
        return None
    if r.returncode != 0:
        log.debug("%s exited %s: %s", cmd[0], r.returncode, r.stderr.strip()[:300])
        if "Invalid job id" in r.stderr:
            return ""
        return None
    return r.stdout


def parse_scontrol_config(text: str) -> dict[str, str]:
    """``Key = value`` lines of ``scontrol show config`` -> ``{Key: value}``."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = re.match(r"^(\w[\w/.-]*)\s*=\s*(.*?)\s*$", line)
        if m:
            out.setdefault(m.group(1), m.group(2))
    return out


def scontrol_config(timeout: float = CMD_TIMEOUT_S) -> dict[str, str]:
    """Slurm's configuration (``scontrol show config``); ``{}`` when Slurm does not answer."""
    return parse_scontrol_config(query(["scontrol", "show", "config"], timeout) or "")


_RANGE = re.compile(r"^(\d+)_\[([^\]]+)\]$")


def _expand(jobid: str) -> list[str]:
    """``123_[0-2,5%2]`` -> ``123_0 123_1 123_2 123_5``; plain ids pass through."""
    m = _RANGE.match(jobid)
    if not m:
        return [jobid]
    base, spec = m.group(1), m.group(2).split("%")[0]
    out = []
    for part in spec.split(","):
        a, _, b = part.partition("-")
        if a.isdigit():
            out += [f"{base}_{i}" for i in range(int(a), int(b or a) + 1)]
    return out


def _parse(text: str) -> dict[str, str]:
    states: dict[str, str] = {}
    for line in text.splitlines():
        jid, sep, state = line.strip().partition("|")
        if not sep or "." in jid:  # skip job steps (123_0.batch)
            continue
        st = state.split()[0].rstrip("+") if state.strip() else UNKNOWN
        for j in _expand(jid):
            states[j] = st
    return states


def squeue_states(array_ids: list[str]) -> dict[str, str] | None:
    out = query(["squeue", "-h", "--array", "--states=all", "-o", "%i|%T", "-j", ",".join(array_ids)])
    return None if out is None else _parse(out)


def sacct_states(array_ids: list[str]) -> dict[str, str] | None:
    out = query(["sacct", "-n", "-P", "-X", "-o", "JobID,State", "-j", ",".join(array_ids)])
    return None if out is None else _parse(out)


def task_states(expected: list[str]) -> dict[str, str]:
    """State of each array task id (``"<array>_<i>"``) in ``expected``."""
    arrays = sorted({t.split("_")[0] for t in expected})
    if not arrays:
        return {}
    sq = squeue_states(arrays)
    sa = sacct_states(arrays) or {}
    out = {}
    for t in expected:
        if sq is not None and t in sq:
            out[t] = sq[t]
        elif t in sa:
            out[t] = sa[t]
        elif sq is not None:
            out[t] = GONE
        else:
            out[t] = UNKNOWN
    return out


def counts(states: dict[str, str]) -> dict[str, int]:
    c = {"queued": 0, "running": 0, "done": 0, "failed": 0, "unknown": 0}
    for s in states.values():
        c[category(s)] += 1
    return c


def wait_tasks(
    expected: list[str], *, poll_s: float = 10.0, timeout_s: float | None = None, on_poll: Callable[[dict[str, str]], None] | None = None
) -> tuple[dict[str, str], bool]:
    """Poll until every task has ended or ``timeout_s`` passes. Returns (states, all_ended)."""
    end = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        states = task_states(expected)
        if on_poll:
            on_poll(states)
        if all(ended(s) for s in states.values()):
            return states, True
        if end is not None and time.monotonic() >= end:
            return states, False
        time.sleep(poll_s if end is None else max(0.0, min(poll_s, end - time.monotonic())))


def job_state(job_id: str | None) -> str | None:
    """One job's state from ``squeue`` ("PENDING", "RUNNING", ...); "gone" when squeue does not list
    it (or fails); None without squeue or when it does not answer in 15 s."""
    if not job_id or not shutil.which("squeue"):
        return None
    try:
        r = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return None
    state = r.stdout.strip()
    if r.returncode == 0 and state:
        return state.splitlines()[0]
    return "gone"


def slurm_job_ending() -> bool:
    """Inside a Slurm job that is being cancelled, preempted or timed out? (Then a failed build was
    killed from outside: apptainer reports its killed children as a plain exit 1.)"""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return False
    m = re.search(r"JobState=(\S+)", query(["scontrol", "show", "job", job], timeout=20) or "")
    return m is not None and m.group(1) not in ("RUNNING", "COMPLETED", "FAILED")


class SlurmConfig(BaseModel):
    """How array jobs are submitted (the ``slurm`` block of a run config)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    partition: str | None = None
    """The partition (sbatch --partition); default: the cluster's."""
    account: str | None = None
    """The account (sbatch --account); default: yours."""
    qos: str | None = None
    """The QOS (sbatch --qos); default: the association's."""
    time_min: int = Field(default=60, ge=1)
    """The walltime of one array task (minutes)."""
    cpus_per_task: int = Field(default=2, ge=1)
    """Cores of one array task."""
    mem_gb: float | None = None
    """Memory of one array task (GB); default: the partition's."""
    array_parallelism: int = Field(default=64, ge=1)
    """Array tasks of one array running at once."""
    units_per_task: int = Field(default=8, ge=1)
    """Chunk size: units run by one array task."""
    setup: list[str] = Field(default_factory=list)
    """Shell lines run before each array task, e.g. ["module load apptainer"]."""
    additional_parameters: dict[str, Any] = Field(default_factory=dict)
    """Extra #SBATCH --k=v lines."""
    max_array_size: int | None = Field(default=None, ge=1)
    """Largest array; default: MaxArraySize from scontrol."""
    max_submit_jobs: int | None = Field(default=None, ge=1)
    """Most array tasks of one array queued or running at once (the rest are submitted as they end);
    the site's MaxSubmitJobs limits apply anyway (et_hpc.host.slurm_limits)."""
    max_submits_per_min: int | None = Field(default=None, ge=1)
    """Most array tasks submitted per minute: a site's cap on launches (each array task counts)."""
    max_num_timeout: int = Field(default=3, ge=0)
    """Requeues of an array task after timeout or preemption."""
    python: str | None = None
    """The interpreter on the compute nodes; default: this one."""
    wait_timeout_min: float | None = None
    """Give up watching after this long (minutes; the jobs keep running)."""
    poll_s: float = Field(default=10.0, gt=0)
    """How often the jobs' states are polled while watching (seconds)."""


SlurmOptions = SlurmConfig  # its old name


def submitit_executor(s: SlurmConfig, folder: Path | str, name: str) -> Any:
    """A submitit executor for Slurm arrays set up from ``s`` (runs and image builds both use it)."""
    import submitit

    ex = submitit.AutoExecutor(
        folder=str(folder), cluster="slurm", slurm_max_num_timeout=s.max_num_timeout, slurm_python=s.python or sys.executable
    )
    params: dict[str, Any] = {
        "name": name,
        "timeout_min": s.time_min,
        "cpus_per_task": s.cpus_per_task,
        "slurm_array_parallelism": s.array_parallelism,
        "slurm_wckey": "",
    }
    if s.mem_gb is not None:
        params["mem_gb"] = s.mem_gb
    for key in ("partition", "account", "qos"):
        if getattr(s, key):
            params[f"slurm_{key}"] = getattr(s, key)
    if s.setup:
        params["slurm_setup"] = list(s.setup)
    if s.additional_parameters:
        params["slurm_additional_parameters"] = dict(s.additional_parameters)
    try:
        ex.update_parameters(**params)
    except (ValueError, TypeError) as e:
        raise UserError(f"slurm settings rejected: {e}") from None
    return ex
