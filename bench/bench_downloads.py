"""Shared downloads (et_hpc.images.downloads): a fixture task built cold, then rebuilt with the cache warm.

Usage (as the unprivileged user, from the checkout):
    python bench/bench_downloads.py [--task task_000000_dfbcff7a] [--out DIR]

Builds the task's image three times into fresh caches: with the download cache off (today's
default), on and empty (cold), and on and warm (the image removed, the downloads kept). Prints
each build's seconds, the image's bytes, what the download cache holds, and whether the cache
or the bind's mount point shows up in the image (it must not).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from et_hpc.images.base import ensure_base  # noqa: E402
from et_hpc.images.store import ImageStore  # noqa: E402
from et_hpc.tasks.loader import load_tasks  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "endless-terminals"


def du(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink()) if p.exists() else 0


def listing(sif: Path) -> list[str]:
    out = subprocess.run(["unsquashfs", "-l", "-o", str(sif_offset(sif)), str(sif)], capture_output=True, text=True)
    return out.stdout.splitlines()


def sif_offset(sif: Path) -> int:
    data = sif.read_bytes()[: 1 << 20]
    return data.find(b"hsqs")


def build(cache: Path, task, downloads: str | None) -> dict:
    base = ensure_base(source="debian").path
    (cache / "base").mkdir(parents=True, exist_ok=True)
    for f in (base, base.with_suffix(".json")):
        if not (cache / "base" / f.name).exists():
            (cache / "base" / f.name).symlink_to(f)
    store = ImageStore(cache, download_cache=downloads)
    t0 = time.monotonic()
    r = store.ensure(task)
    secs = time.monotonic() - t0
    assert r.status == "built" and r.path, r
    names = listing(Path(r.path))
    return {
        "seconds": round(secs, 1),
        "image_bytes": Path(r.path).stat().st_size,
        "debs_in_image": sum(1 for n in names if n.startswith("squashfs-root/var/cache/apt/archives/") and n.endswith(".deb")),
        "pip_cache_in_image": any(n.startswith("squashfs-root/root/.cache/pip") for n in names),
        "bind_point_in_image": any(".et-hpc-downloads" in n for n in names),
        "sif": str(r.path),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="task_000000_dfbcff7a")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    src = next(p for p in FIXTURES.glob(f"*/{a.task}") if p.is_dir())
    task = load_tasks(str(src)).tasks[0]
    work = Path(a.out or tempfile.mkdtemp(prefix="bench-downloads-"))
    res = {"task": a.task, "off": build(work / "off", task, None)}
    shared = work / "downloads"
    res["cold"] = build(work / "cold", task, str(shared))
    res["downloads_bytes"] = du(shared)
    res["warm"] = build(work / "warm", task, str(shared))
    print(json.dumps(res, indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
