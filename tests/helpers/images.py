"""Image store helpers for the image tests: stores on the base image, tiny tasks, build counters."""

from __future__ import annotations

import sys
from pathlib import Path

from et_hpc.images.store import ImageStore
from et_hpc.tasks.model import Recipe, Task
from helpers import TESTS

BASE_NAME = "./ubuntu_22.04.sif"


def make_store(cache: Path, base_sif: Path, **kw) -> ImageStore:
    return ImageStore(cache, base_map={BASE_NAME: base_sif}, stale_after_s=3, **kw)


def task_at(d: Path) -> Task:
    d = Path(d)
    return Task(id=d.name, prompt="", source=d, recipe=Recipe(kind="def", path=d / "container.def", context_dir=d))


def make_task(root: Path, name: str, body: str, files: dict[str, str] | None = None) -> Task:
    d = root / name
    d.mkdir(parents=True)
    (d / "container.def").write_text(f"Bootstrap: localimage\nFrom: {BASE_NAME}\n\n{body}")
    for n, content in (files or {}).items():
        (d / n).write_text(content)
    return task_at(d)


def counting(counter: Path, extra_setup: str = "") -> str:
    return f"%setup\n    echo built >> {counter}\n{extra_setup}"


def builds(counter: Path) -> int:
    return len(counter.read_text().splitlines()) if counter.exists() else 0


def leftovers(cache: Path) -> list[Path]:
    return [p for p in (cache / "images").rglob(".tmp-*")] if (cache / "images").exists() else []


def build_processes(key: str) -> list[str]:
    """Live processes whose command line names this key's build (temp image or build dir)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if key[:12] in cmd and state != "Z":
            found.append(f"{proc.name}: {cmd[:120]}")
    return found


CHILD = """
import json, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from helpers.images import make_store, task_at
store = make_store(Path({cache!r}), Path({base!r}))
r = store.ensure(task_at(Path({src!r})))
print(json.dumps({{"status": r.status, "path": str(r.path), "reason": r.reason}}), flush=True)
"""


def child_cmd(cache: Path, base: Path, task: Task) -> list[str]:
    code = CHILD.format(tests=str(TESTS), cache=str(cache), base=str(base), tid=task.id, src=str(task.source))
    return [sys.executable, "-c", code]
