"""Base images: the SIF that task defs name as ``From: ./ubuntu_22.04.sif``.

Made one of three ways, chosen automatically unless ``source=`` says: ``docker`` (``apptainer
build --fakeroot`` from ``docker://ubuntu:22.04``), ``debian`` (offline: ``mmdebstrap`` plus the
compatibility layer ``defs/base/debian-compat.sh``) or ``sif`` (import one you have,
``--from-sif``). The result is published by atomic rename into the image cache
(``<cache>/base/<name>.sif`` with a ``.json`` digest sidecar); a second call finds it and returns
at once. Specification: docs/images.md ("Base images").
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from et_hpc import paths
from et_hpc.errors import UserError
from et_hpc.host import apptainer
from et_hpc.host.doctor import OK, WARN, Check
from et_hpc.tasks.base_names import ALIASES, DEFAULT_NAME, base_dir, base_path, default_base_map  # noqa: F401
from et_hpc.util import atomic_write_text, sha256_file

log = logging.getLogger(__name__)

DEBIAN_PACKAGES = ["python3", "python3-pytest", "python3-pip", "python3-venv", "ca-certificates", "procps"]
DEFAULT_MIRROR = "http://deb.debian.org/debian"
DEFAULT_SUITE = "bookworm"
REGISTRY_PROBE = os.environ.get("ET_HPC_REGISTRY_PROBE", "registry-1.docker.io:443")


@dataclass
class BaseImage:
    name: str
    path: Path
    digest: str  # sha256 of the SIF file
    source: str  # docker | debian | sif
    cached: bool  # True when it was already there
    seconds: float = 0.0

    def to_json(self) -> dict:
        d = asdict(self)
        d["path"] = str(self.path)
        return d


def registry_reachable(probe: str = REGISTRY_PROBE, timeout: float = 3.0) -> bool:
    """Can we open a TCP connection to the container registry? (DNS failure: no, at once.)"""
    host, _, port = probe.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def choose_source(source: str = "auto") -> str:
    if source in ("docker", "debian", "sif"):
        return source
    if source != "auto":
        raise UserError(f"unknown base image source {source!r}: use auto, docker, debian or sif")
    if registry_reachable():
        return "docker"
    if shutil.which("mmdebstrap"):
        return "debian"
    raise UserError(
        "no container registry reachable and mmdebstrap not installed: install mmdebstrap "
        "(apt-get install mmdebstrap), or pull the image where there is network "
        "(apptainer pull ubuntu_22.04.sif docker://ubuntu:22.04) and run 'et-hpc base build --from-sif ubuntu_22.04.sif'"
    )


def cached_base(name: str = DEFAULT_NAME, cache: Path | None = None) -> BaseImage | None:
    """The cached base image, if present and its sidecar matches the file (size and mtime)."""
    sif = base_path(name, cache)
    meta_path = sif.with_suffix(".json")
    try:
        meta = json.loads(meta_path.read_text())
        st = sif.stat()
    except (OSError, ValueError):
        return None
    if meta.get("size") != st.st_size or meta.get("mtime_ns") != st.st_mtime_ns:
        return None
    return BaseImage(name=name, path=sif, digest=meta["digest"], source=meta.get("source", "?"), cached=True)


def ensure_base(
    source: str = "auto",
    *,
    name: str = DEFAULT_NAME,
    cache: Path | None = None,
    force: bool = False,
    from_sif: Path | None = None,
    mirror: str = DEFAULT_MIRROR,
    suite: str = DEFAULT_SUITE,
) -> BaseImage:
    """Return the base image, building it first if it is not in the cache."""
    if not force:
        hit = cached_base(name, cache)
        if hit:
            return hit
    from filelock import FileLock  # one builder per cache; waiters find the result afterwards

    bdir = base_dir(cache)
    bdir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(bdir / f".{name}.lock")):
        if not force:
            hit = cached_base(name, cache)
            if hit:
                return hit
        if from_sif is not None:
            source = "sif"
        src = choose_source(source)
        t0 = time.monotonic()
        tmp_out = bdir / f".tmp-{name}-{os.getpid()}.sif"
        try:
            if src == "sif":
                if from_sif is None or not Path(from_sif).is_file():
                    raise UserError(f"--from-sif {from_sif}: file not found")
                shutil.copyfile(from_sif, tmp_out)
            elif src == "docker":
                _build_docker(tmp_out)
            else:
                _build_debian(tmp_out, mirror=mirror, suite=suite)
            digest = sha256_file(tmp_out)
            os.replace(tmp_out, base_path(name, cache))
        finally:
            tmp_out.unlink(missing_ok=True)
        sif = base_path(name, cache)
        st = sif.stat()
        meta = {
            "name": name,
            "source": src,
            "digest": digest,
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "host": socket.gethostname(),
            "suite": suite if src == "debian" else None,
        }
        atomic_write_text(sif.with_suffix(".json"), json.dumps(meta, indent=1))
        return BaseImage(name, sif, digest, src, cached=False, seconds=time.monotonic() - t0)


def _run(cmd: list[str], what: str, log_file: Path, **kw) -> None:
    log.info("%s: %s", what, " ".join(cmd))
    with open(log_file, "ab") as lf:
        lf.write(f"\n$ {' '.join(cmd)}\n".encode())
        lf.flush()
        r = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, **kw)
    if r.returncode != 0:
        tail = log_file.read_text(errors="replace").strip().splitlines()[-5:]
        raise UserError(f"{what} failed (exit {r.returncode}); log {log_file}: " + " | ".join(tail))


def _build_env() -> dict[str, str]:
    """Apptainer's environment for a base build: ``apptainer.clean_env()`` with its temp and
    cache directories on scratch unless the caller chose them."""
    env = apptainer.clean_env()
    scratch = paths.scratch_dir()
    env.setdefault("APPTAINER_TMPDIR", str(scratch))
    env.setdefault("APPTAINER_CACHEDIR", str(scratch / "apptainer-cache"))
    return env


def _log_file() -> Path:
    d = paths.cache_dir() / "logs"
    d.mkdir(parents=True, exist_ok=True)
    return d / f"base-{time.strftime('%Y%m%d-%H%M%S')}.log"


def _build_docker(out: Path) -> None:
    if not shutil.which(apptainer.exe()):
        raise UserError("apptainer not found on PATH: install Apptainer >= 1.3 or 'module load apptainer'")
    definition = paths.repo_root() / "defs" / "base" / "ubuntu_22.04-docker.def"
    _run(
        [apptainer.exe(), "build", "--fakeroot", "--force", str(out), str(definition)],
        "apptainer build (docker base)",
        _log_file(),
        env=_build_env(),
    )


def _build_debian(out: Path, *, mirror: str, suite: str) -> None:
    for tool in ("mmdebstrap", apptainer.exe(), "unshare"):
        if not shutil.which(tool):
            raise UserError(f"{tool} not found on PATH: the offline base build needs mmdebstrap, apptainer and unshare")
    compat = paths.repo_root() / "defs" / "base" / "debian-compat.sh"
    logf = _log_file()
    with tempfile.TemporaryDirectory(prefix="base-", dir=paths.scratch_dir()) as tmp:
        tar = Path(tmp) / "rootfs.tar"
        rootfs = Path(tmp) / "rootfs"
        _run(
            [
                "mmdebstrap",
                "--mode=unshare",
                "--variant=minbase",
                "--include=" + ",".join(DEBIAN_PACKAGES),
                f"--customize-hook=copy-in {compat} /tmp",
                '--customize-hook=chroot "$1" sh /tmp/debian-compat.sh',
                '--customize-hook=rm -f "$1"/tmp/debian-compat.sh',
                suite,
                str(tar),
                mirror,
            ],
            "mmdebstrap",
            logf,
        )
        rootfs.mkdir()
        try:
            _run(
                ["unshare", "--map-auto", "--map-root-user", "tar", "-C", str(rootfs), "--exclude=./dev/*", "-xf", str(tar)],
                "unpack rootfs",
                logf,
            )
            tar.unlink()
            _run(
                [apptainer.exe(), "build", "--fakeroot", "--force", str(out), str(rootfs)],
                "apptainer build (debian base)",
                logf,
                env=_build_env(),
            )
        finally:
            # Files belong to mapped ids: remove them inside the same kind of namespace.
            subprocess.run(["unshare", "--map-auto", "--map-root-user", "rm", "-rf", str(rootfs)], capture_output=True)


def check_base() -> Check:
    b = cached_base()
    if b is None:
        return Check("base image", WARN, f"{DEFAULT_NAME}.sif not built yet", "run: et-hpc base build")
    return Check("base image", OK, f"{b.path} ({b.source}, sha256 {b.digest[:12]})")
