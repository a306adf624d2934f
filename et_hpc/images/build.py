"""The steps of one rootless image build: stage the def and its files, run apptainer, read the log.

``stage`` snapshots every copied-in file node-locally and points ``%files`` at the copies;
``run_build`` runs ``apptainer build --fakeroot`` in its own process group with a watchdog that
ends the group if the builder dies; ``failure_reason`` and ``interrupted`` read the log tail.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING

from et_hpc.host.apptainer import clean_env as apptainer_clean_env
from et_hpc.images import downloads

if TYPE_CHECKING:
    from et_hpc.images.store import ImageStoreConfig
    from et_hpc.tasks.model import NormalisedRecipe

log = logging.getLogger(__name__)

HOST_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
BUILD_CA_PATH = "/tmp/.et-hpc-build-ca.crt"  # where the bundle is bound during %post
_CA_EXPORTS = (
    f"if [ -r {BUILD_CA_PATH} ]; then export PIP_CERT={BUILD_CA_PATH} SSL_CERT_FILE={BUILD_CA_PATH} "
    f"REQUESTS_CA_BUNDLE={BUILD_CA_PATH} CURL_CA_BUNDLE={BUILD_CA_PATH} GIT_SSL_CAINFO={BUILD_CA_PATH}; fi"
)


def with_build_ca(text: str) -> str:
    """Make the first line of ``%post`` point pip, curl, requests and git at the bound CA bundle."""
    return post_prelude(text, _CA_EXPORTS)


def post_prelude(text: str, line: str) -> str:
    """``line`` inserted as the first line of ``%post`` (build-only settings; the key is unchanged)."""
    lines = text.splitlines(keepends=True)
    for i, ln in enumerate(lines):
        if ln.lstrip().startswith("%post") and (ln.strip() == "%post" or ln.strip()[5:6].isspace()):
            lines.insert(i + 1, f"    {line}\n")
            return "".join(lines)
    return text


def stage(recipe: NormalisedRecipe, work: Path, settings: ImageStoreConfig) -> dict[str, Path]:
    """Write the def into ``work`` with every copied-in file snapshotted beside it (node-local);
    returns where each copied-in file was staged (host path -> copy)."""
    mapping: dict[str, Path] = {}
    for i, (src, _dest) in enumerate(recipe.files):
        src = Path(src)
        staged = work / "files" / str(i) / (src.name or "root")
        staged.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir() and not src.is_symlink():
            shutil.copytree(src, staged, symlinks=True)
        else:
            shutil.copy2(src, staged, follow_symlinks=False)
        mapping[str(src)] = staged
    (work / "container.def").write_text(as_built(recipe.text, mapping, settings))
    return mapping


def as_built(text: str, mapping: dict[str, Path], settings: ImageStoreConfig) -> str:
    """A def as the build runs it: ``%files`` from the staged copies, the build-only preludes
    (CA bundle, download cache) first in ``%post``."""
    text = retarget_files(text, mapping)
    if settings.build_ca() is not None:
        text = with_build_ca(text)
    if settings.downloads_dir(Path()) is not None:
        text = post_prelude(text, downloads.EXPORTS)
    return text


def run_build(
    settings: ImageStoreConfig,
    work: Path,
    out: Path,
    lf: IO[str],
    scratch: Path,
    shared_downloads: Path | None = None,
    *,
    def_name: str = "container.def",
    sandbox: bool = False,
) -> tuple[int | None, str | None]:
    """Run ``apptainer build`` of ``work/<def_name>`` into ``out`` (a SIF, or a root directory with
    ``sandbox``): (exit status, None) or (None, reason); ``shared_downloads``: the download cache
    bound into the build (et_hpc.images.downloads)."""
    s = settings
    if not shutil.which(s.apptainer):
        return None, f"{s.apptainer} not found on PATH: install Apptainer or 'module load apptainer'"
    env = apptainer_clean_env()  # no APPTAINER_*/SINGULARITY_* of the caller's (host/apptainer.py)
    tmpdir = work / "apptainer-tmp"
    tmpdir.mkdir(exist_ok=True)
    env["APPTAINER_TMPDIR"] = str(tmpdir)
    env.setdefault("APPTAINER_CACHEDIR", str(scratch / "apptainer-cache"))
    cmd = [s.apptainer, "build", "--fakeroot", "--force", *(["--sandbox"] if sandbox else []), str(out), def_name]
    ca = s.build_ca()
    if ca is not None:
        cmd[2:2] = ["--bind", f"{ca}:{BUILD_CA_PATH}:ro"]
    if shared_downloads is not None:
        cmd[2:2] = downloads.bind_args(downloads.prepare(shared_downloads))
    lf.write(f"$ cd {work} && {' '.join(cmd)}\n")
    lf.flush()
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)
    guard = _start_watchdog(proc.pid)
    try:
        return proc.wait(timeout=s.build_timeout_s), None
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return None, f"build timed out after {s.build_timeout_s:.0f} s (raise build_timeout_s or ET_HPC_BUILD_TIMEOUT)"
    except BaseException:
        _kill_group(proc)
        raise
    finally:
        _stop_watchdog(guard)


# Lines that say why a build failed, most telling first; the last matching line of the log wins.
_REASONS = [
    re.compile(p)
    for p in (
        r"curl: \(\d+\).*",
        r"wget: .*(unable|failed|error).*",
        r"^E: .*",
        r"ERROR: (Could not find a version|No matching distribution).*",
        r"^(ERROR|error): .*",
        r".*: command not found",
        r".*(Could not resolve host|Temporary failure (in )?(name )?resolution|Name or service not known).*",
        r".*No such file or directory.*",
        r"^(FATAL|ERROR): .*",
    )
]
_NOISE = re.compile(r"^(INFO|WARNING|VERBOSE|DEBUG):|^#|^\$ ")


_SIGNALLED = re.compile(r"exit status (130|137|143)\b|signal: (killed|terminated|interrupt)", re.I)


def interrupted(rc: int | None, tail: list[str]) -> bool:
    """Did the build die of a signal (ours or a step's: SIGINT, SIGKILL, SIGTERM) rather than fail?"""
    if rc is None:
        return False
    if rc < 0 or rc in (130, 137, 143):
        return True
    return any(_SIGNALLED.search(ln) for ln in tail[-5:])


def failure_reason(lines: list[str]) -> str | None:
    """The most telling error line of a build log tail, as one line."""
    clean = [ln.strip() for ln in lines if ln.strip()]
    for rx in _REASONS:
        for ln in reversed(clean):
            m = rx.search(ln)
            if m and not _NOISE.match(ln):
                return re.sub(r"\s+", " ", m.group(0))[:300]  # from the match: drops progress-meter junk
    for ln in reversed(clean):
        if not _NOISE.match(ln):
            return re.sub(r"\s+", " ", ln)[:300]
    return None


def default_jobs() -> int:
    """Parallel builds by default: half the cores (a build is itself multi-threaded), at least one."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, n // 2)


def retarget_files(text: str, mapping: dict[str, Path]) -> str:
    """Point ``%files`` sources named in ``mapping`` (host path -> staged copy) at the staged copies."""
    out, in_files = [], False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("%"):
            name, _, args = stripped[1:].partition(" ")
            in_files = name in ("files", "appfiles") and not args.strip().startswith("from ")
        elif in_files and stripped and not stripped.startswith("#"):
            try:
                toks = shlex.split(stripped)
            except ValueError:
                toks = []
            if toks and toks[0] in mapping:
                indent = line[: len(line) - len(line.lstrip())]
                line = indent + " ".join(shlex.quote(t) for t in [str(mapping[toks[0]]), *toks[1:]])
        out.append(line)
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Runs beside a build: when the building process dies (even by SIGKILL) its end of the pipe closes
# and this ends the build's process group, which apptainer's fakeroot helpers would otherwise outlive.
_WATCHDOG = """
import os, signal, sys, time
pgid = int(sys.argv[1])
if sys.stdin.read() != "done":
    for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        end = time.monotonic() + grace
        while time.monotonic() < end:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                sys.exit(0)
            time.sleep(0.2)
"""


def _start_watchdog(pgid: int) -> subprocess.Popen | None:
    try:
        return subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, str(pgid)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            text=True,
        )
    except OSError as e:
        log.warning("no watchdog for build group %s: %s", pgid, e)
        return None


def _stop_watchdog(guard: subprocess.Popen | None) -> None:
    if guard is None:
        return
    try:
        guard.communicate("done", timeout=30)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        guard.kill()
        guard.wait()


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# A user namespace mapped as Apptainer's fakeroot maps it (root = the user, then the subordinate
# ids), where the files of a fakeroot build have their image's owners and can be read and removed.
USERNS = ["unshare", "--map-auto", "--map-root-user"]


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():  # files owned by mapped ids (fakeroot): remove inside a user namespace
        subprocess.run([*USERNS, "rm", "-rf", str(path)], capture_output=True)
