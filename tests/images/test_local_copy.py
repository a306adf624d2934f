"""Node-local image copies (et_hpc.images.local_copy) with real files, real flocks, real processes
and a real apptainer instance started from the copy."""

from __future__ import annotations

import fcntl
import getpass
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from et_hpc.images import local_copy as lc
from et_hpc.runner.config import SandboxConfig

MB = 1 << 20


def _image(d: Path, name: str, size: int = MB) -> tuple[Path, str]:
    d.mkdir(parents=True, exist_ok=True)
    p = d / f"{name}.sif"
    p.write_bytes(os.urandom(size))
    return p, hashlib.sha256(p.read_bytes()).hexdigest()


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _lease_free(copy: Path) -> bool:
    fd = os.open(copy.with_name(copy.name + ".lease") if copy.suffix == lc.TREE else copy.with_suffix(".lease"), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_copy_is_made_once_checked_and_leased(tmp_path: Path) -> None:
    src, digest = _image(tmp_path / "cache", "a")
    scratch = tmp_path / "scratch"
    first = lc.local_image(src, digest, scratch=scratch)
    assert first.copied and first.path == scratch / "images" / f"{digest}.sif"
    assert first.path != src and _sha(first.path) == digest
    assert not os.access(first.path, os.W_OK) or os.geteuid() == 0  # read-only copy
    assert not list((scratch / "images").glob(".*.tmp"))
    meta = json.loads(first.path.with_suffix(".json").read_text())
    assert meta["digest"] == digest and meta["source"] == str(src) and meta["copy_s"] >= 0
    second = lc.local_image(src, "sha256:" + digest, scratch=scratch)
    assert not second.copied and second.path == first.path
    assert not _lease_free(first.path)  # both hold it
    first.release()
    assert not _lease_free(first.path)
    second.release()
    assert _lease_free(first.path)
    with lc.local_image(src, None, scratch=scratch) as third:  # no digest given: hashed from the source
        assert third.digest == digest and not third.copied
        assert not _lease_free(third.path)
    assert _lease_free(third.path)


def test_corrupted_copy_is_detected_and_replaced(tmp_path: Path) -> None:
    src, digest = _image(tmp_path / "cache", "a")
    scratch = tmp_path / "scratch"
    copy = lc.local_image(src, digest, scratch=scratch)
    copy.release()
    os.chmod(copy.path, 0o644)
    with open(copy.path, "r+b") as f:  # flip a byte in the middle
        f.seek(MB // 2)
        b = f.read(1)
        f.seek(MB // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    assert _sha(copy.path) != digest  # the corruption took effect
    again = lc.local_image(src, digest, scratch=scratch)
    assert again.copied and _sha(again.path) == digest
    again.release()

    # a corruption that keeps size and mtime is invisible to the stat check; verify="full" finds it
    st = again.path.stat()
    os.chmod(again.path, 0o644)
    with open(again.path, "r+b") as f:
        f.write(b"\0" * 16)
    os.utime(again.path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert _sha(again.path) != digest
    stat_only = lc.local_image(src, digest, scratch=scratch)
    assert not stat_only.copied  # stat check alone trusts it
    stat_only.release()
    full = lc.local_image(src, digest, scratch=scratch, verify="full")
    assert full.copied and _sha(full.path) == digest


def test_corrupted_copy_in_use_is_set_aside_not_pulled_from_under_its_user(tmp_path: Path) -> None:
    src, digest = _image(tmp_path / "cache", "a")
    scratch = tmp_path / "scratch"
    user = lc.local_image(src, digest, scratch=scratch)
    held = open(user.path, "rb")  # a running instance keeps the file open
    os.chmod(user.path, 0o644)
    with open(user.path, "r+b") as f:
        f.write(b"garbage!")
    again = lc.local_image(src, digest, scratch=scratch)
    assert again.copied and _sha(again.path) == digest
    assert held.read(8) == b"garbage!"  # the old user's open file is still the old inode
    assert list((scratch / "images").glob(".*.bad"))
    held.close()


def test_source_that_does_not_match_its_digest_is_refused(tmp_path: Path) -> None:
    src, digest = _image(tmp_path / "cache", "a")
    wrong = hashlib.sha256(b"something else").hexdigest()
    scratch = tmp_path / "scratch"
    with pytest.raises(lc.DigestMismatch):
        lc.local_image(src, wrong, scratch=scratch)
    d = scratch / "images"
    assert not list(d.glob("*.sif")) and not list(d.glob(".*.tmp"))

    class Img:
        path = src
        digest = wrong

    # the episode's choice never raises: it falls back to the shared image
    assert lc.episode_image(Img, SandboxConfig(local_copy="always"), scratch=scratch) == src
    Img.digest = digest
    got = lc.episode_image(Img, SandboxConfig(local_copy="always"), scratch=scratch)
    assert isinstance(got, lc.LocalImage) and _sha(got.path) == digest


def test_eviction_keeps_the_budget_and_never_evicts_copies_in_use(tmp_path: Path) -> None:
    cache, scratch = tmp_path / "cache", tmp_path / "scratch"
    imgs = {n: _image(cache, n) for n in "abcd"}
    budget_gb = 2.5 * MB / (1 << 30)  # room for two 1 MiB copies

    a = lc.local_image(*imgs["a"], scratch=scratch, budget_gb=budget_gb)  # held
    b = lc.local_image(*imgs["b"], scratch=scratch, budget_gb=budget_gb)
    b.release()
    # make a the least recently used: LRU alone would pick it
    os.utime(a.path.with_suffix(".lease"), (1, 1))
    c = lc.local_image(*imgs["c"], scratch=scratch, budget_gb=budget_gb)
    have = {x.digest for x in lc.list_copies(scratch)}
    assert have == {imgs["a"][1], imgs["c"][1]}  # b went, a (in use) stayed
    assert sum(x.size for x in lc.list_copies(scratch)) <= 2.5 * MB

    # both copies in use: no room without evicting one of them
    with pytest.raises(lc.NoRoom):
        lc.local_image(*imgs["d"], scratch=scratch, budget_gb=budget_gb)
    assert {x.digest for x in lc.list_copies(scratch)} == {imgs["a"][1], imgs["c"][1]}
    c.release()
    d = lc.local_image(*imgs["d"], scratch=scratch, budget_gb=budget_gb)
    assert {x.digest for x in lc.list_copies(scratch)} == {imgs["a"][1], imgs["d"][1]}
    assert _sha(a.path) == imgs["a"][1]
    a.release(), d.release()

    # an image larger than the whole budget is not copied
    big, big_digest = _image(cache, "big", 3 * MB)
    with pytest.raises(lc.NoRoom):
        lc.local_image(big, big_digest, scratch=scratch, budget_gb=budget_gb)


def _ask(args: tuple[str, str, str, object]) -> tuple[bool, str, str]:
    src, digest, scratch, barrier = args
    barrier.wait()
    li = lc.local_image(Path(src), digest, scratch=Path(scratch))
    out = (li.copied, str(li.path), _sha(li.path))
    li.release()
    return out


def test_eight_processes_asking_at_once_make_one_copy(tmp_path: Path) -> None:
    src, digest = _image(tmp_path / "cache", "a", 32 * MB)
    scratch = tmp_path / "scratch"
    ctx = mp.get_context("spawn")
    with ctx.Manager() as m:
        barrier = m.Barrier(8)
        with ctx.Pool(8) as pool:
            res = pool.map(_ask, [(str(src), digest, str(scratch), barrier)] * 8)
    assert len(res) == 8
    assert sum(copied for copied, _, _ in res) == 1
    assert {p for _, p, _ in res} == {str(scratch / "images" / f"{digest}.sif")}
    assert {s for _, _, s in res} == {digest}
    assert len(list((scratch / "images").glob("*.sif"))) == 1


def test_copy_wanted_only_across_filesystems_unless_forced(tmp_path: Path) -> None:
    src, _ = _image(tmp_path / "cache", "a")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    assert not lc.wants_copy(src, "auto", scratch)  # same filesystem
    assert lc.wants_copy(src, "always", scratch)
    assert not lc.wants_copy(src, "never", scratch)
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(scratch).st_dev:
        pytest.skip("no second filesystem (/dev/shm) here")
    other = Path(os.environ.get("TMPDIR_SHM", shm)) / f"et-hpc-test-{os.getpid()}"
    other.mkdir()
    try:
        o, _ = _image(other, "b")
        assert lc.wants_copy(o, "auto", scratch)
    finally:
        shutil.rmtree(other)


def test_sandbox_options_key() -> None:
    assert SandboxConfig().local_copy == "auto"
    assert SandboxConfig(local_copy="unpack").local_copy == "unpack"
    with pytest.raises(ValueError):
        SandboxConfig(local_copy="sometimes")
    with pytest.raises(ValueError):
        SandboxConfig(local_copy_budget_gb=0)


@pytest.mark.apptainer
def test_instance_starts_from_the_local_copy(base_sif: Path, tmp_path: Path) -> None:
    from et_hpc.sandbox.sandbox import Sandbox

    scratch = tmp_path / "scratch"
    copy = lc.local_image(base_sif, None, scratch=scratch)
    assert copy.path.parent == scratch / "images"
    with Sandbox(copy, scratch=scratch, overlay_mb=64) as sb:
        assert sb.sif == copy.path
        r = sb.shell().run("grep -c . /etc/os-release && echo ok > /home/user/x && cat /home/user/x")
        assert r.exit_code == 0 and r.output.strip().endswith("ok"), r.output
        # the instance's image is the node-local copy
        lst = subprocess.run(["apptainer", "instance", "list", "--json", sb.name], capture_output=True, text=True)
        assert lst.returncode == 0, lst.stderr
        assert str(copy.path) in lst.stdout, lst.stdout
        assert not _lease_free(copy.path)
        assert lc.evict(scratch, 0) > 0 and copy.path.exists()  # in use: not evicted
    copy.release()
    assert lc.evict(scratch, 0) == 0 and not copy.path.exists()


@pytest.mark.apptainer
def test_tree_is_unpacked_once_checked_leased_and_evicted(base_sif: Path, tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    d = scratch / "images"
    digest = _sha(base_sif)
    with pytest.raises(lc.DigestMismatch):  # the checked bytes are the unpacked ones
        lc.local_tree(base_sif, "0" * 64, scratch=scratch)
    assert not [p for p in d.iterdir() if p.name != ".node.lock"]  # nothing half made is left

    tree = lc.local_tree(base_sif, digest, scratch=scratch)
    assert tree.copied and tree.path == d / f"{digest}.root" and tree.path.is_dir()
    assert (tree.path / "etc" / "os-release").is_file() and (tree.path / "bin").exists()
    assert not list(d.glob(".*.tmp"))
    again = lc.local_tree(base_sif, digest, scratch=scratch)
    assert not again.copied and again.path == tree.path
    (info,) = lc.list_copies(scratch)
    assert info.kind == lc.TREE and info.size > base_sif.stat().st_size  # unpacked is larger
    assert lc.evict(scratch, 0) > 0 and tree.path.is_dir()  # leased twice: kept
    tree.release()
    assert lc.evict(scratch, 0) > 0 and tree.path.is_dir()
    again.release()
    assert lc.evict(scratch, 0) == 0 and not tree.path.exists()
    assert not [p for p in d.iterdir() if p.name != ".node.lock"]

    # a tree whose record is gone (a crash between rename and record) is unpacked anew
    third = lc.local_tree(base_sif, digest, scratch=scratch)
    third.release()
    (d / f"{digest}.root.json").unlink()
    fourth = lc.local_tree(base_sif, digest, scratch=scratch)
    assert fourth.copied and (fourth.path / "etc" / "os-release").is_file()
    fourth.release()


@pytest.mark.apptainer
def test_instance_starts_from_the_unpacked_tree_and_never_writes_it(base_sif: Path, tmp_path: Path) -> None:
    from et_hpc.sandbox.sandbox import PRISTINE, Sandbox

    scratch = tmp_path / "scratch"
    tree = lc.local_tree(base_sif, None, scratch=scratch)
    before = sorted(p.name for p in (tree.path / "etc").iterdir())
    with Sandbox(tree, scratch=scratch, overlay_mb=64) as sb:
        assert sb.unpacked and sb.pristine_bound
        sh = sb.shell()
        # the agent's writes land in the overlay: seen inside (the positive control), not in the tree
        r = sh.run("echo forged > /etc/et-mark && cat /etc/et-mark && rm /etc/os-release && echo rm-ok")
        assert r.exit_code == 0 and "forged" in r.output and "rm-ok" in r.output, r.output
        r = sh.run(f"echo x > {PRISTINE}/etc/et-mark; echo rc=$?; test -f {PRISTINE}/etc/os-release && echo intact")
        assert "rc=1" in r.output and "intact" in r.output, r.output
        lst = subprocess.run(["apptainer", "instance", "list", "--json", sb.name], capture_output=True, text=True)
        assert str(tree.path) in lst.stdout, lst.stdout
    assert sorted(p.name for p in (tree.path / "etc").iterdir()) == before
    assert (tree.path / "etc" / "os-release").is_file()
    tree.release()


@pytest.mark.apptainer
@pytest.mark.parametrize("mode", ["always", "unpack"])
def test_episode_runs_from_a_forced_local_copy(fixtures_dir: Path, base_sif: Path, tmp_path: Path, mode: str) -> None:
    from et_hpc.images.store import ImageStore
    from et_hpc.runs.store import open_run
    from et_hpc.tasks.loader import load_tasks

    task_id = "task_000000_9cc1e5be"
    src = tmp_path / "tasks"
    shutil.copytree(fixtures_dir / "native" / task_id, src / task_id)
    img = ImageStore().ensure(load_tasks(str(src)).tasks[0])
    assert img.path is not None and img.digest
    scratch = tmp_path / "scratch"
    env = dict(os.environ, ET_HPC_SCRATCH=str(scratch))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "et_hpc.cli",
            "run",
            str(src),
            "--policy",
            "replay",
            "--samples",
            "1",
            "--run-name",
            "lc",
            "--store",
            str(tmp_path / "store"),
            "--set",
            f"sandbox.local_copy={mode}",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (rec,) = list(open_run(tmp_path / "store" / "lc").records())
    assert rec.status == "ok" and rec.reward in (0.0, 1.0), rec.error
    assert rec.interpreter == "pristine"  # scored with the image's own python, from the copy
    copies = lc.list_copies(scratch / f"et-hpc-{getpass.getuser()}")
    assert [(c.digest, c.kind) for c in copies] == [(img.digest, lc.TREE if mode == "unpack" else ".sif")]
    assert _lease_free(copies[0].path)  # released when the episode ended


def test_reap_images_frees_unused_copies_and_keeps_held_ones(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    a, da = _image(tmp_path / "cache", "a")
    b, db = _image(tmp_path / "cache", "b")
    held = lc.local_image(a, da, scratch=scratch)
    lc.local_image(b, db, scratch=scratch).release()
    unused = scratch / "images" / f"{db}.sif"

    def reap(*extra: str) -> dict:
        r = subprocess.run(
            [sys.executable, "-m", "et_hpc.cli", "reap", "--images", "--json", "--scratch", str(scratch), *extra],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout)

    dry = reap("--dry-run")
    assert [x["path"] for x in dry["images_removed"]] == [str(unused)]
    assert [x["path"] for x in dry["images_in_use"]] == [str(held.path)]
    assert unused.exists()  # a dry run removes nothing
    done = reap()
    assert [x["path"] for x in done["images_removed"]] == [str(unused)]
    assert not unused.exists() and held.path.exists() and _sha(held.path) == da
    held.release()
    assert [x["path"] for x in reap()["images_removed"]] == [str(held.path)]
    assert not held.path.exists()
