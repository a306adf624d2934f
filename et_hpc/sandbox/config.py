"""``SandboxConfig``: the settings of one episode's sandbox (the ``sandbox`` block of a run config)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

DEFAULT_OVERLAY_MB = 512  # writable overlay of one episode's sandbox
# container paths a user bind may not cover: the image's pristine copy (scoring) and what
# apptainer itself provides
RESERVED_DSTS = ("/", "/.et-pristine", "/proc", "/sys", "/dev", "/etc", "/.singularity.d")


def parse_bind(spec: str) -> tuple[str, str, str]:
    """``SRC[:DST][:ro|rw]`` -> (src, dst, mode); read-only unless ``rw``. Raises ValueError."""
    parts = spec.split(":")
    mode = "ro"
    if len(parts) >= 2 and parts[-1] in ("ro", "rw"):
        mode = parts.pop()
    if len(parts) == 1:
        parts.append(parts[0])
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"bind {spec!r}: expected SRC[:DST][:ro|rw] (absolute paths, no ':' in them)")
    src, dst = parts
    if "," in spec or not src.startswith("/") or not dst.startswith("/"):
        raise ValueError(f"bind {spec!r}: SRC and DST must be absolute paths without ','")
    d = "/" + dst.strip("/")
    if any(d == r or (r != "/" and d.startswith(r + "/")) for r in RESERVED_DSTS):
        raise ValueError(f"bind {spec!r}: {d} is reserved in the sandbox; bind somewhere else")
    return src, d, mode


class SandboxConfig(BaseModel):
    """One episode's sandbox. The limits need no cgroups (SECURITY.md "Limits"); the defaults fit
    4 episodes on a 2-core, 24 GB node. Each field's docstring is its description."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    overlay_mb: int = Field(default=DEFAULT_OVERLAY_MB, ge=16)
    """Size of the episode's writable overlay on node-local scratch (MB); full: ENOSPC inside the episode only."""
    writable_tmpfs: bool = False
    """Use apptainer's --writable-tmpfs (capped by its sessiondir max size, 64 MiB by default) instead of the overlay."""
    network: Literal["none", "host"] = "none"
    """none: only a loopback interface; host: the node's network."""
    memory_mb: int = Field(default=4096, ge=64)
    """The watchdog's ceiling for the instance's processes (PSS) plus its tmpfs (/dev/shm), in MB."""
    max_pids: int = Field(default=512, ge=16)
    """Processes the instance may hold (the watchdog's limit; ``ulimit -u`` in the agent's shells and
    for the final tests is 64 above it, a backstop)."""
    vmem_mb: int = Field(default=8192, ge=64)
    """Address space per process (MB): ``ulimit -v`` in the agent's shells, RLIMIT_AS for the tests."""
    fsize_mb: int = Field(default=4096, ge=1)
    """Largest file a process may write (MB): ``ulimit -f`` / RLIMIT_FSIZE."""
    watchdog_interval_s: float = Field(default=0.25, ge=0)
    """How often the watchdog looks (seconds; 0: off)."""
    local_copy: Literal["auto", "always", "never", "unpack"] = "auto"
    """Node-local images (et_hpc.images.local_copy): always copies the SIF to node-local scratch;
    unpack starts instances from the SIF's root filesystem unpacked once per node (faster starts,
    one shared page cache); never starts from the cache; auto (default) chooses per run from its
    plan (et_hpc.runner.fastpath, README "Runs"): unpack where it pays, else a copy only when the
    image cache and scratch are on different filesystems."""
    local_copy_budget_gb: float = Field(default=20.0, gt=0)
    """Node-local scratch the copies and unpacked trees may take together (GB); LRU eviction."""
    warm: int | Literal["auto"] = "auto"
    """Sandboxes started ahead per worker process for the units that run next (et_hpc.sandbox.warm);
    0: each episode starts its own; auto (default): chosen per run from its plan."""
    keep_final_state: bool = False
    """Keep what the agent changed (the episode's overlay, compressed, content-addressed) beside the
    run for 'et-hpc rescore' (et_hpc.runs.final_state). Costs the archive's time at teardown and its
    space."""
    final_state_mb: float = Field(default=64.0, gt=0)
    """A final state larger than this compressed (MB) is not kept (the record says so)."""
    binds: list[str] = Field(default_factory=list)
    """Host directories the sandboxes see: "SRC[:DST][:ro|rw]", read-only unless ":rw". The only
    way a host path gets into a sandbox: APPTAINER_BIND and the like are ignored (SECURITY.md)."""

    @field_validator("warm", mode="before")
    @classmethod
    def _check_warm(cls, v: object) -> int | str:
        if v == "auto":
            return v
        try:
            n = int(v)  # type: ignore[call-overload]
        except (TypeError, ValueError):
            n = -1
        if isinstance(v, bool) or not 0 <= n <= 64 or str(n) != str(v).strip():
            raise ValueError(f"{v!r}: give a number of sandboxes from 0 to 64, or auto")
        return n

    @field_validator("binds")
    @classmethod
    def _check_binds(cls, v: list[str]) -> list[str]:
        for b in v:
            parse_bind(b)
        return v

    def warm_count(self) -> int:
        """Sandboxes started ahead per worker process: ``warm``, 0 while it is still "auto"."""
        return self.warm if isinstance(self.warm, int) else 0

    def bind_options(self) -> list[str]:
        """The ``--bind`` options of ``binds`` for apptainer."""
        out = []
        for b in self.binds:
            src, dst, mode = parse_bind(b)
            out += ["--bind", f"{src}:{dst}:{mode}"]
        return out


SandboxOptions = SandboxConfig  # its old name
