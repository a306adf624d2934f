"""The trainer-owned policy version of a run: ``<run_dir>/version.json``.

When the trainer (not vLLM) owns the checkpoint switch, it loads new weights into the server
itself and then calls ``publish_version``. The file holds ``{"version": int, "model": str | null,
"checkpoint": str | null, "published_at": float}``; versions only go up. ``model``, when set, is
the served model name producers use for groups started under that version (e.g. a LoRA adapter
per checkpoint). Workers read it through ``VersionReader``, which re-reads the file only when its
stat (inode, size, mtime) changed, so checking before every claim is cheap.

No file means no trainer-owned version: records keep whatever the policy reported (the endpoint
file's ``model_version`` when vLLM owns the switch).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from et_hpc.errors import UserError
from et_hpc.util import atomic_write_text

VERSION_FILE = "version.json"


@dataclass(frozen=True)
class PolicyVersion:
    version: int
    model: str | None = None
    checkpoint: str | None = None
    published_at: float | None = None


def version_path(run_dir: Path | str) -> Path:
    return Path(run_dir) / VERSION_FILE


def read_version(run_dir: Path | str) -> PolicyVersion | None:
    p = version_path(run_dir)
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise UserError(f"{p} is not valid JSON ({e}): publish a version again to rewrite it") from None
    return PolicyVersion(version=int(d["version"]), model=d.get("model"), checkpoint=d.get("checkpoint"),
                         published_at=d.get("published_at"))


def publish_version(run_dir: Path | str, version: int | None = None, *, model: str | None = None,
                    checkpoint: str | None = None) -> PolicyVersion:
    """Tell producers about a new checkpoint. ``version`` default: current + 1 (first: 1).

    Groups started from now on carry this version; a lower version than the current one is
    refused (UserError), the same one only updates model/checkpoint.
    """
    cur = read_version(run_dir)
    if version is None:
        version = (cur.version + 1) if cur else 1
    if cur is not None and version < cur.version:
        raise UserError(f"version {version} is older than the run's current version {cur.version}: "
                        "versions only go up")
    pv = PolicyVersion(version=int(version), model=model, checkpoint=checkpoint, published_at=time.time())
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_text(version_path(run_dir), json.dumps(pv.__dict__) + "\n")
    return pv


class VersionReader:
    """``current()`` of a run's version file, re-read only when the file changed."""

    def __init__(self, run_dir: Path | str):
        self.path = version_path(run_dir)
        self._key: Any = None
        self._value: PolicyVersion | None = None

    def current(self) -> PolicyVersion | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._key, self._value = None, None
            return None
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        if key != self._key:
            try:
                self._value = read_version(self.path.parent)
            except UserError:
                return self._value  # a torn read cannot happen (atomic rename); keep the last good one
            self._key = key
        return self._value
