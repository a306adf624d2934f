"""Episode setup and scoring from CAS trees against today's default path (the store's SIF).

Usage (as the unprivileged user; the demo images built in the default cache, ``et-hpc build defs/demo``):
    python bench/bench_cas_episodes.py [--samples 3] [--rounds 2] [--out DIR]

Makes a cache of the CAS layout holding the demo tasks' images (their SIFs converted with
``ImageStore.convert``), then runs ``et-hpc run defs/demo --policy oracle`` on the default cache
and on the CAS cache, alternately, ``--rounds`` times each (the first CAS round makes the node's
trees, later ones reuse them), and prints the mean ``setup_s`` and ``score_s`` of the episodes and
the rewards, per layout and round, as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from et_hpc.images.store import ImageStore  # noqa: E402
from et_hpc.record import records_from_table  # noqa: E402
from et_hpc.runs.store import RunStore  # noqa: E402
from et_hpc.tasks.loader import load_tasks  # noqa: E402

DEMO = Path(__file__).resolve().parent.parent / "defs" / "demo"


def cas_cache(root: Path) -> Path:
    sifs = ImageStore()
    cache = root / "cas-cache"
    (cache / "base").mkdir(parents=True, exist_ok=True)
    for p in (sifs.cache_dir / "base").glob("ubuntu_22.04.*"):
        if p.suffix in (".sif", ".json"):
            shutil.copy2(p, cache / "base" / p.name)
    store = ImageStore(cache)
    for t in load_tasks(str(DEMO)).tasks:
        r, key = sifs.lookup(t), store.lookup(t).key
        if r.status != "cached" or not r.path or not key:
            sys.exit(f"{t.id}: no image in the default cache ({r.status}); run 'et-hpc build {DEMO}'")
        if store.lookup(t).status != "cached":
            for src, dst in ((Path(r.path), store.sif_path(key)), (sifs.meta_path(r.key or ""), store.meta_path(key))):
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)
            store.convert(key)
    return cache


def run(name: str, cache: Path | None, store: Path, samples: int) -> dict:
    env = dict(os.environ, ET_HPC_STORE=str(store))
    if cache is not None:
        env["ET_HPC_CACHE"] = str(cache)
    cmd = ["et-hpc", "run", str(DEMO), "--policy", "oracle", "--run-name", name, "--samples", str(samples), "--concurrency", "1"]
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    recs = records_from_table(RunStore(store / name).read())
    setup = [r.timings.setup_s for r in recs if r.timings.setup_s is not None]
    score = [r.timings.score_s for r in recs if r.timings.score_s is not None]
    return {
        "episodes": len(recs),
        "rewards": sorted({r.reward for r in recs}, key=str),
        "setup_s_mean": round(statistics.mean(setup), 3),
        "setup_s_median": round(statistics.median(setup), 3),
        "score_s_mean": round(statistics.mean(score), 3),
        "score_s_median": round(statistics.median(score), 3),
        "image": recs[0].image_path,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    root = Path(a.out or tempfile.mkdtemp(prefix="bench-cas-ep-"))
    cache = cas_cache(root)
    out = {}
    for i in range(a.rounds):
        out[f"sif-{i}"] = run(f"sif-{i}", None, root / "store", a.samples)
        out[f"cas-{i}"] = run(f"cas-{i}", cache, root / "store", a.samples)
    print(json.dumps(out, indent=1))
    if a.out is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
