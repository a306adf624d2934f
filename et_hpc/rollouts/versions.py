"""The policy version of a run, whichever side owns the checkpoint switch.

``publish_version`` writes the trainer's ``<run_dir>/version.json`` (versions only go up);
``version_step`` parses a label into its monotone id (the trainer's integer, or the step of an
endpoint file's ``PATH@step-N``; none for a label without a step); ``VersionReader`` reads the
trainer's file, else the endpoint file's (a directory of replicas: the highest id), re-reading
only when a file's stat changed, so checking before every claim is cheap. No file means no
trainer-owned version. Formats and the switching rule: docs/rollouts.md.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from et_hpc.errors import UserError
from et_hpc.util import atomic_write_text

VERSION_FILE = "version.json"


_STEP = re.compile(r"@step-(\d+)\b")
SWITCHING = "switching "


def version_step(label: int | str | None) -> int | None:
    """The monotone id of a version label: an integer (trainer-owned), or N of ``...@step-N``
    (vllm.sbatch); during a switch (``switching OLD -> NEW``) the older step. None when the label
    names no step (a content hash, a model name) or is None."""
    if label is None:
        return None
    if isinstance(label, int) and not isinstance(label, bool):
        return label
    s = str(label).strip()
    if s.startswith(SWITCHING):  # mid-switch: what was served before it (None when that had no step)
        return version_step(s[len(SWITCHING) :].split(" -> ")[0])
    if s.isdigit():
        return int(s)
    m = _STEP.search(s)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class PolicyVersion:
    version: int
    model: str | None = None
    checkpoint: str | None = None
    published_at: float | None = None
    label: str | None = None  # the endpoint file's model_version (source "endpoint"); else str(version)
    source: str = "trainer"  # "trainer" (version.json) or "endpoint" (vllm.sbatch's model_version)

    @property
    def name(self) -> str:
        return self.label if self.label is not None else str(self.version)


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
    return PolicyVersion(
        version=int(d["version"]), model=d.get("model"), checkpoint=d.get("checkpoint"), published_at=d.get("published_at")
    )


def publish_version(
    run_dir: Path | str, version: int | None = None, *, model: str | None = None, checkpoint: str | None = None
) -> PolicyVersion:
    """Tell producers about a new checkpoint. ``version`` default: current + 1 (first: 1).

    Groups started from now on carry this version; a lower version than the current one is
    refused (UserError), the same one only updates model/checkpoint.
    """
    cur = read_version(run_dir)
    if version is None:
        version = (cur.version + 1) if cur else 1
    if cur is not None and version < cur.version:
        raise UserError(f"version {version} is older than the run's current version {cur.version}: versions only go up")
    pv = PolicyVersion(version=int(version), model=model, checkpoint=checkpoint, published_at=time.time())
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_text(version_path(run_dir), json.dumps(pv.__dict__) + "\n")
    return pv


def endpoint_version(endpoint_file: Path | str | None = None, endpoint_dir: Path | str | None = None) -> PolicyVersion | None:
    """The server-owned version: the endpoint file's ``model_version`` with a step (a directory of
    replicas: the one with the highest step); None without a file or a step."""
    from et_hpc.agent.endpoint import read_endpoint_file

    paths: list[Path] = []
    if endpoint_file:
        paths.append(Path(endpoint_file).expanduser())
    if endpoint_dir:
        try:
            paths += sorted(p for p in Path(endpoint_dir).expanduser().glob("*.json") if not p.name.startswith("."))
        except OSError:
            pass
    best: PolicyVersion | None = None
    for p in paths:
        try:
            rec = read_endpoint_file(p)
        except (OSError, UserError, ValueError):
            continue
        label = (rec or {}).get("model_version")
        step = version_step(label)
        if step is None:
            continue
        try:
            at = os.stat(p).st_mtime
        except OSError:
            at = None
        if best is None or step > best.version:
            best = PolicyVersion(
                version=step,
                model=(rec or {}).get("model"),
                checkpoint=str(label).split("@")[0],
                published_at=at,
                label=str(label),
                source="endpoint",
            )
    return best


class VersionReader:
    """``current()``: the run's trainer-owned version (``version.json``, re-read only when the file
    changed), else the server-owned one of ``endpoint_file``/``endpoint_dir`` when given."""

    def __init__(self, run_dir: Path | str, *, endpoint_file: Path | str | None = None, endpoint_dir: Path | str | None = None):
        self.path = version_path(run_dir)
        self.endpoint_file = endpoint_file
        self.endpoint_dir = endpoint_dir
        self._key: tuple[int, int, int] | None = None  # (inode, size, mtime) of the version file read
        self._value: PolicyVersion | None = None

    def current(self) -> PolicyVersion | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._key, self._value = None, None
            if self.endpoint_file or self.endpoint_dir:
                return endpoint_version(self.endpoint_file, self.endpoint_dir)
            return None
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        if key != self._key:
            try:
                self._value = read_version(self.path.parent)
            except UserError:
                return self._value  # a torn read cannot happen (atomic rename); keep the last good one
            self._key = key
        return self._value
