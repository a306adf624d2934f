"""The array task of ``et-hpc build``: build a chunk of tasks' images into the shared cache.

Called with no argument as a Slurm array task; ``run(stop)`` in this process (the local
executor: one chunk of every task, with a progress bar; a started build is not stopped).

submitit pickles ``BuildChunk`` by its module path; ``et_hpc.images.cli.BuildChunk`` (its old
home) still resolves to it for arrays queued before it moved.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from et_hpc.images.store import ImageStore, ImageStoreConfig
from et_hpc.text import configure_logging

if TYPE_CHECKING:
    from et_hpc.images.store import Buildable


class BuildChunk:
    """One array task: build a chunk of tasks' images into the shared cache; returns result dicts."""

    progress = False  # a progress bar on stderr (set for a build in this process)
    store: ImageStore | None = None  # in this process: the caller's store (its digests already known)

    def __init__(
        self,
        cache_dir: Path,
        settings: ImageStoreConfig,
        base_map: dict[str, Path],
        tasks: Sequence[Buildable],
        retry_failed: bool,
        jobs: int,
    ):
        self.cache_dir, self.settings, self.base_map = cache_dir, settings, base_map
        self.tasks, self.retry_failed, self.jobs = tasks, retry_failed, jobs

    def __call__(self) -> list[dict]:
        configure_logging(logging.INFO)
        return self.run(threading.Event())

    def run(self, stop: threading.Event) -> list[dict]:
        store = self.store or ImageStore(self.cache_dir, base_map=self.base_map, settings=self.settings)
        out = store.ensure_many(self.tasks, jobs=self.jobs, progress=self.progress, retry_failed=self.retry_failed)
        return [json.loads(r.model_dump_json()) for r in out]
