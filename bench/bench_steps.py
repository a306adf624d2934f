"""Step builds against whole builds, on real recipes built by real apptainer.

Usage (as the unprivileged user, with the network the fixture recipes' installs need):
    python bench/bench_steps.py [--fixtures 6] [--variants 10] [--out DIR]

Variant i of a fixture task is its recipe with one more task-specific command at the end (native:
a last ``%post`` line; Harbor: a last ``RUN``), which writes a file naming the variant: its install
prefix is the fixture's own. Each fixture's first variant is built whole (today's SIF layout) and
every variant is built step by step (the CAS layout): the first of a fixture builds its install
steps, the others reuse them. Then one variant whose steps all exist (its recipe differs only in a
comment) is built again. Measured per build: wall seconds and CPU seconds (this process's waited
children: apptainer, its helpers, the namespace ingests), and the bytes each layout keeps.
Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from et_hpc.images.store import ImageStore  # noqa: E402
from et_hpc.tasks.loader import load_tasks  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "endless-terminals"


def du(path: Path) -> int:
    if not path.exists():
        return 0
    out = subprocess.run(["du", "-sk", str(path)], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0]) * 1024


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def make_variant(src: Path, dest: Path, i: int, comment: bool = False) -> None:
    """Variant ``i`` of the task folder ``src`` in ``dest`` (``comment``: and a comment line more)."""
    shutil.copytree(src, dest)
    line = f"echo 'variant {i}' > /root/.et-variant"
    df = dest / "environment" / "Dockerfile"
    if df.is_file():
        text = df.read_text().rstrip("\n")
        users = re.findall(r"(?im)^USER\s+(\S+)", text)
        if users and users[-1] not in ("root", "0"):  # /root as root, then the recipe's own user again
            text += f"\nUSER root\nRUN {line}\nUSER {users[-1]}\n"
        else:
            text += f"\nRUN {line}\n"
        if comment:
            text = text.replace("\nRUN ", "\n# a comment\nRUN ", 1)
        df.write_text(text)
        return
    d = dest / "container.def"
    lines = d.read_text().splitlines()
    post = next(n for n, ln in enumerate(lines) if ln.startswith("%post"))
    end = next((n for n in range(post + 1, len(lines)) if re.match(r"^%[a-z]", lines[n])), len(lines))
    while end > post + 1 and not lines[end - 1].strip():
        end -= 1
    lines.insert(end, f"    {line}")
    if comment:
        lines.insert(post + 1, "    # a comment")
    d.write_text("\n".join(lines) + "\n")


def build(store: ImageStore, task) -> dict:
    t, c = time.monotonic(), cpu()
    r = store.ensure(task)
    out = {"task": task.id, "status": r.status, "wall_s": round(time.monotonic() - t, 2), "cpu_s": round(cpu() - c, 2)}
    if r.key and store.meta_path(r.key).is_file():
        meta = json.loads(store.meta_path(r.key).read_text())
        out.update({k: meta[k] for k in ("steps", "steps_built", "steps_reused", "size") if k in meta})
    if r.status != "built":
        out["reason"] = r.reason
    return out


def more(a: argparse.Namespace) -> int:
    """New variants of the fixtures an earlier run built, step by step, on its step cache."""
    stepped = ImageStore(a.out / "steps", layout="cas", base_map=ImageStore().base_map)
    out = []
    for root in sorted((a.out / "tasks").iterdir()):
        src = FIXTURES / root.name.split("-", 1)[0] / root.name.split("-", 1)[1]
        have = len(list(root.glob("*_v*")))
        for i in range(have, have + a.more):
            make_variant(src, root / f"{src.name}_v{i}", i)
        tasks = {t.id: t for t in load_tasks(str(root)).tasks}
        if not (stepped.cache_dir / "steps").is_dir() or stepped.lookup(tasks[f"{src.name}_v0"]).status != "cached":
            continue  # a fixture the first run could not build
        for i in range(have, have + a.more):
            b = build(stepped, tasks[f"{src.name}_v{i}"])
            b["fixture"], b["variant"] = src.name, i
            out.append(b)
            print(json.dumps({"stepped": b}), file=sys.stderr, flush=True)
    ok = [b for b in out if b["status"] == "built"]
    print(
        json.dumps(
            {
                "builds": out,
                "summary": {
                    "built": len(ok),
                    "failed": len(out) - len(ok),
                    "cpu_s_mean": round(sum(b["cpu_s"] for b in ok) / max(1, len(ok)), 2),
                    "wall_s_mean": round(sum(b["wall_s"] for b in ok) / max(1, len(ok)), 2),
                    "builds_per_hour": round(3600 * len(ok) / max(1e-9, sum(b["wall_s"] for b in out)), 1),
                },
            },
            indent=1,
        )
    )
    return 0


def from_roots(a: argparse.Namespace) -> int:
    """``--variants`` variants of every fixture a bench_roots.py run built both ways, step by step
    on that run's step cache. A fixture's whole build is that run's (the mean of its whole builds),
    its stepped build that run's first one; the corpus is each fixture and its variants."""
    run = json.loads((a.from_roots / "roots.json").read_text())
    stepped = ImageStore(a.from_roots / "steps", layout="cas", base_map=ImageStore().base_map, scratch=a.from_roots / "scratch")
    rows = []
    for fx in run["tasks"]:
        if any(b["status"] != "built" for b in fx["builds"]) or (a.only and fx["task"] not in a.only):
            continue
        src = FIXTURES / fx["kind"] / fx["task"]
        root = a.from_roots / "variants" / fx["task"]
        shutil.rmtree(root, ignore_errors=True)
        for i in range(a.variants):
            make_variant(src, root / f"{src.name}_v{i}", i)
        tasks = {t.id: t for t in load_tasks(str(root)).tasks}
        wholes = fx["builds"][1:]
        row = {
            "fixture": fx["task"],
            "whole_cpu_s": round(sum(b["cpu_s"] for b in wholes) / len(wholes), 2),
            "whole_wall_s": round(sum(b["wall_s"] for b in wholes) / len(wholes), 2),
            "first_cpu_s": fx["builds"][0]["cpu_s"],
            "first_wall_s": fx["builds"][0]["wall_s"],
            "sif_bytes": wholes[0].get("size", 0),
            "variants": [build(stepped, tasks[f"{src.name}_v{i}"]) for i in range(a.variants)],
        }
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    built = [v for r in rows for v in r["variants"] if v["status"] == "built"]
    n = sum(1 + len(r["variants"]) for r in rows)  # each fixture and its variants
    whole_cpu = sum(r["whole_cpu_s"] * (1 + len(r["variants"])) for r in rows)
    whole_wall = sum(r["whole_wall_s"] * (1 + len(r["variants"])) for r in rows)
    step_cpu = sum(r["first_cpu_s"] + sum(v["cpu_s"] for v in r["variants"]) for r in rows)
    step_wall = sum(r["first_wall_s"] + sum(v["wall_s"] for v in r["variants"]) for r in rows)
    summary = {
        "fixtures": len(rows),
        "tasks": n,
        "variants_built": len(built),
        "variants_failed": sum(len(r["variants"]) for r in rows) - len(built),
        "variant_cpu_s_mean": round(sum(v["cpu_s"] for v in built) / max(1, len(built)), 2),
        "variant_wall_s_mean": round(sum(v["wall_s"] for v in built) / max(1, len(built)), 2),
        "whole_cpu_s": round(whole_cpu, 1),
        "stepped_cpu_s": round(step_cpu, 1),
        "cpu_ratio_stepped_over_whole": round(step_cpu / whole_cpu, 3) if whole_cpu else None,
        "wall_ratio_stepped_over_whole": round(step_wall / whole_wall, 3) if whole_wall else None,
        "builds_per_hour_whole": round(3600 * n / whole_wall, 1) if whole_wall else None,
        "builds_per_hour_stepped": round(3600 * n / step_wall, 1) if step_wall else None,
        "bytes_stepped_store": du(a.from_roots / "steps" / "cas"),
        "bytes_whole_sifs": sum(r["sif_bytes"] * (1 + len(r["variants"])) for r in rows),
    }
    print(json.dumps({"fixtures": rows, "summary": summary}, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", type=int, default=6, help="fixture tasks, half native, half Harbor")
    ap.add_argument("--variants", type=int, default=10, help="variants per fixture")
    ap.add_argument("--out", type=Path, default=Path("/tmp/bench-steps"))
    ap.add_argument(
        "--more",
        type=int,
        default=0,
        help="on an earlier run's --out: build this many new variants per fixture step by step only "
        "(e.g. offline: `ip netns exec NONET runuser -u USER -- python bench/bench_steps.py --more 5`)",
    )
    ap.add_argument(
        "--from-roots",
        type=Path,
        help="a bench_roots.py --control run's --out: build --variants variants of each of its fixtures on its step cache",
    )
    ap.add_argument("--only", nargs="*", default=[], help="with --from-roots: these fixtures only")
    a = ap.parse_args()
    if a.more:
        return more(a)
    if a.from_roots:
        return from_roots(a)
    shutil.rmtree(a.out, ignore_errors=True)
    bases = ImageStore().base_map
    whole = ImageStore(a.out / "whole", base_map=bases)
    stepped = ImageStore(a.out / "steps", layout="cas", base_map=bases)
    picks = []
    for kind in ("native", "harbor"):
        picks += [(kind, p) for p in sorted((FIXTURES / kind).iterdir()) if p.is_dir()][: (a.fixtures + 1) // 2]
    res: dict = {"whole": [], "stepped": [], "again": []}
    for kind, src in picks:
        root = a.out / "tasks" / f"{kind}-{src.name}"
        for i in range(a.variants):
            make_variant(src, root / f"{src.name}_v{i}", i)
        make_variant(src, root / f"{src.name}_again", a.variants - 1, comment=True)
        tasks = {t.id: t for t in load_tasks(str(root)).tasks}
        first = build(whole, tasks[f"{src.name}_v0"])
        res["whole"].append(first)
        print(json.dumps({"whole": first}), file=sys.stderr, flush=True)
        if first["status"] != "built":
            continue  # a recipe that does not build here (a host it needs): no comparison
        for i in range(a.variants):
            b = build(stepped, tasks[f"{src.name}_v{i}"])
            b["fixture"], b["variant"] = src.name, i
            res["stepped"].append(b)
            print(json.dumps({"stepped": b}), file=sys.stderr, flush=True)
        again = build(stepped, tasks[f"{src.name}_again"])
        res["again"].append(again)
        print(json.dumps({"again": again}), file=sys.stderr, flush=True)
    ok = [w for w in res["whole"] if w["status"] == "built"]
    firsts = [s for s in res["stepped"] if s["variant"] == 0]
    rest = [s for s in res["stepped"] if s["variant"] > 0]
    n = len(ok) * a.variants
    whole_cpu = sum(w["cpu_s"] for w in ok) * a.variants  # every variant's whole build repeats its fixture's
    whole_wall = sum(w["wall_s"] for w in ok) * a.variants
    stepped_cpu = sum(s["cpu_s"] for s in res["stepped"])
    stepped_wall = sum(s["wall_s"] for s in res["stepped"])
    res["summary"] = {
        "fixtures_built": len(ok),
        "variants": n,
        "whole_cpu_s_per_build": round(sum(w["cpu_s"] for w in ok) / max(1, len(ok)), 1),
        "whole_wall_s_per_build": round(sum(w["wall_s"] for w in ok) / max(1, len(ok)), 1),
        "stepped_first_cpu_s": round(sum(s["cpu_s"] for s in firsts) / max(1, len(firsts)), 1),
        "stepped_first_wall_s": round(sum(s["wall_s"] for s in firsts) / max(1, len(firsts)), 1),
        "stepped_rest_cpu_s": round(sum(s["cpu_s"] for s in rest) / max(1, len(rest)), 1),
        "stepped_rest_wall_s": round(sum(s["wall_s"] for s in rest) / max(1, len(rest)), 1),
        "all_steps_exist_wall_s": [a_["wall_s"] for a_ in res["again"]],
        "all_steps_exist_steps_built": [a_.get("steps_built") for a_ in res["again"]],
        "cpu_ratio_stepped_over_whole": round(stepped_cpu / whole_cpu, 3) if whole_cpu else None,
        "wall_ratio_stepped_over_whole": round(stepped_wall / whole_wall, 3) if whole_wall else None,
        "builds_per_hour_whole": round(3600 * n / whole_wall, 1) if whole_wall else None,
        "builds_per_hour_stepped": round(3600 * n / stepped_wall, 1) if stepped_wall else None,
        "bytes_whole_sifs_per_variant": round(sum(w.get("size", 0) for w in ok) / max(1, len(ok))),
        "bytes_stepped_store": du(a.out / "steps" / "cas"),
    }
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
