"""How Apptainer runs on this node: its flavour, its mode, and what builds and mounts can use.

``probe()`` returns a ``Runtime``: Apptainer or SingularityCE and the version (``--version``),
and the mode containers start in: ``setuid`` (a root-owned setuid ``starter-suid`` and ``allow
setuid = yes``: apptainer prefers it), ``userns`` (unprivileged user namespaces), ``apparmor``
(Ubuntu 24.04's ``kernel.apparmor_restrict_unprivileged_userns=1``: only programs with an AppArmor
profile get a namespace) or ``none`` (no namespace, no setuid starter: no container starts).
``et-hpc doctor`` shows it (``runtime_checks``), ``run.json`` records it (``Runtime.record``), and
a local run refuses mode ``none`` in one line (``refuse_unusable``). Docs: README ("Install").
"""

from __future__ import annotations

import platform
import re
import shutil
import stat
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from et_hpc.errors import UserError
from et_hpc.host import apptainer

SETUID, USERNS, APPARMOR, NONE = "setuid", "userns", "apparmor", "none"
APPARMOR_SYSCTL = Path("/proc/sys/kernel/apparmor_restrict_unprivileged_userns")
MAX_USERNS = Path("/proc/sys/user/max_user_namespaces")


def _run(cmd: list[str], timeout: float = 15) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=apptainer.clean_env())
    except (OSError, subprocess.TimeoutExpired):
        return None


def _read(p: Path) -> str | None:
    try:
        return p.read_text().strip()
    except OSError:
        return None


@dataclass
class Runtime:
    flavour: str = ""  # apptainer | singularity-ce | singularity ("" when not found)
    version: str = ""
    mode: str = NONE
    why: str = ""  # one line: how the mode was found
    max_user_namespaces: int | None = None
    userns_error: str = ""  # what creating a user namespace said ("" when it worked)
    starter_suid: str = ""  # the setuid starter's path, when usable
    allow_setuid: bool = False
    apparmor_restricted: bool = False
    kernel: str = ""

    def record(self) -> dict[str, Any]:
        """What ``run.json`` keeps (``runtime``): flavour, version, mode, kernel."""
        return {k: v for k, v in asdict(self).items() if k in ("flavour", "version", "mode", "kernel", "max_user_namespaces")}


def parse_version(text: str) -> tuple[str, str]:
    """``apptainer version 1.4.5`` -> ("apptainer", "1.4.5"); SingularityCE prints ``singularity-ce version 4.1.2``."""
    m = re.search(r"^\s*(\S+)\s+version\s+(\S+)", text or "", re.MULTILINE)
    return (m.group(1).lower(), m.group(2)) if m else ("", "")


def _buildcfg(exe: str) -> dict[str, str]:
    r = _run([exe, "buildcfg"])
    return dict(ln.split("=", 1) for ln in (r.stdout if r and r.returncode == 0 else "").splitlines() if "=" in ln)


def _conf_allows_setuid(path: str | None) -> bool:
    for line in ((_read(Path(path)) if path else None) or "").splitlines():
        k, _, v = line.partition("=")
        if k.strip() == "allow setuid" and not line.lstrip().startswith("#"):
            return v.strip().lower() == "yes"
    return False


def _starter_suid(cfg: dict[str, str], flavour: str) -> str:
    """The setuid starter's path when it is root-owned and setuid, else ""."""
    name = "singularity" if flavour.startswith("singularity") else "apptainer"
    p = Path(cfg.get("LIBEXECDIR", "/usr/libexec")) / name / "bin" / "starter-suid"
    try:
        st = p.stat()
    except OSError:
        return ""
    return str(p) if st.st_uid == 0 and st.st_mode & stat.S_ISUID else ""


def userns_error() -> str:
    """ "" when this process may create a user namespace, else what ``unshare`` said."""
    if not shutil.which("unshare"):
        return ""
    r = _run(["unshare", "--user", "--map-root-user", "true"])
    if r is None:
        return "unshare did not answer"
    return "" if r.returncode == 0 else (r.stderr.strip().splitlines() or ["failed"])[-1][:160]


def probe() -> Runtime:
    """This node's Apptainer runtime (module doc); a missing apptainer gives flavour "" and mode none."""
    rt = Runtime(kernel=platform.release())
    n = _read(MAX_USERNS)
    rt.max_user_namespaces = int(n) if n and n.isdigit() else None
    rt.apparmor_restricted = _read(APPARMOR_SYSCTL) == "1"
    rt.userns_error = userns_error()
    exe = shutil.which(apptainer.exe())
    if exe:
        r = _run([exe, "--version"])
        rt.flavour, rt.version = parse_version(r.stdout if r else "")
        cfg = _buildcfg(exe)
        conf = next((v for k, v in cfg.items() if k.endswith("_CONF_FILE")), None)
        rt.allow_setuid = _conf_allows_setuid(conf)
        rt.starter_suid = _starter_suid(cfg, rt.flavour)
    if rt.starter_suid and rt.allow_setuid:
        rt.mode, rt.why = SETUID, f"setuid starter {rt.starter_suid} and 'allow setuid = yes'"
    elif not rt.userns_error:
        rt.mode, rt.why = USERNS, f"unprivileged user namespaces (max_user_namespaces {rt.max_user_namespaces})"
    elif rt.apparmor_restricted:
        rt.mode, rt.why = APPARMOR, f"kernel.apparmor_restrict_unprivileged_userns=1 ({rt.userns_error})"
    else:
        rt.mode, rt.why = NONE, _no_namespace_why(rt)
    return rt


def _no_namespace_why(rt: Runtime) -> str:
    ns = "max_user_namespaces is 0" if rt.max_user_namespaces == 0 else f"no user namespace ({rt.userns_error})"
    suid = "a setuid starter that apptainer.conf forbids" if rt.starter_suid else "no setuid starter"
    return f"{ns} and {suid}: apptainer cannot start a container on this node"


def refuse_unusable(rt: Runtime | None = None) -> Runtime:
    """``UserError`` (one line) when no container can start on this node; else the runtime."""
    rt = rt or probe()
    if rt.mode == NONE and rt.flavour:
        raise UserError(f"{rt.why}: ask an admin for user namespaces (sysctl user.max_user_namespaces=15000) or run on another node")
    return rt


def run_record(executor: str) -> dict[str, Any]:
    """``run.json``'s ``runtime``: this node's flavour, version, mode and kernel (and Slurm's
    version for a Slurm run: the mode is the submitting node's; compute nodes are not asked)."""
    out: dict[str, Any] = {"host": platform.node(), **probe().record()}
    if executor == "slurm":
        r = _run(["scontrol", "--version"])
        out["slurm"] = (r.stdout.split() or [""])[-1] if r and r.returncode == 0 else None
    return out


def has_fakeroot_ids(user: str, uid: int) -> bool:
    """Whether ``/etc/subuid`` and ``/etc/subgid`` both have an entry for the user."""
    for path in ("/etc/subuid", "/etc/subgid"):
        text = _read(Path(path)) or ""
        if not any(ln.split(":", 1)[0] in (user, str(uid)) for ln in text.splitlines()):
            return False
    return True
