"""Every fixture task built step by step and whole: are the roots the same, file for file?

Usage (as the unprivileged user, with the network the fixture recipes' installs need):
    python bench/bench_roots.py [--out DIR] [--control] [--only NAME ...]

Each fixture task (native and Harbor) is built whole into a SIF (today's default) and step by
step into the CAS layout; the two roots are compared entry by entry (type, mode, owner, group,
link target, device numbers, content), the build's provenance (labels.json's build date, the
staged files' temporary directory in the def) named alike, as no two builds share them. With
``--control`` each task is built whole a second time, into another store: a path where the
stepped root differs from the first whole build is *explained* when the two whole builds differ
there too (a file each build writes anew: apt's caches and logs, ldconfig's cache). A path that
differs only between stepped and whole is a difference of the step build itself. Prints JSON
(also kept as ``DIR/roots.json``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_steps import FIXTURES, build  # noqa: E402

from et_hpc.images import build as image_build  # noqa: E402
from et_hpc.images import cas  # noqa: E402
from et_hpc.images.store import ImageStore  # noqa: E402
from et_hpc.tasks.loader import load_tasks  # noqa: E402

SHOWN = 40  # differing paths listed per task


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("/tmp/bench-roots"))
    ap.add_argument("--control", action="store_true", help="build each task whole twice")
    ap.add_argument("--only", nargs="*", default=[], help="task ids (default: every fixture task)")
    a = ap.parse_args()
    shutil.rmtree(a.out, ignore_errors=True)
    a.out.mkdir(parents=True)
    bases = ImageStore().base_map
    stepped = ImageStore(a.out / "steps", layout="cas", base_map=bases, scratch=a.out / "scratch")
    wholes = [ImageStore(a.out / f"whole{i}", base_map=bases) for i in range(2 if a.control else 1)]
    tasks = [t for kind in ("native", "harbor") for t in load_tasks(str(FIXTURES / kind)).tasks]
    tasks = [t for t in tasks if not a.only or t.id in a.only]
    res = []
    try:
        for t in tasks:
            row: dict = {"task": t.id, "kind": t.source_kind}
            row["builds"] = [build(s, t) for s in [stepped, *wholes]]
            print(json.dumps(row["builds"]), file=sys.stderr, flush=True)
            if any(b["status"] != "built" for b in row["builds"]):
                row["verdict"] = "not built both ways"
                res.append(row)
                continue
            s = cas.manifest_view(stepped.cache_dir, stepped.lookup(t).digest)
            views = [cas.sif_view(Path(w.lookup(t).path), scratch=a.out) for w in wholes]
            diff = cas.differing(s, views[0])
            row["steps"] = row["builds"][0].get("steps")
            row["entries"] = len(s)
            row["differ"] = len(diff)
            if a.control:
                noise = set(cas.differing(views[0], views[1]))
                row["whole_vs_whole"] = len(noise)
                unexplained = [p for p in diff if p not in noise]
                row["unexplained"] = unexplained[:SHOWN]
                row["verdict"] = "identical" if not diff else "same but build noise" if not unexplained else "DIFFERENT"
            else:
                row["verdict"] = "identical" if not diff else "differs"
            row["differing"] = diff[:SHOWN]
            res.append(row)
            print(json.dumps({k: row[k] for k in row if k != "builds"}), file=sys.stderr, flush=True)
    finally:
        image_build.remove_tree(a.out / "scratch")
    verdicts = [r["verdict"] for r in res]
    summary = {v: verdicts.count(v) for v in sorted(set(verdicts))}
    text = json.dumps({"tasks": res, "summary": summary}, indent=1)
    (a.out / "roots.json").write_text(text)  # what bench_steps.py --from-roots reads
    print(text)
    return 0 if "DIFFERENT" not in verdicts else 1


if __name__ == "__main__":
    sys.exit(main())
