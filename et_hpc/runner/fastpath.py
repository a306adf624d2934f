"""The automatic choice of ``sandbox.warm`` and ``sandbox.local_copy`` ("auto", the defaults).

``choose(cfg, units, images)`` reads the run's plan (episodes per image on each node, episodes at
once against the cores, the images' sizes): ``local_copy`` is ``unpack`` when the episodes per image
on a node save more (``SAVED_S_PER_EPISODE`` each, bench/RESULTS.md) than unpacking costs
(``UNPACK_S_PER_MB``, nothing for a tree already there), ``unsquashfs`` exists and the trees fit in
scratch, else ``auto``; ``warm`` is ``WARM`` when a worker runs more than one episode and leaves a
core for starts ahead, else 0. Explicit settings win. A node is the local executor's whole plan, a
Slurm array task's units (on its own cores) or a continuous worker's groups of ``samples``.
``resolve(cfg, choice)`` applies the choice.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

from et_hpc.runner.config import RunConfig

SAVED_S_PER_EPISODE = 0.4  # setup + scoring saved per episode started from an unpacked tree
UNPACK_S_PER_MB = 1.2 / 90  # unpacking a SIF's root filesystem, per MB of SIF, once per node
TREE_FACTOR = 3.0  # an unpacked tree takes about 3x its SIF's size
WARM = 2  # the measured best (README "Runs")


def _cores(cfg: RunConfig) -> int:
    if cfg.executor == "slurm":
        return max(1, cfg.slurm.cpus_per_task or 1)
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _tree_exists(img: Any, scratch: Path | None) -> bool:
    """True when this node already holds ``img`` unpacked (a later run pays nothing for it)."""
    from et_hpc.images.local_copy import TREE, images_dir, norm_digest

    digest = getattr(img, "digest", None)
    if not digest:
        return False
    try:
        return (images_dir(scratch) / f"{norm_digest(digest)}{TREE}").is_dir()
    except (ValueError, OSError):
        return False


def _per_node(cfg: RunConfig, units: list[tuple[str, int]]) -> list[Counter]:
    """Episodes per task (image) on each node, as the executor spreads the units."""
    if cfg.continuous.enabled:
        return [Counter({tid: cfg.samples for tid, _ in units})]  # a worker runs whole groups
    if cfg.executor == "slurm":
        n = max(1, cfg.slurm.units_per_task)
        return [Counter(tid for tid, _ in units[i : i + n]) for i in range(0, len(units), n)]
    return [Counter(tid for tid, _ in units)]


def choose(cfg: RunConfig, units: list[tuple[str, int]], images: dict[str, Any], scratch: Path | None = None) -> dict[str, Any]:
    """What "auto" means for this run: ``{"warm": K, "local_copy": MODE, "why": {...}, ...}``."""
    sb = cfg.sandbox
    cores = _cores(cfg)
    conc = cfg.node_concurrency(cores=cores)
    nodes = _per_node(cfg, units)
    out: dict[str, Any] = {"cores": cores, "concurrency": conc, "why": {}}
    out["warm"], out["why"]["warm"] = _choose_warm(cfg, nodes, cores, conc)
    if sb.local_copy != "auto":
        out["local_copy"], out["why"]["local_copy"] = sb.local_copy, "set in the run config"
        return out
    out["local_copy"] = "auto"
    sizes = _sif_sizes_mb(images)
    saved = cost = 0.0
    for node in nodes:
        for tid, n in node.items():
            if tid not in sizes:
                continue
            saved += n * SAVED_S_PER_EPISODE
            if not _tree_exists(images[tid], scratch):
                cost += sizes[tid] * UNPACK_S_PER_MB
    per_node_mb = max((sum(sizes.get(t, 0.0) for t in node) for node in nodes), default=0.0) * TREE_FACTOR
    out["unpack"] = {"saved_s": round(saved, 2), "cost_s": round(cost, 2), "trees_mb": round(per_node_mb)}
    if not sizes:
        out["why"]["local_copy"] = "no image to unpack"
    elif saved <= cost:
        eps = max((max(c.values(), default=0) for c in nodes), default=0)
        out["why"]["local_copy"] = (
            f"unpacking would cost {cost:.1f} s and save {saved:.1f} s ({eps} episode(s) per image per node at most): starts from the SIF"
        )
    else:
        out["local_copy"], out["why"]["local_copy"] = _choose_unpack(cfg, saved, cost, per_node_mb, scratch)
    return out


def _choose_warm(cfg: RunConfig, nodes: list[Counter], cores: int, conc: int) -> tuple[int, str]:
    """``sandbox.warm`` and why: the run config's, else ``WARM`` when a worker runs more than one
    episode and the episodes at once leave a core for starts ahead, else 0."""
    if cfg.sandbox.warm != "auto":
        return cfg.sandbox.warm, "set in the run config"
    per_worker = max((sum(c.values()) for c in nodes), default=0)
    if cfg.continuous.enabled:
        per_worker = max(per_worker, 2)  # a continuous worker keeps going
    if per_worker < 2:
        return 0, "one episode per worker: nothing to start ahead"
    if conc > cores:
        return 0, f"{conc} episodes at once on {cores} cores leave none for starts ahead"
    return WARM, f"{per_worker} episodes per worker, {conc} at once on {cores} cores"


def _sif_sizes_mb(images: dict[str, Any]) -> dict[str, float]:
    """Each task's image size in MB (tasks whose image has no readable path are left out)."""
    sizes: dict[str, float] = {}
    for tid, img in images.items():
        try:
            sizes[tid] = Path(img.path).stat().st_size / 2**20
        except (AttributeError, TypeError, OSError):
            continue
    return sizes


def _choose_unpack(cfg: RunConfig, saved: float, cost: float, per_node_mb: float, scratch: Path | None) -> tuple[str, str]:
    """``local_copy`` and why, once unpacking saves more than it costs: ``unpack`` when
    ``unsquashfs`` is there and the trees fit in half the free scratch and the budget, else ``auto``."""
    if not shutil.which("unsquashfs"):
        return "auto", "unsquashfs (squashfs-tools) is not on PATH: starts from the SIF"
    from et_hpc.paths import scratch_dir

    try:
        free_mb = shutil.disk_usage(scratch or scratch_dir()).free / 2**20
    except OSError:
        free_mb = 0.0
    budget_mb = cfg.sandbox.local_copy_budget_gb * 1024
    if per_node_mb > min(free_mb / 2, budget_mb):
        return "auto", (
            f"the unpacked trees need about {per_node_mb:.0f} MB: more than half the free "
            f"scratch ({free_mb:.0f} MB) or the budget ({budget_mb:.0f} MB)"
        )
    return "unpack", f"unpacking costs {cost:.1f} s and saves {saved:.1f} s per run"


def resolve(cfg: RunConfig, choice: dict[str, Any]) -> RunConfig:
    """``cfg`` with the chosen ``sandbox.warm`` and ``sandbox.local_copy``."""
    sb = cfg.sandbox.model_copy(update={"warm": choice["warm"], "local_copy": choice["local_copy"]})
    return cfg.model_copy(update={"sandbox": sb})


def check_binds(cfg: RunConfig) -> None:
    """``UserError`` when a ``sandbox.binds`` source does not exist here (every episode would fail)."""
    from et_hpc.errors import UserError
    from et_hpc.sandbox.config import parse_bind

    for b in cfg.sandbox.binds:
        src = parse_bind(b)[0]
        if not os.path.exists(src):
            raise UserError(f"sandbox.binds: {src} does not exist on this host (bind {b!r})")
