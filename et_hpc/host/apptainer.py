"""A thin subprocess wrapper around the ``apptainer`` command line (version, instances, exec, overlays).

Every failure raises ``InfraError`` carrying the command and the tail of its stderr. Every
apptainer command et-hpc runs gets ``clean_env()``: the caller's environment without any
``APPTAINER*``/``SINGULARITY*`` variable (they would bind, overlay or inject into a sandbox)
except ``ALLOWED`` (where apptainer keeps its own files; they change nothing a container sees).
``ignored_vars()`` names what was dropped (``et-hpc doctor`` warns). Callers also pass
``--cleanenv``, so what a sandbox sees comes only from the flags et-hpc passes and the run
config's ``sandbox.binds``. Why and what is tested: SECURITY.md ("The user's apptainer
settings").
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from et_hpc.errors import InfraError, UserError
from et_hpc.util import as_text, tail_lines

log = logging.getLogger(__name__)

NAME_MAX = 128  # instance names end up in file names (<name>.err etc.); 250+ fails here
_NAME_RE = re.compile(r"[^A-Za-z0-9._-]")


def exe() -> str:
    """The apptainer command as configured: ``$ET_HPC_APPTAINER``, else ``apptainer`` (sandboxes,
    image and base builds and ``et-hpc doctor`` all run this one)."""
    return os.environ.get("ET_HPC_APPTAINER") or "apptainer"


def binary() -> str:
    """The apptainer executable (``$ET_HPC_APPTAINER`` or ``apptainer`` on PATH)."""
    exe_ = exe()
    found = shutil.which(exe_)
    if not found:
        raise UserError(
            f"'{exe_}' was not found on PATH: load the apptainer module (e.g. 'module load apptainer') or set ET_HPC_APPTAINER to its path"
        )
    return found


# Kept from the caller's environment: where apptainer keeps its build temp, its layer cache and its
# per-user state (instances, remotes, keys). None of them changes what a container can see or write.
# et-hpc itself sets APPTAINER_TMPDIR and APPTAINER_CACHEDIR for builds (on node-local scratch).
ALLOWED = frozenset({"APPTAINER_TMPDIR", "APPTAINER_CACHEDIR", "APPTAINER_CONFIGDIR"})
_PREFIXES = ("APPTAINER", "SINGULARITY")


def _scrubbed(name: str) -> bool:
    return name.upper().startswith(_PREFIXES) and name not in ALLOWED


def clean_env(env: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``env`` (default: ours) without every ``APPTAINER*``/``SINGULARITY*`` variable but ``ALLOWED``,
    plus ``extra`` (what et-hpc itself sets, e.g. ``APPTAINER_TMPDIR`` for a build)."""
    src = os.environ if env is None else env
    out = {k: v for k, v in src.items() if not _scrubbed(k)}
    for k, v in extra.items():
        if _scrubbed(k):
            raise ValueError(f"{k} is not in the apptainer environment allowlist")
        out[k] = v
    return out


def host_env() -> dict[str, str]:
    """The environment apptainer itself runs with (``clean_env()``; kept under its old name)."""
    return clean_env()


def ignored_vars(env: dict[str, str] | None = None) -> list[str]:
    """The names of the variables in ``env`` (default: ours) that et-hpc drops before apptainer."""
    src = os.environ if env is None else env
    return sorted(k for k in src if _scrubbed(k))


def _tail(text: str | bytes | None, n: int = 800) -> str:
    """The last ``n`` characters of apptainer's stderr without its ``INFO:`` lines."""
    return "\n".join(tail_lines(as_text(text).strip(), raw=True, drop=lambda ln: ln.startswith("INFO:")))[-n:]


def run(
    args: list[str],
    *,
    timeout: float | None = 120.0,
    input: bytes | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[bytes]:
    """Run ``apptainer ARGS``; raise ``InfraError`` (with stderr's tail) on failure or timeout."""
    argv = [binary(), *args]
    log.debug("run: %s", " ".join(argv))
    try:
        cp = subprocess.run(
            argv,
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
            env=host_env(),
        )
    except subprocess.TimeoutExpired as e:
        raise InfraError(f"{' '.join(argv[:4])} … timed out after {timeout} s: {_tail(e.stderr)}") from e
    if check and cp.returncode != 0:
        raise InfraError(f"{' '.join(argv[:4])} … failed (exit {cp.returncode}): {_tail(cp.stderr)}")
    return cp


def version() -> str:
    out = run(["--version"], timeout=30).stdout.decode().strip()
    return out.split()[-1] if out else ""


def safe_name(name: str) -> str:
    """An instance name apptainer accepts: [A-Za-z0-9._-], at most ``NAME_MAX`` characters."""
    return _NAME_RE.sub("_", name)[:NAME_MAX]


@dataclass
class InstanceInfo:
    name: str
    pid: int
    image: str


def instance_list() -> list[InstanceInfo]:
    """This user's running instances on this host."""
    cp = run(["instance", "list", "--json"], timeout=60)
    try:
        data = json.loads(cp.stdout or b"{}")
    except json.JSONDecodeError as e:
        raise InfraError(f"apptainer instance list --json printed something that is not JSON: {e}") from e
    return [
        InstanceInfo(name=i.get("instance", ""), pid=int(i.get("pid") or 0), image=i.get("img", "")) for i in data.get("instances") or []
    ]


def instance_start(sif: Path | str, name: str, options: list[str], *, timeout: float = 120.0) -> None:
    run(["-s", "instance", "start", *options, str(sif), name], timeout=timeout)


def instance_files(name: str) -> list[Path]:
    """The state file(s) apptainer keeps for a running instance of this user (any host dir)."""
    base = Path(os.environ.get("APPTAINER_CONFIGDIR") or Path.home() / ".apptainer") / "instances" / "app"
    try:
        import getpass

        user = getpass.getuser()
    except Exception:  # noqa: BLE001
        user = "*"
    return list(base.glob(f"*/{user}/{name}/{name}.json"))


def instance_pid(name: str) -> int | None:
    """The pid ``apptainer instance list`` shows for a running instance of ours, read from the
    same state file it reads (written by apptainer on the host, outside every container), without
    starting apptainer; None when there is no single readable file naming a live process."""
    files = instance_files(name)
    if len(files) != 1:
        return None
    try:
        data = json.loads(files[0].read_text())
        pid = int(data.get("pid") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    if data.get("name") != name or pid <= 0 or not Path(f"/proc/{pid}").is_dir():
        return None
    return pid


def wait_gone(name: str, timeout: float = 10.0) -> bool:
    """Wait until apptainer has removed the instance's state (it does so just after ``stop``)."""
    deadline = time.monotonic() + timeout
    while instance_files(name):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def instance_stop(name: str, *, timeout_s: int = 0, check: bool = True) -> bool:
    """Stop an instance; ``timeout_s=0`` kills it at once (the fast path: ~0.1 s instead of ~2 s).

    Returns False when it was not running.
    """
    cp = run(["-s", "instance", "stop", "-t", str(timeout_s), name], timeout=60, check=False)
    if cp.returncode == 0:
        return True
    err = _tail(cp.stderr)
    if "no instance found" in err.lower() or "not found" in err.lower():
        return False
    if check:
        raise InfraError(f"apptainer instance stop {name} failed (exit {cp.returncode}): {err}")
    return False


def exec_argv(
    instance: str,
    argv: list[str],
    *,
    pwd: str | None = None,
    env: dict[str, str] | None = None,
) -> list[str]:
    """The argv of a fresh ``apptainer exec --cleanenv instance://NAME ARGV``."""
    cmd = [binary(), "-s", "exec", "--cleanenv"]
    if pwd:
        cmd += ["--pwd", pwd]
    for k, v in (env or {}).items():
        cmd += ["--env", f"{k}={v}"]
    return [*cmd, f"instance://{instance}", *argv]


_ROOTFS_IDS: dict[tuple[str, float], tuple[int, int] | None] = {}


def sif_rootfs(sif: Path | str) -> tuple[int, int] | None:
    """(descriptor id, byte offset) of a SIF's root filesystem partition, or None (cached per file)."""
    p = Path(sif)
    try:
        key = (str(p.resolve()), p.stat().st_mtime)
    except OSError:
        return None
    if key not in _ROOTFS_IDS:
        found = None
        cp = run(["sif", "list", str(p)], timeout=60, check=False)
        for line in cp.stdout.decode("utf-8", "replace").splitlines():
            cols = [c.strip() for c in line.split("|")]
            if len(cols) >= 5 and cols[0].isdigit() and "System" in cols[4] and cols[4].startswith("FS"):
                start = cols[3].split("-", 1)[0]
                found = (int(cols[0]), int(start) if start.isdigit() else -1)
                break
        _ROOTFS_IDS[key] = found
    return _ROOTFS_IDS[key]


def sif_rootfs_id(sif: Path | str) -> int | None:
    """The descriptor id of a SIF's root filesystem partition (for ``image-src`` binds), or None."""
    found = sif_rootfs(sif)
    return found[0] if found else None


def overlay_create(path: Path, size_mb: int, *, sparse: bool = True) -> None:
    """Create an ext3 overlay image of ``size_mb`` MiB (sparse: only written blocks use disk)."""
    args = ["-s", "overlay", "create", "--size", str(int(size_mb))]
    if sparse:
        args.append("--sparse")
    run([*args, str(path)], timeout=300)
