"""Lookups without builds: keys follow content, the lookup index spares a new process the work,
and any change to the recipe, a copied file or the base invalidates it. No apptainer needed."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from et_hpc.images.store import ImageStore
from et_hpc.tasks import recipe as recipe_mod
from et_hpc.tasks.model import Recipe, Task

EMPTY_SHA = hashlib.sha256(b"").hexdigest()
OLD = time.time() - 3600  # mtimes in the past: the index never trusts files changed just now


def make_task(root: Path, name: str, data: str = "1,2\n") -> Task:
    d = root / name
    d.mkdir(parents=True)
    (d / "data.csv").write_text(data)
    (d / "container.def").write_text(
        "Bootstrap: localimage\nFrom: ./ubuntu_22.04.sif\n\n%files\n    data.csv /home/user/data.csv\n\n%post\n    echo hi\n"
    )
    for p in (d / "data.csv", d / "container.def", d):
        os.utime(p, (OLD, OLD))
    return Task(id=name, prompt="", source=d, recipe=Recipe(kind="def", path=d / "container.def", context_dir=d))


class CountingNormalise:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, task, *, base_map):
        self.calls += 1
        return recipe_mod.normalise(task, base_map=base_map)


def setup(tmp_path: Path, n: int = 5) -> tuple[Path, dict, list[Task]]:
    base = tmp_path / "base.sif"
    base.write_bytes(b"not really a sif" * 1000)
    os.utime(base, (OLD, OLD))
    tasks = [make_task(tmp_path / "tasks", f"t{i}", data=f"{i}\n") for i in range(n)]
    os.utime(tmp_path / "tasks", (OLD, OLD))
    return tmp_path / "cache", {"./ubuntu_22.04.sif": base}, tasks


def test_index_spares_normalising_and_follows_changes(tmp_path: Path) -> None:
    cache, bm, tasks = setup(tmp_path)
    first = ImageStore(cache, base_map=bm).lookup_many(tasks)
    assert [r.status for r in first] == ["missing"] * 5
    assert len({r.key for r in first}) == 5  # different data.csv -> different keys
    base_sidecar = Path(bm["./ubuntu_22.04.sif"]).with_name("base.sif.sha256.json")
    assert json.loads(base_sidecar.read_text())["size"] == 16000  # base digest remembered beside it

    norm = CountingNormalise()
    again = ImageStore(cache, base_map=bm, normalise=norm).lookup_many(tasks)
    assert [r.key for r in again] == [r.key for r in first]
    assert norm.calls == 0, "a fresh store answered from the lookup index"

    # A copied file changes: only that task is recomputed, and its key changes.
    data = tasks[2].source / "data.csv"
    data.write_text("changed\n")
    os.utime(data, (OLD + 5, OLD + 5))
    norm = CountingNormalise()
    third = ImageStore(cache, base_map=bm, normalise=norm).lookup_many(tasks)
    assert norm.calls == 1
    assert third[2].key != first[2].key and [r.key for i, r in enumerate(third) if i != 2] == [r.key for i, r in enumerate(first) if i != 2]

    # The base image changes: every key changes.
    base = Path(bm["./ubuntu_22.04.sif"])
    base.write_bytes(b"another base" * 1000)
    os.utime(base, (OLD + 9, OLD + 9))
    fourth = ImageStore(cache, base_map=bm).lookup_many(tasks)
    assert not {r.key for r in fourth} & {r.key for r in third}


def test_status_comes_from_the_cache(tmp_path: Path) -> None:
    cache, bm, tasks = setup(tmp_path, n=3)
    store = ImageStore(cache, base_map=bm)
    k0, k1 = store.lookup(tasks[0]).key, store.lookup(tasks[1]).key
    store.sif_path(k0).parent.mkdir(parents=True)
    store.sif_path(k0).write_bytes(b"")
    store.meta_path(k0).write_text(json.dumps({"digest": EMPTY_SHA}))
    store.failed_path(k1).parent.mkdir(parents=True)
    store.failed_path(k1).write_text(json.dumps({"reason": "E: Unable to locate package x"}))
    got = ImageStore(cache, base_map=bm).lookup_many(tasks)
    assert [(r.status, r.digest, r.reason) for r in got] == [
        ("cached", EMPTY_SHA, None),
        ("failed", None, "E: Unable to locate package x"),
        ("missing", None, None),
    ]
    assert got[0].path == store.sif_path(k0)
    # ensure(build=False) never builds: a missing image stays missing.
    assert ImageStore(cache, base_map=bm).ensure(tasks[2], build=False).status == "missing"


def test_bad_recipe_is_a_failed_lookup_not_an_exception(tmp_path: Path) -> None:
    cache, bm, tasks = setup(tmp_path, n=1)
    (tasks[0].source / "data.csv").unlink()
    r = ImageStore(cache, base_map=bm).lookup(tasks[0])
    assert r.status == "failed" and "data.csv" in r.reason and r.key is None
    missing_base = ImageStore(cache, base_map={"./ubuntu_22.04.sif": tmp_path / "nope.sif"})
    r = missing_base.lookup(make_task(tmp_path / "more", "t9"))
    assert r.status == "failed" and r.reason.startswith("base image ") and "et-hpc base build" in r.reason


def test_swapped_image_is_refused(tmp_path: Path) -> None:
    """A SIF changed after its build (someone with write access to the cache) is refused in one line."""
    cache, bm, tasks = setup(tmp_path, n=1)
    store = ImageStore(cache, base_map=bm)
    key = store.lookup(tasks[0]).key
    sif, meta = store.sif_path(key), store.meta_path(key)
    sif.parent.mkdir(parents=True)
    sif.write_bytes(b"the real image" * 100)
    digest = hashlib.sha256(sif.read_bytes()).hexdigest()
    meta.write_text(json.dumps({"key": key, "digest": digest, "size": sif.stat().st_size}))  # older meta: no stat
    r = ImageStore(cache, base_map=bm).lookup(tasks[0])
    assert r.status == "cached" and r.digest == digest
    st = sif.stat()  # verified in full once, then the stat is recorded for the cheap check
    assert json.loads(meta.read_text())["mtime_ns"] == st.st_mtime_ns
    assert json.loads(meta.read_text())["ino"] == st.st_ino

    fake = sif.with_name("swap.tmp")
    fake.write_bytes(b"a trojan image" * 100)  # same size, other content
    os.replace(fake, sif)
    r = ImageStore(cache, base_map=bm).lookup(tasks[0])
    assert r.status == "missing" and r.path is None
    assert str(sif) in r.reason and "does not match its recorded digest" in r.reason and "\n" not in r.reason
    from et_hpc.runner.plan import image_missing

    assert "does not match its recorded digest" in image_missing(r)  # et-hpc run refuses with this line
