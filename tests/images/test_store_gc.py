"""``et-hpc images gc``: only images no kept task references go, never one a reader or builder holds.

Two tiny tasks are built for real into a fresh cache; the kept source names one of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from et_hpc.images import store_gc
from et_hpc.images.lock import BuildLock
from et_hpc.images.store import ImageStore
from et_hpc.tasks.loader import load_tasks


def gc_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "et_hpc.cli", "images", "gc", *args], capture_output=True, text=True, timeout=300)


def tiny_task(root: Path, name: str, text: str) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "task.json").write_text(json.dumps({"description": f"task {name}", "truth": text}))
    (d / "container.def").write_text(f"Bootstrap: localimage\nFrom: ./ubuntu_22.04.sif\n\n%post\n    echo {text} > /opt/{name}.txt\n")
    return d


def test_gc_keeps_referenced_leased_locked_and_recent_images(tmp_path: Path, base_sif: Path) -> None:
    cache = tmp_path / "cache"
    (cache / "base").mkdir(parents=True)
    for f in (base_sif, base_sif.with_suffix(".json")):
        (cache / "base" / f.name).symlink_to(f)
    keep_src, all_src = tmp_path / "keep", tmp_path / "all"
    tiny_task(keep_src, "task_keep", "kept")
    all_src.mkdir()
    for d in (keep_src / "task_keep", tiny_task(tmp_path / "drop-src", "task_drop", "dropped")):
        (all_src / d.name).symlink_to(d)
    store = ImageStore(cache)
    tasks = {t.id: t for t in load_tasks(str(all_src)).tasks}
    built = {r.task_id: r for r in store.ensure_many(tasks.values(), jobs=2, progress=False)}
    assert {r.status for r in built.values()} == {"built"}, built
    drop = built["task_drop"]
    assert drop.path is not None and drop.key is not None
    drop_sif = Path(drop.path)

    # recent: built moments ago, so the default --min-age keeps it
    out = gc_cli(str(keep_src), "--cache", str(cache), "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["removed"] == [] and got["recent"] == [drop.key] and got["kept"] == 1, got

    # a running episode holds the lease, as episode_image does for a store image used in place
    fd = store_gc.shared_lease(drop_sif)
    assert fd is not None
    try:
        got = json.loads(gc_cli(str(keep_src), "--cache", str(cache), "--min-age", "0", "--json").stdout)
        assert got["in_use"] == [drop.key] and got["removed"] == [], got
        assert drop_sif.exists()
    finally:
        os.close(fd)

    # a build holds the lock
    with BuildLock(store.lock_path(drop.key), stale_after=60):
        res = store_gc.gc(ImageStore(cache), {built["task_keep"].key or ""}, min_age_s=0)
        assert res.in_use == [drop.key] and drop_sif.exists(), res

    # dry run names it and removes nothing; then it goes, and the kept image stays usable
    dry = gc_cli(str(keep_src), "--cache", str(cache), "--min-age", "0", "--dry-run")
    assert dry.returncode == 0 and dry.stdout.startswith("would remove 1 image(s)"), dry.stdout + dry.stderr
    assert drop_sif.exists()
    real = gc_cli(str(keep_src), "--cache", str(cache), "--min-age", "0")
    assert real.returncode == 0 and real.stdout.startswith("removed 1 image(s)"), real.stdout + real.stderr
    assert not drop_sif.exists() and not store.meta_path(drop.key).exists()
    assert not list(drop_sif.parent.glob(f"*{drop.key}*")), list(drop_sif.parent.iterdir())
    fresh = ImageStore(cache)
    assert fresh.lookup(tasks["task_keep"]).status == "cached"
    assert fresh.lookup(tasks["task_drop"]).status == "missing"


def test_gc_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    broken = tmp_path / "src" / "task_broken"
    broken.mkdir(parents=True)
    (broken / "task.json").write_text("{}")  # no description: cannot be loaded
    for args in ([str(tmp_path / "src"), "--cache", str(tmp_path / "c")], [str(tmp_path / "src"), "--min-age", "-1"]):
        out = gc_cli(*args)
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("et-hpc: error: "), out.stderr
