"""The kept-state store and the start check on real ext3 images, made rootless with ``mke2fs -d``
(the same layout an episode's overlay has: ``upper/`` and ``work/``); no apptainer needed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from et_hpc.runs import final_state as fs
from et_hpc.scoring import start_check

MKE2FS = shutil.which("mke2fs") or shutil.which("mke2fs", path="/usr/sbin:/sbin")


def _image(tmp: Path, files: dict[str, str | None], links: dict[str, str] | None = None, mb: int = 64) -> Path:
    """A sparse ext3 image whose ``upper/`` holds ``files`` (None: a directory) and ``links``."""
    if MKE2FS is None:
        pytest.fail("mke2fs (e2fsprogs) is needed")
    src = tmp / "src"
    (src / "upper").mkdir(parents=True)
    (src / "work").mkdir()
    for rel, text in files.items():
        p = src / "upper" / rel
        if text is None:
            p.mkdir(parents=True, exist_ok=True)
        else:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
    for rel, target in (links or {}).items():
        p = src / "upper" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.symlink_to(target)
    img = tmp / "ov.img"
    subprocess.run([MKE2FS, "-q", "-F", "-t", "ext3", "-d", str(src), str(img), f"{mb}M"], check=True, capture_output=True)
    return img


def test_keep_extract_round_trip_is_content_addressed_and_sparse(tmp_path: Path) -> None:
    img = _image(tmp_path, {"home/user/answer.txt": "42\n"})
    run = tmp_path / "run"
    value = fs.keep(img, run, 16)
    hx = fs.digest_of(value)
    assert hx and fs.archive_path(run, value).name == f"{hx}.tar.gz"
    assert fs.keep(img, run, 16) == value and len(list((run / fs.DIR).glob("*.tar.gz"))) == 1  # the same state: one file
    out = tmp_path / "back.img"
    fs.extract(fs.archive_path(run, value), value, out)
    assert out.read_bytes() == img.read_bytes()
    assert out.stat().st_blocks * 512 < out.stat().st_size / 4  # holes stay holes
    assert fs.size_of(run, value) < 2**20


def test_over_the_bound_is_not_kept_and_damage_is_refused(tmp_path: Path) -> None:
    import os

    img = _image(tmp_path, {"home/user/noise.bin": os.urandom(3 * 2**20).hex()})
    assert fs.keep(img, tmp_path / "run", 1).startswith("not kept: larger than sandbox.final_state_mb=1")
    assert not list((tmp_path / "run" / fs.DIR).glob("*.tar.gz"))
    assert fs.keep(tmp_path / "gone.img", tmp_path / "run", 1).startswith("not kept: ")  # never raises
    value = fs.keep(img, tmp_path / "run", 64)
    a = fs.archive_path(tmp_path / "run", value)
    data = bytearray(a.read_bytes())
    data[-100] ^= 1
    a.write_bytes(bytes(data))
    with pytest.raises(fs.InfraError, match="does not match its digest"):
        fs.extract(a, value, tmp_path / "x.img")
    assert not (tmp_path / "x.img").exists()


CASES = {
    "honest": ({"home/user/answer.txt": "42\n", "usr/bin/mytool": "#!/bin/sh\n", "etc/motd": "hi\n"}, {}, [], []),
    "runtime_files": ({".singularity.d/env/99-x.sh": "export A=1\n"}, {}, ["/.singularity.d"], []),
    "bin_sh": ({"usr/bin/sh": "#!/tmp/x\n"}, {}, ["/usr/bin/sh"], []),
    "dash_deleted": ({"usr/bin/.wh.dash": ""}, {}, ["/usr/bin/dash"], []),
    "bin_link": ({}, {"bin": "/home/user/bin"}, ["/bin"], []),
    "usr_bin_link": ({"usr": None}, {"usr/bin": "/home/user/bin"}, ["/usr/bin (no longer a directory)"], []),
    "libc": ({"usr/lib/x86_64-linux-gnu/libc.so.6": "x"}, {}, ["/usr/lib/x86_64-linux-gnu/libc.so.6"], []),
    "opaque_usr_bin": ({"usr/bin/.wh..wh..opq": ""}, {}, ["/usr/bin/.wh..opq"], []),
    "preload_and_cache": (
        {"etc/ld.so.preload": "/home/user/e.so\n", "etc/ld.so.cache": "x"},
        {},
        [],
        ["/etc/ld.so.preload", "/etc/ld.so.cache"],
    ),
    "foreign_nss": ({"etc/nsswitch.conf": "passwd: evil files\n"}, {}, [], ["/etc/nsswitch.conf"]),
    "plain_nss": ({"etc/nsswitch.conf": "passwd: files systemd\ngroup: files [NOTFOUND=return] db\n"}, {}, [], []),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_start_check(case: str, tmp_path: Path) -> None:
    files, links, refused, left = CASES[case]
    img = _image(tmp_path, files, links)
    got_refused, got_left = start_check.check_start(img)
    assert got_refused == refused and got_left == left
    for p in left:  # really gone from the copy
        assert "not found" in start_check.dfs(img, f"stat /upper{p}")
    if case == "honest":
        assert "not found" not in start_check.dfs(img, "stat /upper/home/user/answer.txt")


def _raw_image(tmp: Path, make, mb: int = 64) -> Path:
    """An ext3 overlay image whose ``upper/`` is what ``make(upper)`` puts there (any bytes, any type)."""
    if MKE2FS is None:
        pytest.fail("mke2fs (e2fsprogs) is needed")
    src = tmp / "src"
    (src / "upper" / "etc").mkdir(parents=True)
    (src / "work").mkdir()
    make(src / "upper")
    img = tmp / "ov.img"
    subprocess.run([MKE2FS, "-q", "-F", "-t", "ext3", "-d", str(src), str(img), f"{mb}M"], check=True, capture_output=True)
    return img


def _sparse_1g(up: Path) -> None:
    with open(up / "etc/nsswitch.conf", "wb") as f:
        f.write(b"passwd: files\n")
        f.truncate(1 << 30)


# case -> (what the agent left in upper/, what check_start must leave out, the bytes debugfs shows: the control)
HOSTILE = {
    "fifo_nsswitch": (
        lambda up: os.mkfifo(up / "etc/nsswitch.conf"),
        ["/etc/nsswitch.conf"],
        ("stat /upper/etc/nsswitch.conf", b"Type: FIFO"),
    ),
    "non_utf8_nsswitch": (
        lambda up: (up / "etc/nsswitch.conf").write_bytes(b"passwd: files\n# \xff\xfe\n"),
        [],
        ("cat /upper/etc/nsswitch.conf", b"\xff\xfe"),
    ),
    "non_utf8_foreign_module": (
        lambda up: (up / "etc/nsswitch.conf").write_bytes(b"passwd: \xffevil files\n"),
        ["/etc/nsswitch.conf"],
        ("cat /upper/etc/nsswitch.conf", b"\xffevil"),
    ),
    "preload_target": (
        lambda up: os.symlink(b"/tmp/\xff\x9b", bytes(up / "etc/ld.so.preload")),
        ["/etc/ld.so.preload"],
        ("stat /upper/etc/ld.so.preload", b"/tmp/\xff\x9b"),
    ),
    "sparse_1g_nsswitch": (_sparse_1g, ["/etc/nsswitch.conf"], ("stat /upper/etc/nsswitch.conf", b"Size: 1073741824")),
    "fifo_passwd": (lambda up: os.mkfifo(up / "etc/passwd"), ["/etc/passwd"], ("stat /upper/etc/passwd", b"Type: FIFO")),
    "names": (
        lambda up: [(up / os.fsdecode(b"etc/x\xff\x1b[31m")).write_bytes(b"\xff"), (up / os.fsdecode(b"\x9b\x07")).mkdir()],
        [],
        ("ls -p /upper/etc", b"x\xff\x1b[31m"),
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_start_check_reads_agent_bytes_safely(case: str, tmp_path: Path) -> None:
    """Any bytes, a FIFO, a 1 GB sparse file: read as bytes, bounded, never blocking; left out, not an error."""
    make, left, (cmd, control) = HOSTILE[case]
    img = _raw_image(tmp_path, make)
    out, _, _ = start_check.bounded_run([start_check.debugfs(), "-R", cmd, str(img)], 1 << 16, 60)
    assert control in out, out[:500]  # the positive control: the state holds what text=True chokes on
    assert start_check.check_start(img) == ([], left)


RSS = """
import json, sys
from pathlib import Path
from et_hpc.scoring import start_check
def kb(key):  # this process's own (ru_maxrss keeps the forking parent's peak across exec)
    return int(next(ln for ln in open("/proc/self/status") if ln.startswith(key)).split()[1])
base = kb("VmRSS:")
junk = b"x" * (int(sys.argv[2]) << 20)  # every page written
got = start_check.check_start(Path(sys.argv[1]))
print(json.dumps({"got": got, "kb": kb("VmHWM:") - base}))
"""


def test_start_check_memory_is_bounded_on_a_1g_sparse_file(tmp_path: Path) -> None:
    """Peak RSS of the check on a 1 GB sparse nsswitch.conf stays within 256 MB above a fresh Python's
    (the measure's control: 300 MB held by the same process is seen)."""
    import json
    import sys

    img = _raw_image(tmp_path, _sparse_1g)

    def probe(grow_mb: int) -> dict:
        cp = subprocess.run([sys.executable, "-c", RSS, str(img), str(grow_mb)], capture_output=True, text=True, timeout=300)
        assert cp.returncode == 0, cp.stderr[-1500:]
        return json.loads(cp.stdout.strip().splitlines()[-1])

    got = probe(0)
    assert got["got"] == [[], ["/etc/nsswitch.conf"]] and got["kb"] < 256 * 1024, got
    assert probe(300)["kb"] >= 256 * 1024
