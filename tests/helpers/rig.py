"""The multi-node rig (scripts/rig, docs/rig.md) as the cluster tests see it: nodes rig1..rig3 in
partition ``multi``, commands run on a chosen node as batch jobs, and node loss through the one
root helper provisioning allows (``sudo -n /usr/local/sbin/et-rig kill|up rigN``).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

PARTITION = "multi"
NODES = ("rig1", "rig2", "rig3")
RIG = "/usr/local/sbin/et-rig"
UP = ("idle", "mixed", "allocated", "completing", "planned", "reserved")  # states of a node that runs jobs


def node_states() -> dict[str, str]:
    """Slurm's state of each rig node ("" when Slurm does not list it)."""
    r = subprocess.run(["sinfo", "-h", "-N", "-p", PARTITION, "-o", "%N %T"], capture_output=True, text=True, timeout=30)
    got = dict(line.split(None, 1) for line in r.stdout.splitlines() if line.strip())
    return {n: got.get(n, "").strip() for n in NODES}


def missing() -> str | None:
    """Why the rig is not usable here, or None."""
    if not shutil.which("sinfo"):
        return "Slurm is not installed (run scripts/provision-debian as root)"
    try:
        states = node_states()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"sinfo failed: {e}"
    down = {n: s for n, s in states.items() if s not in UP}
    if down:
        return f"the multi-node rig is not up ({down}): as root, scripts/rig up (docs/rig.md)"
    return node_local_paths()


def node_local_paths() -> str | None:
    """Why the nodes cannot see the code or the folder a job starts in: each node has its own /tmp,
    so a checkout, virtualenv or working directory under /tmp exists on this host only."""
    import et_hpc

    seen = (("the checkout", Path(et_hpc.__file__).parent), ("the virtualenv", Path(sys.prefix)), ("the working directory", Path.cwd()))
    for what, path in seen:
        real = path.resolve()
        if real == Path("/tmp") or Path("/tmp") in real.parents:
            return f"{what} ({real}) is under /tmp, which each rig node has its own of: clone and install elsewhere (docs/rig.md)"
    return None


def shared_dir(tag: str) -> Path:
    """A fresh folder on the filesystem every node shares (the home), unlike /tmp (node-local)."""
    d = Path.home() / ".cache" / "et-hpc-rig-tests" / f"{tag}-{uuid.uuid4().hex[:8]}"
    d.mkdir(parents=True)
    return d


def on_node(node: str, argv: list[str], out: Path, *, env: dict[str, str] | None = None, time_min: int = 10) -> subprocess.Popen:
    """Start ``argv`` on ``node`` as a batch job (``sbatch --wait``; stdout and stderr to ``out``).
    The job gets this process's environment (sbatch's default), plus ``env``."""
    cmd = " ".join(shlex.quote(a) for a in argv)
    full_env = {**os.environ, **(env or {})}
    return subprocess.Popen(
        [
            "sbatch",
            "--wait",
            "--quiet",
            "-p",
            PARTITION,
            "-w",
            node,
            "-N",
            "1",
            "-c",
            "1",
            f"--time={time_min}",
            "-o",
            str(out),
            "--wrap",
            cmd,
        ],
        env=full_env,
        text=True,
    )


def on_nodes(jobs: dict[str, list[str]], folder: Path, *, env: dict[str, str] | None = None, timeout_s: float = 600) -> dict[str, str]:
    """Run one command per node at once (``{node: argv}``); each node's output, after all ended (a
    job that failed fails the test with its output)."""
    procs = {n: on_node(n, argv, folder / f"{n}.out", env=env) for n, argv in jobs.items()}
    outs = {}
    for n, p in procs.items():
        rc = p.wait(timeout=timeout_s)
        text = (folder / f"{n}.out").read_text() if (folder / f"{n}.out").exists() else ""
        assert rc == 0, f"job on {n} failed ({rc}):\n{text[-3000:]}"
        outs[n] = text
    return outs


def python(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


def rig(*args: str) -> subprocess.CompletedProcess:
    """The root helper provisioning installs for the node-loss test (kill/up one node)."""
    return subprocess.run(["sudo", "-n", RIG, *args], capture_output=True, text=True, timeout=300)
