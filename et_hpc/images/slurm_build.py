"""The array task of ``et-hpc build --slurm``: build a chunk of tasks' images into the shared cache.

submitit pickles ``BuildChunk`` by its module path; ``et_hpc.images.cli.BuildChunk`` (its old
home) still resolves to it for arrays queued before it moved.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from et_hpc.images.store import ImageStore, ImageStoreConfig


class BuildChunk:
    """One array task: build a chunk of tasks' images into the shared cache; returns result dicts."""

    def __init__(self, cache_dir: Path, settings: ImageStoreConfig, base_map: dict[str, Path],
                 tasks: list[Any], retry_failed: bool, jobs: int):
        self.cache_dir, self.settings, self.base_map = cache_dir, settings, base_map
        self.tasks, self.retry_failed, self.jobs = tasks, retry_failed, jobs

    def __call__(self) -> list[dict]:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        store = ImageStore(self.cache_dir, base_map=self.base_map, settings=self.settings)
        out = store.ensure_many(self.tasks, jobs=self.jobs, progress=False, retry_failed=self.retry_failed)
        return [json.loads(r.model_dump_json()) for r in out]
