"""The CAS layout on real images: for every demo and fixture task, the root made on a node from the
store is the SIF's root by tree digest (contents, modes, types, link targets; owners through the
manifest, since a rootless tree's files are the user's); a write in an instance started from a CAS
tree goes to its overlay and never to the node's shared inode; oracle episodes and their rescore
run from CAS trees with the rewards of the SIF path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from et_hpc.images import cas
from et_hpc.images.cas_node import cas_tree
from et_hpc.images.local_copy import pool_dir, rmtree, unpack_sif
from et_hpc.images.store import ImageStore
from et_hpc.record import records_from_table
from et_hpc.runs.store import RunStore
from et_hpc.tasks.loader import load_tasks
from helpers import REPO, with_tests_on_path
from helpers.units import et_hpc

pytestmark = [pytest.mark.apptainer]

DEMO = REPO / "defs" / "demo"
FIXTURES = REPO / "tests" / "fixtures" / "endless-terminals"
SOURCES = {"demo": DEMO, "native": FIXTURES / "native", "harbor": FIXTURES / "harbor"}
ALL = [(kind, p.name) for kind, d in SOURCES.items() for p in sorted(d.iterdir()) if p.is_dir()]
# CI: the demo tasks and the first native and Harbor fixture (a fresh machine builds each SIF, 1-4
# min on 2 cores); the long tier (scripts/test --long) compares every fixture task.
LONG = os.environ.get("ET_HPC_LONG") == "1"
TASKS = ALL if LONG else [t for t in ALL if t[0] == "demo"] + [next(t for t in ALL if t[0] == k) for k in ("native", "harbor")]


def _task(kind: str, tid: str):
    return next(t for t in load_tasks(str(SOURCES[kind])).tasks if t.id == tid)


def _ref(cache: Path, key: str, man: str) -> Path:
    ref = cache / "images" / key[:2] / f"{key}.cas"
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(json.dumps({"key": key, "manifest": man}))
    ref.with_suffix(".json").write_text(json.dumps({"key": key, "digest": man}))
    return ref


@pytest.mark.parametrize(("kind", "tid"), TASKS, ids=[t for _, t in TASKS])
def test_the_cas_root_is_the_sif_root(kind: str, tid: str, base_sif: Path, tmp_path: Path) -> None:
    res = ImageStore().ensure(_task(kind, tid))  # today's SIF, built once per cache
    if res.status == "failed":  # e.g. a recipe that downloads from a host this machine cannot reach
        pytest.skip(f"{tid}: its SIF does not build here, so there is no root to compare: {res.reason}")
    assert res.status in ("built", "cached") and res.path is not None, res.reason
    sif = Path(res.path)
    unpacked = tmp_path / "sif-root"
    unpack_sif(sif, unpacked)
    from_sif = cas.entries_from_sif(sif, unpacked)
    rmtree(unpacked)
    assert any(e["t"] == "l" for e in from_sif) and any(e["m"] & 0o6000 for e in from_sif)  # links and set-id files are in play
    cache = tmp_path / "cache"
    man, new = cas.ingest_sif(cache, sif, scratch=tmp_path)
    assert new > 0
    assert cas.tree_digest(cas.read_manifest(cache, man)) == cas.tree_digest(from_sif)  # owners included
    img = cas_tree(_ref(cache, res.key or "00", man), man, scratch=tmp_path / "scratch")
    try:
        on_node = cas.entries_from_tree(Path(img))
        assert cas.tree_digest(on_node, owners=False) == cas.tree_digest(from_sif, owners=False)
        assert cas.mtimes(on_node) == cas.mtimes(from_sif)  # .pyc files stay valid
        assert {(e["u"], e["g"]) for e in on_node} == {(os.getuid(), os.getgid())}  # a user's tree, as `unpack` makes
        # positive control: the same comparison sees one mode bit and one byte
        f = next(e for e in on_node if e["t"] == "f" and e["h"])
        assert cas.tree_digest([{**e, "m": e["m"] ^ 1} if e is f else e for e in on_node], owners=False) != cas.tree_digest(
            from_sif, owners=False
        )
        assert cas.tree_digest([{**e, "h": "0" * 64} if e is f else e for e in on_node], owners=False) != cas.tree_digest(
            from_sif, owners=False
        )
    finally:
        img.release()


def test_a_write_in_an_instance_never_reaches_the_shared_inode(task_sif: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    man, _ = cas.ingest_sif(cache, task_sif, scratch=tmp_path)
    img = cas_tree(_ref(cache, "77" * 32, man), man, scratch=tmp_path / "scratch")
    notes = Path(img) / "home/user/notes.txt"
    shared = os.stat(notes)
    assert shared.st_nlink >= 2 and shared.st_uid == os.getuid()  # a pool inode, and its owner is the user
    app = shutil.which("apptainer") or "apptainer"
    write = "echo forged > /home/user/notes.txt && cat /home/user/notes.txt && echo x >> /etc/os-release && echo ok"
    cp = subprocess.run([app, "exec", "--writable-tmpfs", str(img), "sh", "-c", write], capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0 and "forged" in cp.stdout and "ok" in cp.stdout, cp.stderr  # the write took effect inside
    assert notes.read_text() == "keep me\n"  # ... in the overlay, not in the tree
    assert cas.hash_file(notes) == next(e["h"] for e in cas.read_manifest(cache, man) if e["p"] == "home/user/notes.txt")
    cp = subprocess.run([app, "exec", str(img), "sh", "-c", write], capture_output=True, text=True, timeout=120)
    assert cp.returncode != 0 and notes.read_text() == "keep me\n"  # without an overlay the tree is read-only
    for p in pool_dir(tmp_path / "scratch").glob("??/*"):
        assert cas.hash_file(p) == p.name.split("-")[0]  # every pool file still is its name
    img.release()


@pytest.fixture(scope="module")
def both_caches(base_sif: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The demo tasks' images as SIFs (the default cache) and in a cache of the CAS layout."""
    root = tmp_path_factory.mktemp("cas-run")
    sifs = ImageStore()
    cas_cache = root / "cas-cache"
    (cas_cache / "base").mkdir(parents=True)
    for p in base_sif.parent.glob(f"{base_sif.stem}.*"):
        if p.suffix in (".sif", ".json"):
            shutil.copy2(p, cas_cache / "base" / p.name)
    store = ImageStore(cas_cache)
    for t in load_tasks(str(DEMO)).tasks:
        r = sifs.ensure(t)
        assert r.status in ("built", "cached") and r.key and r.path, r.reason
        key = store.lookup(t).key  # the recipe names its base by path, so the key is the cache's own
        assert key
        for src, dst in ((Path(r.path), store.sif_path(key)), (sifs.meta_path(r.key), store.meta_path(key))):
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
        assert store.lookup(t).status == "cached"
        c = store.convert(key)
        assert c.status == "cached" and str(c.path).endswith(".cas") and not store.sif_path(key).exists(), c
    return sifs.cache_dir, cas_cache


def _rewards(run_dir: Path) -> dict[str, tuple]:
    return {r.task_id: (r.status, r.reward, r.image_path) for r in records_from_table(RunStore(run_dir).read())}


def test_oracle_episodes_and_rescore_from_cas_trees_agree_with_sifs(both_caches, tmp_path: Path) -> None:
    sif_cache, cas_cache = both_caches
    keep = ["--set", "sandbox.keep_final_state=true", "--concurrency", "2"]
    out = {}
    for name, cache in (("sif", sif_cache), ("cas", cas_cache)):
        env = dict(with_tests_on_path(os.environ), ET_HPC_STORE=str(tmp_path / "store"), ET_HPC_CACHE=str(cache))
        r = et_hpc(["run", str(DEMO), "--policy", "oracle", "--run-name", name, *keep], env, timeout=900)
        assert r.returncode == 0, r.stderr[-2000:]
        out[name] = _rewards(tmp_path / "store" / name)
        rs = et_hpc(["rescore", name, "--task-source", str(DEMO), "--run-name", f"{name}-re", "--json"], env, timeout=900)
        assert rs.returncode == 0, rs.stderr[-2000:]
        assert json.loads(rs.stdout)["flipped"] == 0
        out[f"{name}-re"] = _rewards(tmp_path / "store" / f"{name}-re")
    tasks = sorted(out["sif"])
    assert len(tasks) == 4
    for t in tasks:
        assert out["sif"][t][:2] == out["cas"][t][:2] == out["sif-re"][t][:2] == out["cas-re"][t][:2] == ("ok", 1.0), (t, out)
        assert out["cas"][t][2].endswith(".cas") and out["sif"][t][2].endswith(".sif")  # each ran on its own layout
