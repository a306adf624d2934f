"""The Task model: everything et-hpc knows about one Endless Terminals task.

A Task is source-agnostic: native folders, Harbor folders and SkyRL parquet rows all load into it.
``truth`` is privileged ground truth and is never shown to an agent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SourceKind = Literal["native", "harbor", "parquet"]  # what a task was loaded from


class Limits(BaseModel):
    """Per-task budgets; ``None`` means "use the run's configured default"."""

    model_config = ConfigDict(extra="forbid")

    max_turns: int | None = None
    wall_time_s: float | None = None  # agent wall time for the whole episode
    verifier_timeout_s: float | None = None  # final tests
    cpus: float | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None  # size of the per-episode writable layer


class Recipe(BaseModel):
    """How to get the task's image."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["def", "dockerfile", "sif"]
    path: Path  # container.def, environment/Dockerfile, or container.sif
    context_dir: Path  # build context (files COPY/%files refer to)


class Task(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    prompt: str
    truth: str | None = Field(default=None, repr=False)
    recipe: Recipe
    initial_tests: Path | None = None
    final_tests: Path | None = None
    solution: Path | None = None  # solution/solve.sh (reference solution)
    recorded_runs: list[Path] = Field(default_factory=list)  # solutions/*_summary.json
    limits: Limits = Field(default_factory=Limits)
    source: Path  # the task folder
    source_kind: SourceKind = "native"
    split: str | None = None
    metadata: dict = Field(default_factory=dict)  # e.g. difficulty, category, name


@dataclass
class NormalisedRecipe:
    text: str  # the def to build, as written to disk
    files: list[tuple[Path, str]]  # host files the build copies in (%files / COPY): (host abs path, dest)
    base: Path | None  # the local base SIF it starts from (resolved), if any
    rewrites: list[str]  # one human line per change made
    kind: str = "def"  # def | dockerfile | sif (sif: nothing to build, ``files[0][0]`` is the SIF)
    source: Path | None = None  # the recipe file this came from
    workdir: str | None = None  # runtime cwd the recipe asks for (Dockerfile WORKDIR)
    user: str | None = None  # runtime user the recipe asks for (Dockerfile USER); informational
    env: dict[str, str] = field(default_factory=dict)  # runtime environment set by the recipe (ENV)
    # Dockerfile recipes: %post as the converter wrote it, one span per instruction, so that step
    # builds (et_hpc.images.steps) cut it where docker would, not by reading the text again
    post_spans: PostSpans | None = None


@dataclass
class PostSpans:
    """%post of a converted Dockerfile: the lines every step runs first (``preamble``), then per
    instruction its kind (``env`` exports, ``workdir``, ``step`` for RUN/COPY/ADD), its lines and
    the ``files`` entries it copies in, then the ``epilogue`` (clean-up after the last step)."""

    preamble: list[str]
    spans: list[tuple[str, list[str], list[tuple[Path, str]]]]
    epilogue: list[str]
