"""The corpus at scale: N task variants in the CAS layout against today's full SIFs.

Usage (as the unprivileged user; the fixture tasks' SIFs built in the default cache first,
``et-hpc build tests/fixtures/endless-terminals/native`` and ``.../harbor``):
    python bench/bench_corpus.py [--variants 300] [--trees 40] [--pack 3] [--out DIR]

Each fixture task with a built SIF is stored in the CAS (its real root, real install prefixes).
Variant i of fixture F is F's root with its task-specific files changed (every regular file under
home/, tmp/, root/, opt/, srv/ and the recorded recipe gets a variant line; a new variant file
is added): the file delta a variant's own commands would leave. Only the delta is hashed and
stored (no apptainer build runs for a variant: see docs/images.md). Measured: store bytes, delta
seconds, node-local footprint of ``--trees`` variant trees made by ``cas_tree`` (du, hard links
counted once) against unpacked trees and SIFs, and ``--pack`` variants packed as full SIFs.
Prints JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from et_hpc.images import cas  # noqa: E402
from et_hpc.images.cas_node import cas_tree  # noqa: E402
from et_hpc.images.store import ImageStore  # noqa: E402
from et_hpc.tasks.loader import load_tasks  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "endless-terminals"
TASK_PREFIXES = ("home/", "tmp/", "root/", "opt/", "srv/", ".singularity.d/Singularity")


def du(path: Path) -> int:
    out = subprocess.run(["du", "-sk", str(path)], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0]) * 1024


def fixture_sifs() -> list[tuple[str, Path, str]]:
    """(task id, SIF, digest) of every fixture task whose SIF is in the default cache."""
    store = ImageStore()
    out = []
    for kind in ("native", "harbor"):
        for t in load_tasks(str(FIXTURES / kind)).tasks:
            r = store.lookup(t)
            if r.status == "cached" and r.path and str(r.path).endswith(".sif"):
                out.append((t.id, Path(r.path), r.digest or ""))
    return out


def variant(cache: Path, parent: list[cas.Entry], i: int, work: Path) -> tuple[str, int]:
    """Store variant ``i`` of a fixture root (its manifest ``parent``): (manifest, new bytes)."""
    entries = []
    new = 0
    for e in parent:
        if e["t"] == "f" and e["p"].startswith(TASK_PREFIXES) and e["h"]:
            data = b"".join(cas.read_object(cache, e["h"])) + f"\n# variant {i}\n".encode()
            e = {**e, "h": hashlib.sha256(data).hexdigest(), "s": len(data)}
            tmp = work / "blob"
            tmp.write_bytes(data)
            new += cas.put_object(cache, tmp, e["h"])
        entries.append(e)
    data = f"variant {i}: the task's own data\n".encode() * 64
    tmp = work / "blob"
    tmp.write_bytes(data)
    h = hashlib.sha256(data).hexdigest()
    new += cas.put_object(cache, tmp, h)
    entries.append(
        {"p": f"home/user/variant-{i}.txt", "t": "f", "m": 0o644, "u": 1000, "g": 1000, "l": None, "r": None, "h": h, "s": len(data)}
    )
    return cas.put_manifest(cache, entries), new


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", type=int, default=300)
    ap.add_argument("--trees", type=int, default=40)
    ap.add_argument("--pack", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    work = Path(a.out or tempfile.mkdtemp(prefix="bench-corpus-"))
    work.mkdir(parents=True, exist_ok=True)
    cache, scratch = work / "cache", work / "scratch"
    fixtures = fixture_sifs()
    res: dict = {"fixtures": len(fixtures), "variants": a.variants}
    t0, c0 = time.monotonic(), time.process_time()
    mans: list[tuple[str, list[cas.Entry], int]] = []
    for tid, sif, _ in fixtures:
        man, _ = cas.ingest_sif(cache, sif, scratch=work)
        mans.append((tid, cas.read_manifest(cache, man), sif.stat().st_size))
    res["fixture_ingest_s"] = round(time.monotonic() - t0, 1)
    res["fixture_ingest_cpu_s"] = round(time.process_time() - c0, 1)
    res["fixture_sif_bytes"] = sum(m[2] for m in mans)
    res["cas_bytes_fixtures"] = cas.copy_tree_bytes(cache)
    t0, c0 = time.monotonic(), time.process_time()
    refs, sif_bytes = [], 0
    for i in range(a.variants):
        tid, parent, size = mans[i % len(mans)]
        man, _ = variant(cache, parent, i, work)
        key = f"{i:064x}"
        ref = cache / "images" / key[:2] / f"{key}.cas"
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(json.dumps({"key": key, "manifest": man}))
        ref.with_suffix(".json").write_text(json.dumps({"key": key, "digest": man, "task_ids": [f"{tid}-v{i}"]}))
        refs.append((ref, man, size))
        sif_bytes += size  # a variant's full SIF: its fixture's (the delta is a few kB)
    res["variant_delta_s"] = round(time.monotonic() - t0, 1)
    res["variant_delta_cpu_s"] = round(time.process_time() - c0, 1)
    res["cas_bytes_total"] = cas.copy_tree_bytes(cache)
    res["cas_disk_bytes_total"] = du(cache / "cas")  # blocks: small files round up
    res["sif_bytes_projected"] = sif_bytes
    res["ratio_sif_over_cas"] = round(sif_bytes / res["cas_bytes_total"], 1)
    # node-local: trees made from the store on one node
    t0 = time.monotonic()
    setup = []
    for ref, man, _ in refs[: a.trees]:
        t = time.monotonic()
        cas_tree(ref, man, scratch=scratch, budget_gb=1000).release()
        setup.append(time.monotonic() - t)
    res["trees"] = len(setup)
    res["tree_first_s"] = [round(x, 2) for x in setup[: len(fixtures)]]
    res["tree_later_s_mean"] = round(sum(setup[len(fixtures) :]) / max(1, len(setup) - len(fixtures)), 2)
    res["node_bytes_trees"] = du(scratch / "images")
    res["node_bytes_unpacked_each"] = {tid: sum(e.get("s") or 0 for e in p if e["t"] == "f") for tid, p, _ in mans}
    res["node_bytes_as_sifs"] = sum(s for _, _, s in refs[: a.trees])
    # today's path for a sample: pack a variant's tree as a full SIF
    packs = []
    for ref, man, _ in refs[: a.pack]:
        img = cas_tree(ref, man, scratch=scratch, budget_gb=1000)
        out = work / f"pack-{man[:8]}.sif"
        t, c = time.monotonic(), os.times()
        subprocess.run(["apptainer", "build", "--force", str(out), str(img)], capture_output=True, check=True)
        c2 = os.times()
        packs.append(
            {
                "s": round(time.monotonic() - t, 1),
                "cpu_s": round(c2.children_user + c2.children_system - c.children_user - c.children_system, 1),
                "bytes": out.stat().st_size,
            }
        )
        out.unlink()
        img.release()
    res["sif_pack_sample"] = packs
    n = 3255
    res["projection_3255"] = {
        "sif_bytes": round(sif_bytes / a.variants * n),
        "cas_bytes": round(res["cas_bytes_fixtures"] + (res["cas_bytes_total"] - res["cas_bytes_fixtures"]) / a.variants * n),
    }
    print(json.dumps(res, indent=1))
    if a.out is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
