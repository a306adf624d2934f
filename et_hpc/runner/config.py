"""The run configuration: one pydantic model read from YAML, then overridden from the command line."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo

from et_hpc.episode.config import EpisodeConfig
from et_hpc.errors import UserError
from et_hpc.host.slurm import SlurmConfig, SlurmOptions  # noqa: F401  (their old home is here)
from et_hpc.sandbox.config import SandboxConfig, SandboxOptions  # noqa: F401
from et_hpc.tasks.loader import TaskSelection, TaskSelectionConfig  # noqa: F401


class ContinuousConfig(BaseModel):
    """How a continuous run produces groups (see ``et_hpc.rollouts``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    enabled: bool = False
    """Run continuously: the same as 'et-hpc run --continuous'."""
    target_groups: int | None = Field(default=None, ge=1)
    """Stop once the stream holds this many groups; default: run until stopped."""
    workers: int = Field(default=4, ge=1)
    """Slurm: long-lived array tasks (local: one in-process worker)."""
    lease_s: float = Field(default=60.0, gt=0)
    """A lease without a heartbeat for this long is requeued (seconds)."""
    heartbeat_s: float = Field(default=10.0, gt=0)
    """How often a worker renews its leases (seconds)."""
    queue_low_water: int | None = Field(default=None, ge=1)
    """Enqueue the next epoch when fewer than this many units are pending."""
    on_version_change: Literal["finish", "abandon"] = "finish"
    """What happens to units in flight when the policy version changes."""
    max_staleness: int = Field(default=1, ge=0)
    """'abandon': versions a unit may fall behind before it is requeued."""
    retries: int = Field(default=1, ge=0)
    """Reruns of an episode that ended with an error status."""
    poll_s: float = Field(default=2.0, gt=0)
    """Idle workers and the controller look again after this long (seconds)."""
    stop_grace_s: float = Field(default=120.0, gt=0)
    """How long a stop waits for workers before scancel (seconds)."""


ContinuousOptions = ContinuousConfig  # its old name


class RunConfig(EpisodeConfig):
    """An episode config (policy, budgets, sandbox, scoring: et_hpc.episode.config) plus the keys
    of many episodes: which tasks, how many samples each, where and how they run."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    tasks: TaskSelectionConfig = Field(default_factory=TaskSelectionConfig)
    """Where the tasks come from and which of them run."""
    samples: int = Field(default=1, ge=1)
    """Episodes per task (the group size)."""
    reward: Literal["binary", "fraction"] = "binary"
    """The reward rule: binary = 1 when every final test passes, else 0; fraction = passed/total."""
    executor: Literal["local", "slurm"] = "local"
    """Where the units run: threads on this node, or Slurm array tasks."""
    concurrency: int | None = Field(default=None, ge=1)
    """Episodes at once per node; default: min(2 * cores, memory in GB / 2)."""
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    """How Slurm array jobs are submitted (executor: slurm)."""
    continuous: ContinuousConfig = Field(default_factory=ContinuousConfig)
    """A continuous run's workers, queue and stop (et_hpc.rollouts)."""
    retry_errors: bool = False
    """Rerun units whose stored record is an error."""
    retries: int = Field(default=1, ge=0)
    """Reruns, at once, of an episode that ended with an error status."""
    strict: bool = False
    """Refuse to start when any task image is missing or failed to build."""
    unit_runner: str | None = Field(default=None, examples=["module:function"])
    """What runs one unit, as module:function; default: the episode itself
    (et_hpc.runner.local.episode_runner). Tests name doubles here."""

    def run_name(self) -> str:
        if self.name:
            return self.name
        src = self.tasks.source or (str(self.tasks.tasks_dir) if self.tasks.tasks_dir else "tasks")
        base = Path(src.rstrip("/")).name or "tasks"
        return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{base}-{self.policy.kind}")

    def node_concurrency(self, cores: int | None = None, mem_gb: float | None = None) -> int:
        """Episodes at once on one node: the configured value, else min(cores*2, mem_gb/2)."""
        if self.concurrency:
            return self.concurrency
        return default_concurrency(cores, mem_gb)


def _key(name: str, field: FieldInfo) -> str:
    if get_origin(field.annotation) is Literal:
        return f"{name} ({'|'.join(map(str, get_args(field.annotation)))})"
    return f"{name} ({field.examples[0]})" if field.examples else name


def config_keys(model: type[BaseModel] = RunConfig) -> list[str]:
    """The keys a run config accepts, read from the models: ``sandbox.{overlay_mb,...}`` per block."""
    out = []
    for name, f in model.model_fields.items():
        if f.exclude:  # secrets: never in a config file
            continue
        sub = f.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            inner = [_key(k, v) for k, v in sub.model_fields.items() if not v.exclude]
            out.append(f"{name}.{{{','.join(inner)}}}")
        else:
            out.append(_key(name, f))
    return out


def config_keys_text(width: int = 100) -> str:
    """``Run config keys: ...`` wrapped after commas for a help text (continuation lines indented by two)."""
    lines = [""]
    for piece in re.split(r"(?<=,)", "Run config keys: " + ", ".join(config_keys())):
        if len(lines[-1]) + len(piece) > width and lines[-1].strip():
            lines.append("  " + piece.lstrip())
        else:
            lines[-1] += piece
    return "\n".join(line.rstrip() for line in lines)


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


def apply_setting(data: dict, path: list[str], value: Any, origin: str) -> None:
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
        apply_setting(data, keys, val, origin)
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
