"""What one episode needs: ``EpisodeConfig`` (policy, budgets, sandbox, scoring, and the run it belongs to).

A run config (the runner's ``RunConfig``) extends it with the keys of many episodes (tasks,
samples, executor, ...), so both read the same YAML keys. ``run_name()`` names the episode's run
in its record and its sandboxes; ``run_dir()`` is where a kept final state goes.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from et_hpc.agent.loop import BudgetConfig
from et_hpc.agent.policies import PolicyConfig
from et_hpc.paths import store_dir
from et_hpc.sandbox.config import SandboxConfig

_NAME_RE = re.compile(r"^[A-Za-z0-9._-]+$")
DEFAULT_SCORING_TIMEOUT_S = 120.0


class EpisodeConfig(BaseModel):
    """What one episode needs; each field's docstring is its description."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str | None = None
    """The run's name (letters, digits, '.', '_', '-'); default: the task source's (or "episodes") and the policy kind."""
    store: Path | None = None
    """The run store's root; default: $ET_HPC_STORE, else ./et-hpc-runs."""
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    """Which policy acts, and how it is reached and sampled."""
    budgets: BudgetConfig = Field(default_factory=BudgetConfig)
    """Limits of the agent's loop: turns, time, tokens, output."""
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """The episode's sandbox: its overlay, network, resource limits, image copies, binds."""
    scoring_timeout_s: float = Field(default=DEFAULT_SCORING_TIMEOUT_S, gt=0)
    """The verifier timeout: how long the final tests may run (seconds)."""

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str | None) -> str | None:
        if v is not None and not _NAME_RE.match(v):
            raise ValueError("use only letters, digits, '.', '_' and '-'")
        return v

    def run_name(self) -> str:
        """The name of the run the episode's record belongs to (``name``, else one from the policy)."""
        return self.name or re.sub(r"[^A-Za-z0-9._-]+", "-", f"episodes-{self.policy.kind}")

    def run_dir(self) -> Path:
        return Path(self.store or store_dir()).expanduser() / self.run_name()
