"""Image cache lookup speed: ``ImageStore.lookup`` for thousands of tasks, no builds.

Makes N synthetic native task folders (a small def; every third also copies in a file with
``%files``), a stand-in base SIF (a 64 MiB file: its digest is what the key needs) and an
image cache where every other task's image is present (an empty ``<key>.sif`` and its metadata).
Then times, with the tasks already loaded:

- cold: a new ImageStore in a new process-state (nothing memoised, no lookup index on disk);
- warm: the same store again (per-file hashes and normalised recipes memoised in memory);
- fresh process with index: a new ImageStore reading the lookup index that the cold pass saved.

    python bench/bench_cache.py --n 3000 [--write-results]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from et_hpc.images.store import ImageStore, LookupIndex
from et_hpc.tasks.loader import load_tasks

HERE = Path(__file__).resolve().parent
MARK = "## Image cache lookups (bench/bench_cache.py)"


def make_tasks(root: Path, n: int) -> None:
    for i in range(n):
        d = root / f"task_{i:06d}"
        d.mkdir(parents=True)
        (d / "task.json").write_text(json.dumps({"description": f"synthetic task {i}", "truth": "t"}))
        files = ""
        if i % 3 == 0:
            (d / "data.csv").write_text("a,b\n" + "".join(f"{j},{j * i}\n" for j in range(200)))
            files = "%files\n    data.csv /home/user/data.csv\n\n"
        (d / "container.def").write_text(
            "Bootstrap: localimage\nFrom: ./ubuntu_22.04.sif\n\n"
            + files
            + f"%post\n    mkdir -p /home/user\n    echo {i} > /home/user/n.txt\n    chmod -R 777 /home/user\n"
        )
        (d / "test_final_state.py").write_text("def test_x():\n    assert True\n")


def timed_lookups(store: ImageStore, tasks: list) -> tuple[float, dict[str, int]]:
    t = time.perf_counter()
    res = store.lookup_many(tasks)
    dt = time.perf_counter() - t
    counts: dict[str, int] = {}
    for r in res:
        counts[r.status] = counts.get(r.status, 0) + 1
    return dt, counts


CHILD = """
import json, sys, time
from pathlib import Path
from et_hpc.images.store import ImageStore, LookupIndex
from et_hpc.tasks.loader import load_tasks
root, cache, base = map(Path, sys.argv[1:4])
tasks = load_tasks(root, progress=False).tasks
store = ImageStore(cache, base_map={"./ubuntu_22.04.sif": base})
t = time.perf_counter()
res = store.lookup_many(tasks)
print(json.dumps({"seconds": time.perf_counter() - t, "cached": sum(r.status == "cached" for r in res)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=3000, help="number of task folders")
    ap.add_argument("--write-results", action="store_true", help="replace this bench's section of bench/RESULTS.md")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-cache-") as tmp:
        tmp = Path(tmp)
        root, cache = tmp / "tasks", tmp / "cache"
        make_tasks(root, a.n)
        base = tmp / "base.sif"
        base.write_bytes(os.urandom(1 << 20) * 64)
        t = time.perf_counter()
        tasks = load_tasks(root, progress=False).tasks
        t_load = time.perf_counter() - t
        bm = {"./ubuntu_22.04.sif": base}

        # Present images for every other task (what builds would have left).
        seed = ImageStore(cache, base_map=bm)
        for i, task in enumerate(tasks):
            if i % 2 == 0:
                key = seed.lookup(task).key
                seed.sif_path(key).parent.mkdir(parents=True, exist_ok=True)
                seed.sif_path(key).write_bytes(b"")
                seed.meta_path(key).write_text(json.dumps({"key": key, "digest": "0" * 64}))
        index = cache / "index"
        if index.exists():
            for p in index.iterdir():
                p.unlink()

        time.sleep(LookupIndex.RACY_S + 0.1)  # files younger than this are never indexed
        store = ImageStore(cache, base_map=bm)
        cold, counts = timed_lookups(store, tasks)
        warm, _ = timed_lookups(store, tasks)
        child = subprocess.run([sys.executable, "-c", CHILD, str(root), str(cache), str(base)], capture_output=True, text=True, check=True)
        fresh = json.loads(child.stdout)
        rows = [
            ("load_tasks (not a lookup; for scale)", t_load),
            ("cold: new store, no index (hash base + files, normalise)", cold),
            ("warm: same store again", warm),
            ("fresh process, lookup index on disk", fresh["seconds"]),
        ]
        print(f"{a.n} tasks; {counts}")
        for label, s in rows:
            print(f"{label:60s} {s:7.3f} s  {1e6 * s / a.n:7.1f} us/task")
    if a.write_results:
        load = os.getloadavg()[0]
        table = "\n".join(f"| {label} | {s:.3f} s | {1e6 * s / a.n:.0f} us |" for label, s in rows)
        section = (
            f"{MARK}\n"
            f"{a.n} synthetic native task folders (small defs, a third with a `%files` copy), a 64 MiB stand-in\n"
            f"base, images present for half (`{counts}`). 2 cores, load average {load:.1f} at the time.\n"
            f"`python bench/bench_cache.py --n {a.n} --write-results`:\n\n"
            "| lookups of all tasks | time | per task |\n|---|---|---|\n" + table + "\n\n"
            "A lookup normalises the recipe (cached by recipe, context and copied-file stats), hashes the\n"
            "copied files (cached by path, size, mtime, inode), reads the base digest from its sidecar\n"
            "and stats `<key>.sif`. The lookup index (`<cache>/index/`) lets a new process skip\n"
            "normalising and hashing when nothing changed.\n"
        )
        res = HERE / "RESULTS.md"
        text = res.read_text() if res.exists() else ""
        if MARK in text:
            start = text.index(MARK)
            nxt = text.find("\n## ", start + len(MARK))
            text = text[:start] + section + (text[nxt + 1 :] if nxt != -1 else "")
        else:
            text = text.rstrip("\n") + "\n\n" + section
        res.write_text(text)


if __name__ == "__main__":
    main()
