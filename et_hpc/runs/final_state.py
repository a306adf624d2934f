"""Kept final states: what an agent changed, archived beside its run for rescoring.

With ``sandbox.keep_final_state`` an episode's sparse overlay image is archived from the host,
without root, after the instance stopped and before it is deleted, as
``<run_dir>/final-state/<sha256>.tar.gz`` (content-addressed; readers check the digest). The
record's ``final_state`` is ``sha256:<hex>``, ``not kept: <why>`` (too large, or failed: never
the episode's failure) or null. Also offers reading a kept state back (``kept_tests``; what
a start would run is checked by ``et_hpc.scoring.start_check``). Format, what it does
not hold, how to look inside: docs/rescore.md; its security: SECURITY.md.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import shutil
import subprocess
import time
import zlib
from pathlib import Path

from et_hpc.errors import InfraError

log = logging.getLogger(__name__)

DIR = "final-state"
MEMBER = "overlay.img"
PREFIX = "sha256:"
NOT_KEPT = "not kept: "
_HEX = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 20


def digest_of(value: str | None) -> str | None:
    """The hex digest a record's ``final_state`` names, or None (not kept, not asked for, malformed)."""
    if not value or not value.startswith(PREFIX):
        return None
    hx = value[len(PREFIX) :]
    return hx if _HEX.match(hx) else None


def archive_path(run_dir: Path, value: str) -> Path:
    hx = digest_of(value)
    if hx is None:
        raise InfraError(f"{value!r} does not name a kept state")
    return Path(run_dir) / DIR / f"{hx}.tar.gz"


def _holders(path: Path) -> list[int]:
    """Our processes that hold ``path`` open (fuse2fs serves the image through a file descriptor)."""
    target = os.path.realpath(path)
    me = os.getuid()
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid != me:
                continue
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    out.append(int(pid))
                    break
            except OSError:
                continue
    return out


def wait_unused(path: Path, timeout_s: float = 10.0) -> bool:
    """True once no process of ours holds ``path`` open (its FUSE daemon has flushed and exited)."""
    deadline = time.monotonic() + timeout_s
    while _holders(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def keep(overlay: Path, run_dir: Path, limit_mb: float) -> str:
    """Archive ``overlay`` into ``run_dir``'s content-addressed store; the record's ``final_state``.

    Never raises: a state over ``limit_mb`` compressed, or any failure, gives ``"not kept: <why>"``.
    """
    try:
        return _keep(Path(overlay), Path(run_dir), limit_mb)
    except Exception as e:  # noqa: BLE001 - keeping the state must never fail the episode
        log.warning("could not keep the final state %s: %s", overlay, e)
        return f"{NOT_KEPT}{type(e).__name__}: {e}"[:300]


def _keep(overlay: Path, run_dir: Path, limit_mb: float) -> str:
    if not overlay.is_file():
        return f"{NOT_KEPT}no overlay image ({overlay} is gone)"
    if not wait_unused(overlay):
        return f"{NOT_KEPT}the overlay is still in use after the instance stopped"
    limit = int(limit_mb * 2**20)
    store = run_dir / DIR
    store.mkdir(parents=True, exist_ok=True)
    tmp = store / f".tmp-{os.getpid()}-{secrets.token_hex(4)}"
    argv = [
        "tar",
        "--sparse",
        "--numeric-owner",
        "-C",
        str(overlay.parent),
        "-cf",
        "-",
        f"--transform=s|^{re.escape(overlay.name)}$|{MEMBER}|",
        overlay.name,
    ]
    h = hashlib.sha256()
    z = zlib.compressobj(6, zlib.DEFLATED, 31)  # gzip framing: `tar -xzf` reads it
    written = 0
    over = False
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        with open(tmp, "wb") as f:
            assert proc.stdout is not None
            while chunk := proc.stdout.read(_CHUNK):
                data = z.compress(chunk)
                if data:
                    h.update(data)
                    f.write(data)
                    written += len(data)
                if written > limit:
                    over = True
                    break
            if not over:
                data = z.flush()
                h.update(data)
                f.write(data)
                written += len(data)
                over = written > limit
            if not over:
                f.flush()
                os.fsync(f.fileno())
        if over:
            proc.kill()
        proc.wait(timeout=60)
        err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
        if over:
            return f"{NOT_KEPT}larger than sandbox.final_state_mb={limit_mb:g} compressed"
        if proc.returncode != 0:
            return f"{NOT_KEPT}tar failed (exit {proc.returncode}): {err[-200:]}"
        hx = h.hexdigest()
        dst = store / f"{hx}.tar.gz"
        if dst.exists():
            tmp.unlink()  # the same state is already kept
        else:
            os.replace(tmp, dst)
        return f"{PREFIX}{hx}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for s in (proc.stdout, proc.stderr):
            if s is not None:
                s.close()
        tmp.unlink(missing_ok=True)


def size_of(run_dir: Path, value: str | None) -> int | None:
    """Bytes of the kept archive a ``final_state`` names, or None."""
    try:
        return archive_path(run_dir, value or "").stat().st_size
    except (InfraError, OSError):
        return None


def link_into(src_run: Path, dst_run: Path, value: str) -> Path:
    """The kept state ``value`` of ``src_run`` also under ``dst_run`` (a hard link where the
    filesystem allows, else a copy), so a rescored run holds the states its records name."""
    src = archive_path(src_run, value)
    dst = archive_path(dst_run, value)
    if dst.exists():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
    return dst


def extract(archive: Path, value: str, dest: Path) -> Path:
    """Unpack the kept overlay image of ``archive`` (named ``value``) to the file ``dest``, sparse.

    The archive's sha256 must be the one its name gives (checked on the bytes tar reads); only the
    one member ``overlay.img`` is taken, as a regular file. Raises ``InfraError`` otherwise.
    """
    hx = digest_of(value)
    if hx is None:
        raise InfraError(f"{value!r} does not name a kept state")
    work = dest.parent / f".{dest.name}.x{secrets.token_hex(4)}"
    work.mkdir(mode=0o700)
    try:
        h = hashlib.sha256()
        proc = subprocess.Popen(
            ["tar", "-xz", "--sparse", "--no-same-owner", "--no-same-permissions", "-C", str(work), "-f", "-", MEMBER],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        assert proc.stdin is not None
        try:
            with open(archive, "rb") as f:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
                    proc.stdin.write(chunk)
        except BrokenPipeError:
            pass
        except OSError as e:
            proc.kill()
            raise InfraError(f"cannot read kept state {archive}: {e}") from None
        finally:
            try:
                proc.stdin.close()
            except BrokenPipeError:
                pass
        err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
        proc.wait()
        if h.hexdigest() != hx:
            raise InfraError(f"kept state {archive} does not match its digest (changed or damaged)")
        img = work / MEMBER
        if proc.returncode != 0 or img.is_symlink() or not img.is_file():
            raise InfraError(f"kept state {archive} did not unpack: {err[-200:] or 'no ' + MEMBER}")
        img.chmod(0o600)
        os.replace(img, dest)
        return dest
    finally:
        shutil.rmtree(work, ignore_errors=True)


TESTS_DIR = "tests"


def file_digest(path: Path) -> str:
    """``"sha256:<hex>"`` of a file's bytes (what records name test files by)."""
    return PREFIX + hashlib.sha256(Path(path).read_bytes()).hexdigest()


def keep_tests(run_dir: Path, path: Path) -> str:
    """Keep a copy of the final test file that scored a kept state (``<run_dir>/final-state/tests/<hex>``),
    so a rescore can show what changed in the tests; returns its ``"sha256:<hex>"``."""
    data = Path(path).read_bytes()
    hx = hashlib.sha256(data).hexdigest()
    d = Path(run_dir) / DIR / TESTS_DIR
    dst = d / hx
    if not dst.exists():
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".tmp-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.write_bytes(data)
        os.replace(tmp, dst)
    return PREFIX + hx


def kept_tests(run_dir: Path, digest: str | None) -> str | None:
    """The text of a test file ``keep_tests`` kept under ``run_dir``, or None."""
    hx = digest_of(digest)
    if hx is None:
        return None
    try:
        return (Path(run_dir) / DIR / TESTS_DIR / hx).read_text(errors="replace")
    except OSError:
        return None
