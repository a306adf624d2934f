"""Settings of a continuous run (the ``continuous`` block of the run config)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ContinuousOptions(BaseModel):
    """How a continuous run produces groups (see ``et_hpc.rollouts``)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False  # same as 'et-hpc run --continuous'
    target_groups: int | None = Field(default=None, ge=1)  # stop once the stream holds this many groups
    workers: int = Field(default=4, ge=1)  # slurm: long-lived array tasks (local: one in-process worker)
    lease_s: float = Field(default=60.0, gt=0)  # a lease without a heartbeat for this long is requeued
    heartbeat_s: float = Field(default=10.0, gt=0)
    queue_low_water: int | None = Field(default=None, ge=1)  # enqueue the next epoch below this many pending
    on_version_change: Literal["finish", "abandon"] = "finish"  # units in flight when the version changes
    max_staleness: int = Field(default=1, ge=0)  # 'abandon': versions a unit may fall behind before it is requeued
    retries: int = Field(default=1, ge=0)  # reruns of an episode that ended with an error status
    poll_s: float = Field(default=2.0, gt=0)  # idle workers and the controller look again after this long
    stop_grace_s: float = Field(default=120.0, gt=0)  # how long a stop waits for workers before scancel
