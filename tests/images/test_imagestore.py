"""ImageStore with real rootless apptainer builds: cache hits, one builder among many, killed and
failed builds.

Recipes here are tiny defs on the base image (``From: ./ubuntu_22.04.sif``, resolved by the real
recipe normaliser through a base map naming the ``base_sif`` fixture). Each build appends a line to a counter file from
``%setup`` (which runs on the host), so the
tests can count real ``apptainer build`` runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from et_hpc.images.store import failure_reason, interrupted, retarget_files
from helpers.images import build_processes, builds, child_cmd, counting, leftovers, make_store, make_task


def test_failure_reason_picks_the_telling_line() -> None:
    log = [
        "INFO:    Running post scriptlet",
        "+ curl -LO https://dl.k8s.io/release/v1.30.0/bin/linux/amd64/kubectl",
        "  0     0    0     0    0     0      0      0 --:--:-- --:--:-- --:--:--     0curl: (6) Could not resolve host: dl.k8s.io",
        "FATAL:   While performing build: while running engine: exit status 6",
    ]
    assert failure_reason(log) == "curl: (6) Could not resolve host: dl.k8s.io"
    assert (
        failure_reason(
            ["Reading package lists...", "E: Unable to locate package nosuch", "FATAL:   While performing build: exit status 100"]
        )
        == "E: Unable to locate package nosuch"
    )
    assert failure_reason(["INFO: x", "FATAL:   oops"]) == "FATAL: oops"


def test_signal_deaths_are_interruptions_not_failures() -> None:
    assert interrupted(-9, []) and interrupted(143, [])
    assert interrupted(255, ["FATAL:   While performing build: failed to run %setup script: exit status 143"])
    assert not interrupted(255, ["E: Unable to locate package x", "FATAL:   ... exit status 100"])
    assert not interrupted(None, [])


def test_retarget_files_points_at_staged_copies(tmp_path: Path) -> None:
    text = "Bootstrap: localimage\nFrom: /b.sif\n%files\n    /ctx/a.txt /opt/a.txt\n    '/ctx/b c' /opt/\n%post\n    /ctx/a.txt\n"
    out = retarget_files(text, {"/ctx/a.txt": Path("/s/0/a.txt"), "/ctx/b c": Path("/s/1/b c")})
    assert out.splitlines()[3:] == ["    /s/0/a.txt /opt/a.txt", "    '/s/1/b c' /opt/", "%post", "    /ctx/a.txt"]


def test_built_then_cached_and_key_follows_files(tmp_path: Path, base_sif: Path) -> None:
    cache, counter = tmp_path / "cache", tmp_path / "counter"
    task = make_task(
        tmp_path,
        "t_hello",
        counting(counter) + "\n%files\n    data.txt /opt/data.txt\n\n%post\n    echo hello > /hello.txt\n",
        files={"data.txt": "one\n"},
    )
    store = make_store(cache, base_sif)
    assert store.lookup(task).status == "missing"
    first = store.ensure(task)
    assert first.status == "built", first.reason
    assert first.path == cache / "images" / first.key[:2] / f"{first.key}.sif" and first.path.is_file()
    meta = json.loads(store.meta_path(first.key).read_text())
    assert meta["task_ids"] == ["t_hello"] and meta["digest"] == first.digest and meta["rewrites"]
    log_text = store.log_path(first.key).read_text()
    assert log_text.startswith("# et-hpc build of t_hello")
    assert f"# rewrite: From: ./ubuntu_22.04.sif -> {base_sif}" in log_text

    second = make_store(cache, base_sif).ensure(task)  # a fresh store object: nothing in memory
    assert (second.status, second.path, second.digest) == ("cached", first.path, first.digest)
    assert builds(counter) == 1

    out = subprocess.run(["apptainer", "exec", str(first.path), "cat", "/opt/data.txt", "/hello.txt"], capture_output=True, text=True)
    assert out.stdout.split() == ["one", "hello"], out.stderr

    (task.source / "data.txt").write_text("two\n")
    changed = store.lookup(task)
    assert changed.status == "missing" and changed.key != first.key
    assert not leftovers(cache) and not list((cache / "locks").iterdir())


def test_sixteen_processes_one_build(tmp_path: Path, base_sif: Path) -> None:
    cache, counter = tmp_path / "cache", tmp_path / "counter"
    task = make_task(tmp_path, "t_many", counting(counter) + "\n%post\n    echo many > /many.txt\n")
    procs = [subprocess.Popen(child_cmd(cache, base_sif, task), stdout=subprocess.PIPE, text=True) for _ in range(16)]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0
        results.append(json.loads(out.strip().splitlines()[-1]))
    statuses = sorted(r["status"] for r in results)
    assert statuses == ["built"] + ["cached"] * 15, results
    assert len({r["path"] for r in results}) == 1 and Path(results[0]["path"]).is_file()
    assert builds(counter) == 1
    assert not leftovers(cache)


def test_killed_build_leaves_no_partial_image_or_blocking_lock(tmp_path: Path, base_sif: Path) -> None:
    cache, counter = tmp_path / "cache", tmp_path / "counter"
    started, slow = tmp_path / "started", tmp_path / "slow"
    slow.touch()
    hold = f"    if [ -e {slow} ]; then touch {started}; sleep 300; fi\n"
    task = make_task(tmp_path, "t_killed", counting(counter, hold) + "\n%post\n    echo ok > /ok.txt\n")
    child = subprocess.Popen(child_cmd(cache, base_sif, task), stdout=subprocess.PIPE, text=True, start_new_session=False)
    deadline = time.monotonic() + 300
    while not started.exists():
        assert child.poll() is None, "the build ended before it could be killed"
        assert time.monotonic() < deadline, "the build never reached %setup"
        time.sleep(0.2)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()

    store = make_store(cache, base_sif)
    key = store.lookup(task).key
    # The build's processes (apptainer and the %setup script) end with their builder.
    deadline = time.monotonic() + 90
    while build_processes(key):
        assert time.monotonic() < deadline, f"build processes outlived the killed builder: {build_processes(key)}"
        time.sleep(0.5)
    assert store.lookup(task).status == "missing"
    assert not store.sif_path(key).exists()
    assert store.lock_path(key).exists(), "the killed holder's lock is still there"

    slow.unlink()
    res = store.ensure(task)
    assert res.status == "built", res.reason
    assert builds(counter) == 2
    assert not leftovers(cache), "temp image of the killed build was cleaned"
    assert not store.lock_path(key).exists()


def test_failed_build_is_recorded_and_not_retried(tmp_path: Path, base_sif: Path) -> None:
    cache, counter = tmp_path / "cache", tmp_path / "counter"
    task = make_task(
        tmp_path, "t_fail", counting(counter) + "\n%post\n    echo 'E: Unable to locate package nosuchpkg' >&2\n    exit 100\n"
    )
    store = make_store(cache, base_sif)
    r1 = store.ensure(task)
    assert r1.status == "failed" and r1.path is None
    assert r1.reason == "E: Unable to locate package nosuchpkg"
    rec = json.loads(store.failed_path(r1.key).read_text())
    assert rec["reason"] == r1.reason and any("nosuchpkg" in ln for ln in rec["log_tail"])
    assert store.lookup(task).status == "failed"

    r2 = store.ensure(task)
    assert (r2.status, r2.reason) == ("failed", r1.reason)
    assert builds(counter) == 1, "a recorded failure is not rebuilt"

    r3 = store.ensure(task, retry_failed=True)
    assert r3.status == "failed"
    assert builds(counter) == 2
    assert not leftovers(cache) and not store.sif_path(r1.key).exists()
