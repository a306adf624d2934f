"""The agent: a loop that drives a Shell with a Policy (served model, oracle, replay or null).

Public API: ``run_agent``, ``BudgetConfig``, ``AgentResult``, ``Turn``, ``PolicyConfig``, ``make_policy``,
``OpenAIPolicy``, ``OraclePolicy``, ``ReplayPolicy``, ``NullPolicy``, ``recorded_runs``,
``resolve_endpoint``, ``Endpoint``. The loop knows only ``shell.run(command, timeout)``.
"""

from __future__ import annotations

from et_hpc.agent.endpoint import Endpoint, resolve_endpoint
from et_hpc.agent.loop import AgentResult, BudgetConfig, Turn, Usage, run_agent
from et_hpc.agent.policies import (
    Action,
    ContextLengthError,
    NullPolicy,
    OraclePolicy,
    Policy,
    PolicyConfig,
    PolicyError,
    RecordedRun,
    ReplayPolicy,
    make_policy,
    recorded_runs,
)

__all__ = [
    "Action",
    "AgentResult",
    "BudgetConfig",
    "ContextLengthError",
    "Endpoint",
    "NullPolicy",
    "OpenAIPolicy",
    "OraclePolicy",
    "Policy",
    "PolicyConfig",
    "PolicyError",
    "RecordedRun",
    "ReplayPolicy",
    "Turn",
    "Usage",
    "make_policy",
    "recorded_runs",
    "resolve_endpoint",
    "run_agent",
]


def __getattr__(name: str):  # OpenAIPolicy imports the openai package: load it on first use
    if name == "OpenAIPolicy":
        from et_hpc.agent.openai_policy import OpenAIPolicy

        return OpenAIPolicy
    raise AttributeError(name)
