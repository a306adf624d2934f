"""Which layered store: the issue's three candidates measured on real task images.

Usage (as the unprivileged user):
    python bench/bench_layout.py BASE.sif TASK.sif [TASK.sif ...]

Unpacks each SIF's root, then measures, all with apptainer's squashfs compression (gzip):
- ``full``: today's store, one whole SIF per task (their sizes);
- ``deltas``: the base SIF plus, per task, a squashfs of the files that differ from the base (what
  a read-only ``--overlay`` stack would hold; files the task deleted would need whiteouts);
- ``cas``: a file-level content-addressed store, each distinct file content once (a squashfs of the
  distinct blobs stands in for the compressed blob store), plus one manifest per task;
- ``one_squashfs``: all task roots in one squashfs (mksquashfs deduplicates identical files).
Prints JSON: bytes of each, seconds each packing took, and the per-task delta sizes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def unpack(sif: Path, dest: Path) -> None:
    off = sif.read_bytes()[: 1 << 20].find(b"hsqs")
    dest.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["unsquashfs", "-o", str(off), "-no-xattrs", "-ignore-errors", "-quiet", "-no-progress", "-d", str(dest), str(sif)],
        capture_output=True,
        check=False,
    )
    subprocess.run(["chmod", "-R", "u+rwX", str(dest)], capture_output=True, check=False)  # files of mode 000: readable to pack


def files(root: Path) -> dict[str, tuple[str, int, int]]:
    """relative path -> (sha256 or link target, size, mode) of every regular file and symlink."""
    out = {}
    for d, _dirs, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = ("link:" + os.readlink(p), 0, st.st_mode)
            elif os.path.isfile(p):
                h = hashlib.sha256()
                with open(p, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        h.update(chunk)
                out[rel] = (h.hexdigest(), st.st_size, st.st_mode)
    return out


def squash(src: Path, out: Path) -> tuple[int, float]:
    t0 = time.monotonic()
    subprocess.run(
        ["mksquashfs", str(src), str(out), "-noappend", "-comp", "gzip", "-quiet", "-no-progress", "-no-xattrs"],
        check=True,
        capture_output=True,
    )
    return out.stat().st_size, time.monotonic() - t0


def main() -> None:
    base_sif, tasks = Path(sys.argv[1]), [Path(a) for a in sys.argv[2:]]
    work = Path(tempfile.mkdtemp(prefix="bench-layout-"))
    try:
        unpack(base_sif, work / "base")
        base = files(work / "base")
        roots = {}
        for i, t in enumerate(tasks):
            unpack(t, work / "roots" / f"t{i}")
            roots[f"t{i}"] = files(work / "roots" / f"t{i}")
        res: dict = {"tasks": len(tasks), "base_bytes": base_sif.stat().st_size}
        res["full"] = res["base_bytes"] + sum(t.stat().st_size for t in tasks)
        # deltas: the files of each task that are not byte-identical in the base
        deltas, delta_s, deleted = [], 0.0, []
        for name, fs in roots.items():
            d = work / "delta" / name
            for rel, (h, _size, _mode) in fs.items():
                if base.get(rel, (None,))[0] != h:
                    src, dst = work / "roots" / name / rel, d / rel
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    os.link(src, dst, follow_symlinks=False)
            d.mkdir(parents=True, exist_ok=True)
            size, s = squash(d, work / f"delta-{name}.sqfs")
            deltas.append(size)
            delta_s += s
            deleted.append(sum(1 for rel in base if rel not in fs))
        res["deltas"] = res["base_bytes"] + sum(deltas)
        res["delta_bytes_each"] = deltas
        res["delta_pack_s_each"] = round(delta_s / len(tasks), 1)
        res["base_files_deleted_by_task"] = deleted
        # cas: every distinct content once
        blobs = work / "blobs"
        blobs.mkdir()
        seen: dict[str, int] = {}
        for name, fs in [("base", base), *roots.items()]:
            rootdir = work / "base" if name == "base" else work / "roots" / name
            for rel, (h, size, _mode) in fs.items():
                if h.startswith("link:") or h in seen:
                    continue
                seen[h] = size
                os.link(rootdir / rel, blobs / h)
        blob_size, blob_s = squash(blobs, work / "blobs.sqfs")
        manifests = sum(len(json.dumps(fs)) for fs in roots.values())
        res["cas"] = blob_size + manifests
        res["cas_distinct_files"] = len(seen)
        res["cas_distinct_raw_bytes"] = sum(seen.values())
        res["cas_manifest_bytes"] = manifests
        res["cas_pack_s"] = round(blob_s, 1)
        # one squashfs holding every task root
        try:
            size, s = squash(work / "roots", work / "all.sqfs")
            res["one_squashfs"] = size + res["base_bytes"]
            res["one_squashfs_pack_s"] = round(s, 1)
        except subprocess.CalledProcessError as e:
            res["one_squashfs"] = f"mksquashfs failed: {(e.stderr or b'').decode(errors='replace').strip()[-300:]}"
        res["raw_root_bytes_each"] = [sum(v[1] for v in fs.values()) for fs in roots.values()]
        print(json.dumps(res, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
