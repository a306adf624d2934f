"""Before a kept state is started again: what its start would run, read from the host with debugfs.

``check_start(img)`` reads the kept overlay image (a private copy) with ``debugfs``, never mounts
or starts it, and returns (paths that change what a start runs: the state is refused, the agent's
0; paths left out of the copy: the image's apply). Every read of agent data is bytes, bounded
(``bounded_run``: at most ``DFS_LIMIT`` bytes of output, the rest never read) and never opens a
FIFO, device or socket (debugfs reads the image file, not the objects in it). What it defends:
SECURITY.md; how rescoring uses it: docs/rescore.md.
"""

from __future__ import annotations

import os
import re
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from et_hpc.errors import InfraError

# -- before a kept state is started again ------------------------------------------------------
# Starting an instance runs the image's /.singularity.d/startscript (#!/bin/sh) and sources its
# env scripts, and every `apptainer exec` sources them too: in a kept state those would be the
# agent's files. A state whose upper layer changes what that start runs is not started; one that
# only changes the loader's /etc/ld.so.preload or /etc/ld.so.cache has them left out of the
# private copy (the image's own apply), and scoring is as in a live episode.
_ARCH = "x86_64-linux-gnu"
REFUSED = {
    "/upper": {".singularity.d", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "environment", "singularity"},
    "/upper/usr": {"lib64", "sbin"},
    "/upper/usr/bin": {"sh", "dash"},
    "/upper/usr/lib": set(),
    f"/upper/usr/lib/{_ARCH}": {"libc.so.6", "ld-linux-x86-64.so.2", "libnss_files.so.2", "libnss_dns.so.2", "libnss_compat.so.2"},
    "/upper/etc": set(),
}
LEFT_OUT = ("/upper/etc/ld.so.preload", "/upper/etc/ld.so.cache")
_MUST_BE_DIRS = {"/upper": ("usr", "etc"), "/upper/usr": ("bin", "lib"), "/upper/usr/lib": (_ARCH,)}
# NSS modules glibc and Debian's base ship; an /etc/nsswitch.conf naming others is left out (apptainer
# looks accounts up inside the instance when it starts one and at every exec)
NSS_MODULES = {"files", "dns", "compat", "db", "nis", "nisplus", "hesiod", "systemd", "myhostname", "mymachines", "resolve"}


def _foreign_nss(text: str) -> bool:
    for ln in text.splitlines():
        ln = ln.split("#", 1)[0]
        if ":" not in ln:
            continue
        toks = re.sub(r"\[[^]]*\]", " ", ln.split(":", 1)[1]).split()
        if any(t not in NSS_MODULES for t in toks):
            return True
    return False


_OPAQUE = ".wh..wh..opq"


def _is_dir(mode: str) -> bool:
    try:
        return int(mode, 8) & 0o170000 == 0o040000
    except ValueError:
        return False


def debugfs() -> str:
    """The host's debugfs (e2fsprogs); ``InfraError`` when it is missing."""
    found = shutil.which("debugfs") or shutil.which("debugfs", path="/usr/sbin:/sbin")
    if not found:
        raise InfraError("debugfs (e2fsprogs) is needed to check a kept state before it is started")
    return found


# Output of debugfs read per command: its listings and the small /etc files it prints are agent
# data (any bytes, any size: a 1 GB sparse file costs the agent no disk), read as bytes up to this.
DFS_LIMIT = 1 << 20
DFS_TIMEOUT_S = 60.0
# /etc files apptainer itself reads when it starts an instance: kept only as small regular files
START_READS = ("/upper/etc/nsswitch.conf", "/upper/etc/passwd", "/upper/etc/group")


def bounded_run(argv: list[str], limit: int, timeout_s: float) -> tuple[bytes, bytes, bool]:
    """(stdout, stderr, whether stdout was cut at ``limit``) of ``argv``; at most ``limit`` bytes
    of either are kept, the rest is never read: the process is killed. ``InfraError`` on timeout."""
    with tempfile.TemporaryFile() as errf:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=errf)
        assert proc.stdout is not None
        buf, cut = bytearray(), False
        deadline = time.monotonic() + timeout_s
        try:
            fd = proc.stdout.fileno()
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise InfraError(f"{argv[0]} {argv[-2][:80]!r} did not finish in {timeout_s:g} s")
                if not select.select([fd], [], [], min(left, 1.0))[0]:
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                buf += chunk
                if len(buf) > limit:
                    del buf[limit:]
                    cut = True
                    break
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()
        errf.seek(0)
        err = errf.read(limit)
    return bytes(buf), err, cut


def dfs_raw(img: Path, cmd: str, write: bool = False, limit: int = DFS_LIMIT) -> tuple[str, bool]:
    """debugfs's output for ``cmd`` as text (bytes it cannot decode kept as surrogate escapes), at
    most ``limit`` bytes, and whether it was cut there."""
    argv = [debugfs(), *(["-w"] if write else []), "-R", cmd, str(img)]
    out, err, cut = bounded_run(argv, limit, DFS_TIMEOUT_S)
    text, etext = out.decode("utf-8", "surrogateescape"), err.decode("utf-8", "surrogateescape")
    return text + ("\n" + etext if "not found" in etext or write else ""), cut


def dfs(img: Path, cmd: str, write: bool = False) -> str:
    """``dfs_raw`` without whether it was cut."""
    return dfs_raw(img, cmd, write)[0]


def _small_regular(img: Path, path: str, limit: int = 1 << 16) -> str | None:
    """The text of ``path`` in the image if it is a regular file of at most ``limit`` bytes, else
    None (a FIFO, device, socket, symlink, directory, or too large: never read)."""
    st = dfs(img, f"stat {path}")
    if "Type: regular" not in st:
        return None
    m = re.search(r"Size: (\d+)", st)
    if m is None or int(m.group(1)) > limit:
        return None
    text, cut = dfs_raw(img, f"cat {path}", limit=limit)
    return None if cut else text


def check_start(img: Path) -> tuple[list[str], list[str]]:
    """Check the kept overlay ``img`` (a private copy) before it is started: returns (paths that
    change what a start runs: refuse the state, paths left out of the copy). Reads and edits the
    image with debugfs, from the host: nothing of the state runs."""
    refused: list[str] = []
    for d, names in REFUSED.items():
        listing, cut = dfs_raw(img, f"ls -p {d}", limit=8 * DFS_LIMIT)
        if cut:
            refused.append(f"{d.removeprefix('/upper') or '/'} (too many entries to check)")
            continue
        modes = {parts[5]: parts[2] for ln in listing.splitlines() if (parts := ln.split("/")) and len(parts) > 6}
        entries = set(modes)
        path = d.removeprefix("/upper") or "/"
        for sub in _MUST_BE_DIRS.get(d, ()):  # e.g. /usr/bin made a link elsewhere
            if sub in modes and not _is_dir(modes[sub]):
                refused.append(f"{path.rstrip('/')}/{sub} (no longer a directory)")
        for e in sorted(entries):
            base = e.removeprefix(".wh.")
            if (
                e in names
                or base in names
                or e == _OPAQUE
                or (e.startswith(".wh.") and base in {"usr", "etc", "bin", "lib", "lib64", _ARCH})
            ):
                refused.append(f"{path.rstrip('/')}/{base}")
        if entries and "opaque" in dfs(img, f"ea_list {d}"):
            refused.append(f"{path} (made opaque)")
    left: list[str] = []
    if refused:
        return refused, left
    drop = list(LEFT_OUT)
    for p in START_READS:  # a FIFO, a huge sparse file, a foreign NSS module: the image's applies
        if "not found" in dfs(img, f"stat {p}"):
            continue
        text = _small_regular(img, p)
        if text is None or (p.endswith("nsswitch.conf") and _foreign_nss(text)):
            drop.append(p)
    for p in drop:
        if "not found" in dfs(img, f"stat {p}"):
            continue
        out = dfs(img, f"rm {p}", write=True)
        if "not found" not in dfs(img, f"stat {p}"):
            refused.append(f"{p.removeprefix('/upper')} (cannot be left out: {out.strip()[-120:]})")
        else:
            left.append(p.removeprefix("/upper"))
    return refused, left
