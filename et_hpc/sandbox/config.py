"""``SandboxConfig``: the settings of one episode's sandbox (the ``sandbox`` block of a run config)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_OVERLAY_MB = 512  # writable overlay of one episode's sandbox


class SandboxConfig(BaseModel):
    """One episode's sandbox. Limits (no cgroups needed; SECURITY.md "Limits"): ``memory_mb`` is
    the watchdog's ceiling for the instance's processes (PSS) plus its tmpfs (``/dev/shm``);
    ``max_pids`` the processes it may hold (``ulimit -u`` in the agent's shells and for the final
    tests is 64 above it, a backstop); ``vmem_mb``/``fsize_mb`` are per-process address space and file size
    (``ulimit -v``/``-f``); ``watchdog_interval_s`` how often the watchdog looks (0: off).
    Defaults fit 4 episodes on a 2-core, 24 GB node."""

    model_config = ConfigDict(extra="forbid")

    overlay_mb: int = Field(default=DEFAULT_OVERLAY_MB, ge=16)
    writable_tmpfs: bool = False
    network: Literal["none", "host"] = "none"
    memory_mb: int = Field(default=4096, ge=64)
    max_pids: int = Field(default=512, ge=16)
    vmem_mb: int = Field(default=8192, ge=64)
    fsize_mb: int = Field(default=4096, ge=1)
    watchdog_interval_s: float = Field(default=0.25, ge=0)
    # node-local images (et_hpc.images.local_copy): auto copies the SIF only when the image cache
    # and scratch are on different filesystems; always forces the copy; unpack starts instances
    # from the SIF's root filesystem unpacked once per node (faster starts, one shared page cache);
    # never starts from the cache
    local_copy: Literal["auto", "always", "never", "unpack"] = "auto"
    local_copy_budget_gb: float = Field(default=20.0, gt=0)
    # sandboxes started ahead per worker process for the units that run next (et_hpc.sandbox.warm);
    # 0: each episode starts its own; 2 is the recommended value (README "Runs")
    warm: int = Field(default=0, ge=0, le=64)
    # keep what the agent changed (the episode's overlay, compressed, content-addressed) beside the
    # run for 'et-hpc rescore' (et_hpc.runs.final_state); a state larger than final_state_mb
    # compressed is not kept (the record says so). Costs the archive's time at teardown and its space.
    keep_final_state: bool = False
    final_state_mb: float = Field(default=64.0, gt=0)


SandboxOptions = SandboxConfig  # its old name
