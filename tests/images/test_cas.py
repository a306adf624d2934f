"""The CAS layout without apptainer: any tree stored file by file and made again on a node by hard
links digests as the tree it came from (property test), one changed mode bit, byte, owner or link
target changes the digest (the positive control), objects are shared between trees and the pool's
inodes are the store's content; gc removes objects no image names and keeps the rest."""

from __future__ import annotations

import json
import os
import stat
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from et_hpc.errors import InfraError
from et_hpc.images import cas
from et_hpc.images.cas_node import cas_tree
from et_hpc.images.local_copy import pool_dir, prune_pool
from et_hpc.images.store import ImageStore
from et_hpc.images.store_gc import gc

NAMES = st.text(alphabet="abcxyz._- ", min_size=1, max_size=6).filter(lambda s: s not in (".", ".."))
FILE_MODES = st.sampled_from([0o644, 0o755, 0o600, 0o444, 0o4755, 0o2755, 0o700])
DIR_MODES = st.sampled_from([0o755, 0o700, 0o1777, 0o2775])


def _tree(draw_files: list, dirs: dict, links: list, root: Path) -> None:
    root.mkdir()
    for d in sorted(dirs):
        (root / d).mkdir(exist_ok=True)
    for d, name, data, mode in draw_files:
        p = root / d / name
        if p.exists():
            continue
        p.write_bytes(data)
        os.chmod(p, mode)
    for d, name, target in links:
        p = root / d / f"l{name}"
        if not os.path.lexists(p):
            os.symlink(target, p)
    for d, mode in sorted(dirs.items(), reverse=True):
        os.chmod(root / d, mode)


trees = st.tuples(
    st.lists(st.tuples(st.sampled_from(["", "a", "a/b"]), NAMES, st.binary(max_size=64), FILE_MODES), max_size=12),
    st.fixed_dictionaries({"a": DIR_MODES, "a/b": DIR_MODES}),
    st.lists(st.tuples(st.sampled_from(["", "a"]), NAMES, st.sampled_from(["../x", "/etc/passwd", "a b", "missing"])), max_size=4),
)


def _store(cache: Path, root: Path, key: str) -> str:
    """Ingest ``root`` as the CAS image ``key`` (what a build publishes); returns its manifest."""
    man, _ = cas.ingest_entries(cache, cas.entries_from_tree(root), root)
    ref = cache / "images" / key[:2] / f"{key}.cas"
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(json.dumps({"key": key, "manifest": man}))
    ref.with_suffix(".json").write_text(json.dumps({"key": key, "digest": man}))
    return man


def _rm(p: Path) -> None:
    from et_hpc.images.local_copy import rmtree

    if p.exists():
        rmtree(p)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(t=trees)
def test_a_stored_tree_is_made_again_identical(t) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        w = Path(tmp)
        src = w / "src"
        _tree(*t, src)
        want = cas.tree_digest(cas.entries_from_tree(src))
        man = _store(w / "cache", src, "ab" * 32)
        assert cas.tree_digest(cas.read_manifest(w / "cache", man)) == want
        img = cas_tree(w / "cache/images/ab" / f"{'ab' * 32}.cas", man, scratch=w / "scratch")
        try:
            assert cas.tree_digest(cas.entries_from_tree(Path(img))) == want
            assert cas.mtimes(cas.entries_from_tree(Path(img))) == cas.mtimes(cas.entries_from_tree(src))
            for top, _, files in os.walk(img):  # every file is a pool inode whose content is its name
                for f in files:
                    p = Path(top) / f
                    if p.is_symlink():
                        continue
                    assert p.stat().st_nlink >= 2
        finally:
            img.release()
        _rm(src)
        _rm(w / "scratch")


def test_one_mode_bit_byte_owner_or_target_changes_the_digest(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _tree([("", "f", b"hello", 0o644), ("a", "g", b"x", 0o755)], {"a": 0o755, "a/b": 0o755}, [("", "k", "a b")], src)
    base = cas.entries_from_tree(src)
    d0 = cas.tree_digest(base)
    assert cas.tree_digest(cas.entries_from_tree(src)) == d0  # deterministic

    def changed(path: str, **kw) -> str:
        return cas.tree_digest([{**e, **kw} if e["p"] == path else e for e in base])

    assert changed("f", m=0o645) != d0
    assert changed("a", m=0o775) != d0
    assert changed("f", u=0) != d0 or os.getuid() == 0
    assert changed("f", g=12345) != d0
    assert changed("lk", l="a c") != d0
    # on disk too: one byte, one bit
    (src / "f").write_bytes(b"hellp")
    assert cas.tree_digest(cas.entries_from_tree(src)) != d0
    (src / "f").write_bytes(b"hello")
    assert cas.tree_digest(cas.entries_from_tree(src)) == d0
    os.chmod(src / "f", 0o4644)
    assert cas.tree_digest(cas.entries_from_tree(src)) != d0
    # owners=False leaves owners out and nothing else
    assert cas.tree_digest(base, owners=False) == cas.tree_digest([{**e, "u": 7, "g": 7} for e in base], owners=False)
    assert cas.tree_digest(base, owners=False) != changed("f", m=0o600)


def test_trees_share_objects_and_a_node_pays_once(tmp_path: Path) -> None:
    cache, scratch = tmp_path / "cache", tmp_path / "scratch"
    big = os.urandom(1 << 20)
    for i in (1, 2):
        _tree([("", "shared", big, 0o755), ("", "own", f"task {i}".encode(), 0o644)], {"a": 0o755, "a/b": 0o755}, [], tmp_path / f"t{i}")
        os.utime(tmp_path / f"t{i}" / "shared", (1e9, 1e9))  # as a package's file: one mtime in every task
    m1 = _store(cache, tmp_path / "t1", "11" * 32)
    m2 = _store(cache, tmp_path / "t2", "22" * 32)
    assert m1 != m2
    objs = list((cache / "cas/objects").glob("??/*"))
    assert len(objs) == 3  # the shared file once, each task's own file
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o444 for p in objs)  # the store's objects are read-only
    a = cas_tree(cache / f"images/11/{'11' * 32}.cas", m1, scratch=scratch)
    b = cas_tree(cache / f"images/22/{'22' * 32}.cas", m2, scratch=scratch)
    assert os.stat(Path(a) / "shared").st_ino == os.stat(Path(b) / "shared").st_ino  # one inode on the node
    assert json.loads((Path(str(b) + ".json")).read_text())["size"] < 1000  # the second tree copied only its own file
    a.release()
    b.release()
    with pytest.raises(InfraError, match="expected"):
        cas_tree(cache / f"images/11/{'11' * 32}.cas", m2, scratch=scratch)


def test_a_damaged_object_is_refused_on_the_node(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    _tree([("", "f", b"original", 0o644)], {"a": 0o755, "a/b": 0o755}, [], tmp_path / "t")
    man = _store(cache, tmp_path / "t", "33" * 32)
    (obj,) = (cache / "cas/objects").glob("??/*")
    os.chmod(obj, 0o644)
    obj.write_bytes(b"tampered")  # positive control below: the object now differs from its name
    assert cas.hash_file(obj) != obj.name
    from et_hpc.images.local_copy import DigestMismatch

    with pytest.raises(DigestMismatch):
        cas_tree(cache / f"images/33/{'33' * 32}.cas", man, scratch=tmp_path / "scratch")
    assert not list(pool_dir(tmp_path / "scratch").glob("??/*[!p]"))  # nothing half-made stays in the pool


def _age(cache: Path) -> None:
    old = time.time() - 7200
    for p in cache.rglob("*"):
        if p.is_file():
            os.utime(p, (old, old))


def test_gc_removes_what_no_image_names(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    for i, k in ((1, "44" * 32), (2, "55" * 32)):
        _tree(
            [("", "common", b"c" * 100, 0o644), ("", "own", f"own {i}".encode(), 0o644)], {"a": 0o755, "a/b": 0o755}, [], tmp_path / f"t{i}"
        )
        _store(cache, tmp_path / f"t{i}", k)
    store = ImageStore(cache, base_map={})
    assert len(list((cache / "cas/objects").glob("??/*"))) == 3
    res = gc(store, {"44" * 32}, min_age_s=3600)
    assert res.removed == [] and res.cas_files == 0  # everything is recent: nothing goes
    _age(cache)
    res = gc(store, {"44" * 32}, min_age_s=3600, dry_run=True)
    assert res.removed == ["55" * 32] and res.cas_files == 2  # its manifest and its own object
    assert len(list((cache / "cas/objects").glob("??/*"))) == 3
    _age(cache)  # the dry run's lease check made a lease file, which counts as a use
    res = gc(store, {"44" * 32}, min_age_s=3600)
    assert res.removed == ["55" * 32] and res.cas_files == 2
    left = {p.name for p in (cache / "cas/objects").glob("??/*")}
    kept = cas.referenced(cache, [json.loads((cache / f"images/44/{'44' * 32}.cas").read_text())["manifest"]])
    assert left == kept and len(left) == 2
    assert store.lookup_many([]) == []
    # the kept image is still whole: it materialises
    img = cas_tree(cache / f"images/44/{'44' * 32}.cas", None, scratch=tmp_path / "scratch")
    assert (Path(img) / "common").read_bytes() == b"c" * 100
    img.release()


def test_an_ingest_in_progress_blocks_the_sweep(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    (cache / "cas/objects/ab").mkdir(parents=True)
    orphan = cache / "cas/objects/ab" / ("ab" * 32)
    orphan.write_bytes(b"x")
    os.utime(orphan, (0, 0))
    with cas.gc_guard(cache):  # an ingest holds this
        assert cas.sweep(cache, set(), min_age_s=0, now=time.time()) == (0, 0)
    assert orphan.exists()
    assert cas.sweep(cache, set(), min_age_s=0, now=time.time()) == (1, 1)  # control: alone, it goes
    assert not orphan.exists()


def test_prune_pool_keeps_linked_files(tmp_path: Path) -> None:
    cache, scratch = tmp_path / "cache", tmp_path / "scratch"
    _tree([("", "f", b"data", 0o644)], {"a": 0o755, "a/b": 0o755}, [], tmp_path / "t")
    man = _store(cache, tmp_path / "t", "66" * 32)
    img = cas_tree(cache / f"images/66/{'66' * 32}.cas", man, scratch=scratch)
    img.release()
    assert prune_pool(scratch) == 0  # linked from the tree
    from et_hpc.images.local_copy import clear_unused

    pooled = list(pool_dir(scratch).glob("??/*"))
    assert len(pooled) == 1
    removed, _ = clear_unused(scratch)  # 'et-hpc reap --images'
    assert [c.digest for c in removed] == [man]
    assert not pooled[0].exists()  # no tree links it any more: pruned with the tree


def test_a_run_plans_the_bytes_of_its_cas_trees(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from et_hpc.images.space import run_needs

    cache = tmp_path / "cache"
    _tree([("", "f", b"x" * 5000, 0o644)], {"a": 0o755, "a/b": 0o755}, [], tmp_path / "t")
    man = _store(cache, tmp_path / "t", "88" * 32)
    ref = cache / f"images/88/{'88' * 32}.cas"
    ref.write_text(json.dumps({"manifest": man, "bytes": cas.tree_bytes(cache, man)}))
    assert cas.tree_bytes(cache, man) == 5000
    opts = SimpleNamespace(writable_tmpfs=True, overlay_mb=64, local_copy="never", local_copy_budget_gb=20.0)
    (need,) = run_needs(tmp_path / "scratch", [(ref, man)], opts, 1)  # a CAS image is a tree, whatever local_copy says
    assert need.bytes == 5000
    img = cas_tree(ref, man, scratch=tmp_path / "scratch")
    img.release()
    assert run_needs(tmp_path / "scratch", [(ref, man)], opts, 1) == []  # on the node already
