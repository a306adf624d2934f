"""The run configuration: one pydantic model read from YAML, then overridden from the command line."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from et_hpc.agent.loop import Budgets
from et_hpc.agent.policies import PolicyConfig
from et_hpc.errors import UserError
from et_hpc.paths import store_dir
from et_hpc.rollouts.options import ContinuousOptions

_NAME_RE = re.compile(r"^[A-Za-z0-9._-]+$")


class TaskSelection(BaseModel):
    """Where tasks come from and which of them to run (passed to ``load_tasks``)."""

    model_config = ConfigDict(extra="forbid")

    source: str | None = None  # a task folder tree, a parquet file or a dataset name
    tasks_dir: Path | None = None
    ids: list[str] | None = None
    glob: str | None = None
    split: str | None = None
    sample: int | None = None  # pick this many tasks at random
    seed: int = 0


class SandboxOptions(BaseModel):
    """One episode's sandbox. Limits (no cgroups needed; SECURITY.md "Limits"): ``memory_mb`` is
    the watchdog's ceiling for the instance's processes (PSS) plus its tmpfs (``/dev/shm``);
    ``max_pids`` the processes it may hold (``ulimit -u`` in the agent's shells and for the final
    tests is 64 above it, a backstop); ``vmem_mb``/``fsize_mb`` are per-process address space and file size
    (``ulimit -v``/``-f``); ``watchdog_interval_s`` how often the watchdog looks (0: off).
    Defaults fit 4 episodes on a 2-core, 24 GB node."""

    model_config = ConfigDict(extra="forbid")

    overlay_mb: int = Field(default=512, ge=16)
    writable_tmpfs: bool = False
    network: Literal["none", "host"] = "none"
    memory_mb: int = Field(default=4096, ge=64)
    max_pids: int = Field(default=512, ge=16)
    vmem_mb: int = Field(default=8192, ge=64)
    fsize_mb: int = Field(default=4096, ge=1)
    watchdog_interval_s: float = Field(default=0.25, ge=0)
    # node-local SIF copies (et_hpc.images.local_copy): auto copies only when the image cache and
    # scratch are on different filesystems; always forces it; never starts from the cache
    local_copy: Literal["auto", "always", "never"] = "auto"
    local_copy_budget_gb: float = Field(default=20.0, gt=0)
    # sandboxes started ahead per worker process for the units that run next (et_hpc.sandbox.warm);
    # 0: each episode starts its own; 2 is the recommended value (README "Runs")
    warm: int = Field(default=0, ge=0, le=64)


class SlurmOptions(BaseModel):
    """How array jobs are submitted. ``time_min`` is the walltime of one array task."""

    model_config = ConfigDict(extra="forbid")

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_min: int = Field(default=60, ge=1)
    cpus_per_task: int = Field(default=2, ge=1)
    mem_gb: float | None = None
    array_parallelism: int = Field(default=64, ge=1)
    units_per_task: int = Field(default=8, ge=1)  # chunk size: units run by one array task
    setup: list[str] = Field(default_factory=list)  # e.g. ["module load apptainer"]
    additional_parameters: dict[str, Any] = Field(default_factory=dict)  # extra #SBATCH --k=v
    max_array_size: int | None = Field(default=None, ge=1)  # default: MaxArraySize from scontrol
    # most array tasks one submission may queue; default: what MaxJobCount and the QOS/association
    # MaxSubmitJobs limits leave free (et_hpc.runner.slurm.submit_limits)
    max_submit_jobs: int | None = Field(default=None, ge=1)
    max_num_timeout: int = Field(default=3, ge=0)  # requeues after timeout/preemption
    python: str | None = None  # interpreter on the compute nodes (default: this one)
    wait_timeout_min: float | None = None  # give up watching after this long (jobs keep running)
    poll_s: float = Field(default=10.0, gt=0)


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    store: Path | None = None
    tasks: TaskSelection = Field(default_factory=TaskSelection)
    samples: int = Field(default=1, ge=1)  # episodes per task (group size)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    budgets: Budgets = Field(default_factory=Budgets)
    sandbox: SandboxOptions = Field(default_factory=SandboxOptions)
    scoring_timeout_s: float = Field(default=120.0, gt=0)
    executor: Literal["local", "slurm"] = "local"
    concurrency: int | None = Field(default=None, ge=1)  # episodes at once per node
    slurm: SlurmOptions = Field(default_factory=SlurmOptions)
    continuous: ContinuousOptions = Field(default_factory=ContinuousOptions)  # et_hpc.rollouts
    retry_errors: bool = False  # rerun units whose stored record is an error
    retries: int = Field(default=1, ge=0)  # reruns, at once, of an episode that ended with an error status
    strict: bool = False  # refuse to start when any task image is missing or failed to build
    unit_runner: str = "et_hpc.runner.local:episode_runner"  # module:function

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str | None) -> str | None:
        if v is not None and not _NAME_RE.match(v):
            raise ValueError("use only letters, digits, '.', '_' and '-'")
        return v

    def run_name(self) -> str:
        if self.name:
            return self.name
        src = self.tasks.source or (str(self.tasks.tasks_dir) if self.tasks.tasks_dir else "tasks")
        base = Path(src.rstrip("/")).name or "tasks"
        return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{base}-{self.policy.kind}")

    def run_dir(self) -> Path:
        return Path(self.store or store_dir()).expanduser() / self.run_name()

    def node_concurrency(self, cores: int | None = None, mem_gb: float | None = None) -> int:
        """Episodes at once on one node: the configured value, else min(cores*2, mem_gb/2)."""
        if self.concurrency:
            return self.concurrency
        return default_concurrency(cores, mem_gb)


def default_concurrency(cores: int | None = None, mem_gb: float | None = None) -> int:
    if cores is None:
        env = os.environ.get("SLURM_CPUS_PER_TASK") or os.environ.get("SLURM_CPUS_ON_NODE")
        cores = int(env) if env and env.isdigit() else (len(os.sched_getaffinity(0)) or 1)
    if mem_gb is None:
        env = os.environ.get("SLURM_MEM_PER_NODE")  # MB
        if env and env.isdigit():
            mem_gb = int(env) / 1024
        else:
            mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return max(1, min(cores * 2, int(mem_gb / 2)))


def parse_set(items: list[str] | None) -> list[tuple[list[str], Any]]:
    """``["a.b=1", "c=x"]`` -> ``[(["a","b"], 1), (["c"], "x")]``.

    Values are read as YAML scalars (numbers, booleans, ``[a, b]`` lists); an empty value is None.
    """
    out = []
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--set {item!r}: expected KEY=VALUE, e.g. --set policy.kind=oracle")
        try:
            val = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            val = raw
        if val is None and raw.strip():
            val = raw.strip()  # "policy.kind=null" means the null policy; "key=" (empty) means None
        out.append(([k for k in key.strip().split(".")], val))
    return out


def _apply(data: dict, path: list[str], value: Any, origin: str) -> None:
    cur = data
    for k in path[:-1]:
        nxt = cur.get(k)
        if nxt is None:
            nxt = cur[k] = {}
        elif not isinstance(nxt, dict):
            if hasattr(nxt, "model_dump"):
                nxt = cur[k] = nxt.model_dump()
            else:
                raise UserError(f"{origin}: key {'.'.join(path)!r}: {k!r} is not a section")
        cur = nxt
    cur[path[-1]] = value


def load_config(path: Path | str | None = None, overrides: list[tuple[list[str], Any]] | None = None) -> RunConfig:
    """Read ``path`` (YAML; may be None), apply ``overrides``, validate. Errors are one-line UserErrors."""
    data: dict[str, Any] = {}
    origin = str(path) if path else "run config"
    if path:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise UserError(f"cannot read run config {p}: {e.strerror or e}") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            raise UserError(f"{p}:{where} is not valid YAML: {getattr(e, 'problem', e)}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise UserError(f"{p}: expected a mapping of settings at the top level, got {type(loaded).__name__}")
        data = loaded
    for keys, val in overrides or []:
        _apply(data, keys, val, origin)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(x) for x in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown setting (see 'et-hpc run --help' for the settings)"
        more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
        raise UserError(f"{origin}: {key}: {msg}{more}") from None


def config_to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
