"""A cold sandbox lifecycle side by side: et-hpc vs hermes-agent's and mini-swe-agent's Apptainer
environments, in one run; et-hpc's memory per live sandbox; starts from a node-local image copy.

Run as an unprivileged user (apptainer refuses root here):
    python bench/bench_peers.py [--reps 10] [--sif PATH] [--peers-venv DIR] [--mem-sandboxes 4] [--markdown]

One lifecycle = a new sandbox on the base SIF, the same 10 shell commands (each checked), teardown.
- et-hpc: ``Sandbox(sif).start()``, ``sandbox.shell()``, ``shell.run`` x10, ``sandbox.stop()``.
- et-hpc unpacked: the same from the SIF's root filesystem unpacked once on this node
  (``sandbox.local_copy: unpack``, ``et_hpc.images.local_copy.local_tree``; unpacked before the
  rounds, untimed: its cost is reported with the local copy's).
- et-hpc warm: what stays on an episode's critical path with ``sandbox.warm``: the sandbox and its
  shell are started ahead (``warm.start_ready``, untimed), then the pool's hand-out check, the 10
  commands and the hand-back to the pool (``WarmPool.retire``, which stops it in the background)
  are timed; that background stop is reported beside it, and waited for before the next lifecycle.
- hermes-agent: ``tools.terminal_tool._create_environment("singularity", sif, ...)`` (what its
  terminal tool calls), ``env.execute`` x10, ``env.cleanup()``. Its default container limits
  (``container_cpu=1``, ``container_memory=5120``) make apptainer ask for cgroups, which a rootless
  node without systemd refuses, so they are set to 0 (what a user there must do); the rest is its
  defaults (persistent overlay directory, a fresh ``task_id`` per lifecycle so each one is cold).
- mini-swe-agent: ``minisweagent.environments.singularity.SingularityEnvironment(image=sif,
  executable="apptainer")`` (``build --sandbox``, then ``exec --writable`` per command),
  ``env.execute({"command": ...})`` x10, ``env.cleanup()``.

The peers live in their own virtualenv (default ``~/peers-venv``; created with
``python3 -m venv DIR && DIR/bin/pip install hermes-agent mini-swe-agent`` when missing; they are
not et-hpc dependencies). Each peer runs in a long-lived driver process (this file with
``--driver NAME`` under the peers' interpreter) that times one lifecycle per request, so imports are
not counted, and the three are interleaved round by round (order rotated) so machine noise hits all
alike. Before each lifecycle (untimed) ``sync`` flushes the previous one's dirty pages: without
it, an et-hpc teardown right after mini-swe-agent's (which writes and deletes a ~300 MB sandbox
directory) waited 1-1.5 s for the disk in its FUSE unmount. One warm-up round is not counted. Times are wall-clock
inside the process doing the lifecycle.

Memory: ``--mem-sandboxes`` et-hpc sandboxes live at once, each with its shell; the processes a
sandbox adds are its instance's session (monitor, appinit, squashfuse/fuse2fs/fuse-overlayfs) and
its shell's ``apptainer exec`` subtree; RSS and PSS (``smaps_rollup``) summed, per sandbox.

Local copy: the cost of making a node-local copy (``et_hpc.images.local_copy.local_image``) of the
SIF and of unpacking it (``local_tree``), and sandbox starts from the cache path vs from the copy
vs from the unpacked tree, interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

COMMANDS = [
    ("echo hello", "hello"),
    ("uname -s", "Linux"),
    ("head -n 1 /etc/os-release", "NAME="),
    ("mkdir -p /opt/w && echo made", "made"),
    ("printf 'a\\nb\\nc\\n' > /opt/w/f.txt && echo wrote", "wrote"),
    ("wc -l < /opt/w/f.txt", "3"),
    ("grep -c b /opt/w/f.txt", "1"),
    ("ls /opt/w", "f.txt"),
    ("sort -r /opt/w/f.txt | head -n 1", "c"),
    ("rm -rf /opt/w && echo done", "done"),
]
PEERS = ("hermes", "mini")
PEER_PACKAGES = ["hermes-agent", "mini-swe-agent"]


def _check(outputs: list[str]) -> list[str]:
    return [f"{cmd!r}: {out.strip()[-200:]!r}" for (cmd, want), out in zip(COMMANDS, outputs) if want not in out]


# -- peer drivers (run under the peers' interpreter) -----------------------------------------


def _hermes_lifecycle(sif: str) -> tuple[float, float, float, list[str]]:
    from tools.terminal_tool import _create_environment

    t0 = time.perf_counter()
    env = _create_environment(
        "singularity", sif, "/", 60, task_id=f"bench-{uuid.uuid4().hex[:8]}", container_config={"container_cpu": 0, "container_memory": 0}
    )
    t1 = time.perf_counter()
    outs = [env.execute(cmd)["output"] for cmd, _ in COMMANDS]
    t2 = time.perf_counter()
    env.cleanup()
    return t1 - t0, t2 - t1, time.perf_counter() - t2, outs


def _mini_lifecycle(sif: str) -> tuple[float, float, float, list[str]]:
    from minisweagent.environments.singularity import SingularityEnvironment

    t0 = time.perf_counter()
    env = SingularityEnvironment(image=sif, executable="apptainer")
    t1 = time.perf_counter()
    outs = [env.execute({"command": cmd})["output"] for cmd, _ in COMMANDS]
    t2 = time.perf_counter()
    env.cleanup()
    return t1 - t0, t2 - t1, time.perf_counter() - t2, outs


def driver(name: str, sif: str) -> None:
    """Serve lifecycles: one JSON line per ``run`` line on stdin, until EOF."""
    out = os.fdopen(os.dup(1), "w")  # ours; whatever the peers print goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    home = tempfile.mkdtemp(prefix=f"bench-{name}-home-")
    os.environ["HERMES_HOME"] = home  # hermes keeps overlays and snapshots under its home
    os.environ["MSWEA_GLOBAL_CONFIG_DIR"] = home
    fn = _hermes_lifecycle if name == "hermes" else _mini_lifecycle
    import importlib.metadata as md

    pkg = "hermes-agent" if name == "hermes" else "mini-swe-agent"
    print(json.dumps({"version": md.version(pkg)}), file=out, flush=True)
    try:
        for line in sys.stdin:
            if line.strip() != "run":
                continue
            try:
                setup, cmds, stop, outs = fn(sif)
                print(json.dumps({"setup_s": setup, "cmds_s": cmds, "stop_s": stop, "bad": _check(outs)}), file=out, flush=True)
            except Exception as e:  # noqa: BLE001 - reported to the parent
                print(json.dumps({"error": f"{type(e).__name__}: {str(e)[-500:]}"}), file=out, flush=True)
    finally:
        shutil.rmtree(home, ignore_errors=True)


class Peer:
    def __init__(self, name: str, python: Path, sif: Path) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [str(python), __file__, "--driver", name, "--sif", str(sif)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.version = json.loads(self._line())["version"]

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} driver exited ({self.proc.wait()})")
        return line

    def run(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def ensure_peers_venv(venv: Path) -> Path:
    py = venv / "bin" / "python"
    ok = (
        py.exists()
        and subprocess.run(
            [str(py), "-c", "import tools.environments.singularity, minisweagent.environments.singularity"], capture_output=True
        ).returncode
        == 0
    )
    if not ok:
        print(f"installing {' '.join(PEER_PACKAGES)} into {venv} (once)", file=sys.stderr)
        subprocess.run([sys.executable if not py.exists() else str(py), "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *PEER_PACKAGES], check=True)
    return py


# -- et-hpc ----------------------------------------------------------------------------------


def et_lifecycle(sif: Path, scratch: Path) -> dict[str, Any]:
    from et_hpc.sandbox.sandbox import Sandbox

    t0 = time.perf_counter()
    sb = Sandbox(sif, run_prefix="bench", scratch=scratch)
    sb.start()
    sh = sb.shell()
    t1 = time.perf_counter()
    outs = [sh.run(cmd, timeout=60).output for cmd, _ in COMMANDS]
    t2 = time.perf_counter()
    sb.stop()
    t3 = time.perf_counter()
    return {"setup_s": t1 - t0, "cmds_s": t2 - t1, "stop_s": t3 - t2, "bad": _check(outs)}


def et_warm_lifecycle(sif: Path, scratch: Path) -> dict[str, Any]:
    """The lifecycle on an episode's critical path with the warm pool (``sandbox.warm``): the sandbox
    was started ahead (untimed, as the pool does while the previous episode runs); timed are the
    hand-out check the pool makes (``dead_reason``), the 10 commands and the hand-back: the pool
    stops a finished sandbox in the background (``WarmPool.retire``), as episodes with
    ``sandbox.warm`` do; that stop is waited for untimed before the next lifecycle and reported as
    ``background_stop_s``."""
    from et_hpc.sandbox.warm import SandboxSpec, WarmPool, dead_reason, start_ready

    os.environ["ET_HPC_SCRATCH"] = str(scratch)
    spec = SandboxSpec(
        image_path=str(sif),
        image_digest=None,
        run_prefix="bench",
        overlay_mb=512,
        writable_tmpfs=False,
        network_none=True,
        nproc=None,
        vmem_mb=None,
        fsize_mb=None,
        output_limit=50_000,
        local_copy="never",
    )
    ready = start_ready(spec)
    t0 = time.perf_counter()
    dead = dead_reason(ready)
    t1 = time.perf_counter()
    outs = [ready.shell.run(cmd, timeout=60).output for cmd, _ in COMMANDS]
    t2 = time.perf_counter()
    pool = WarmPool(1)
    handed = pool.retire([ready])
    t3 = time.perf_counter()
    pool.close()
    t4 = time.perf_counter()
    if not handed:
        raise RuntimeError("the pool refused the sandbox")
    return {
        "setup_s": t1 - t0,
        "cmds_s": t2 - t1,
        "stop_s": t3 - t2,
        "background_stop_s": t4 - t3,
        "bad": _check(outs) + ([dead] if dead else []),
    }


def _proc_mem_kb(pid: int) -> tuple[int, int]:
    rss = pss = 0
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
        for line in open(f"/proc/{pid}/smaps_rollup"):
            if line.startswith("Pss:"):
                pss = int(line.split()[1])
    except OSError:
        pass
    return rss, pss


def _procs() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, sid) for every process we can see."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            s = open(f"/proc/{d}/stat").read()
        except OSError:
            continue
        f = s[s.rindex(")") + 2 :].split()
        out[int(d)] = (int(f[1]), int(f[3]))
    return out


def sandbox_memory(sif: Path, scratch: Path, n: int) -> dict[str, Any]:
    from et_hpc.sandbox.sandbox import Sandbox

    boxes = []
    try:
        for _ in range(n):
            sb = Sandbox(sif, run_prefix="bench", scratch=scratch).start()
            sh = sb.shell()
            assert sh.run("echo up").output.strip() == "up"
            boxes.append(sb)
        time.sleep(1.0)  # let the FUSE helpers settle
        procs = _procs()
        me = os.getpid()
        pids: set[int] = set()
        for sb in boxes:
            init, _ = sb.init_process()
            monitor = procs[init][0]
            pids |= {p for p, (_, sid) in procs.items() if sid == monitor}
        # the shells' `apptainer exec` subtrees: our descendants
        kids = {me}
        grew = True
        while grew:
            new = {p for p, (pp, _) in procs.items() if pp in kids} - kids
            grew = bool(new)
            kids |= new
        pids |= kids - {me}
        mem = [_proc_mem_kb(p) for p in pids]
        rss, pss = sum(m[0] for m in mem), sum(m[1] for m in mem)
        return {"sandboxes": n, "processes": len(pids), "rss_mb_per_sandbox": rss / 1024 / n, "pss_mb_per_sandbox": pss / 1024 / n}
    finally:
        for sb in boxes:
            sb.stop()


def local_copy_bench(sif: Path, scratch: Path, reps: int) -> dict[str, Any]:
    from et_hpc.images.local_copy import different_filesystem, evict, local_image, local_tree
    from et_hpc.sandbox.sandbox import Sandbox
    from et_hpc.util import sha256_file

    digest = sha256_file(sif)  # what the image cache records for it
    copy_s = []
    for _ in range(3):
        shutil.rmtree(scratch / "images", ignore_errors=True)
        li = local_image(sif, digest, scratch=scratch)
        assert li.copied
        copy_s.append(li.copy_s)
        li.release()
    t = time.perf_counter()
    li = local_image(sif, digest, scratch=scratch)
    reuse_s = time.perf_counter() - t
    unpack_s = []
    for _ in range(3):
        tree = local_tree(sif, digest, scratch=scratch / "unpack")
        assert tree.copied
        unpack_s.append(tree.copy_s)
        tree.release()
        evict(scratch / "unpack", 0)
    tree = local_tree(sif, digest, scratch=scratch / "unpack")
    paths = {"cache": sif, "local": li.path, "tree": tree.path}
    starts: dict[str, list[float]] = {k: [] for k in paths}
    for i in range(reps):
        keys = list(paths)
        for which in keys[i % 3 :] + keys[: i % 3]:
            t = time.perf_counter()
            sb = Sandbox(paths[which], run_prefix="bench", scratch=scratch).start()
            starts[which].append(time.perf_counter() - t)
            sb.stop()
    li.release()
    tree.release()
    return {
        "same_fs": not different_filesystem(sif, scratch),
        "size_mb": sif.stat().st_size / 1e6,
        "copy_s": copy_s,
        "reuse_s": reuse_s,
        "unpack_s": unpack_s,
        "starts": starts,
    }


# -- report ----------------------------------------------------------------------------------


def _p95(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(0.95 * (len(s) - 1))))]


def _row(rs: list[dict[str, Any]]) -> dict[str, float]:
    tot = [r["setup_s"] + r["cmds_s"] + r["stop_s"] for r in rs]
    return {
        "n": len(rs),
        "median": statistics.median(tot),
        "p95": _p95(tot),
        "setup": statistics.median(r["setup_s"] for r in rs),
        "cmds": statistics.median(r["cmds_s"] for r in rs),
        "stop": statistics.median(r["stop_s"] for r in rs),
        "bg_stop": statistics.median(r.get("background_stop_s", 0.0) for r in rs),
    }


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sif", type=Path)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--peers-venv", type=Path, default=Path.home() / "peers-venv")
    ap.add_argument("--mem-sandboxes", type=int, default=4)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--json-out", type=Path, help="also write every lifecycle's timings here")
    ap.add_argument("--driver", choices=PEERS, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.json_out and not a.driver:  # fail now, not after the run
        try:
            a.json_out.touch()
        except OSError as e:
            ap.error(f"--json-out: {e}")
    return a


def _lifecycles(runners: list, reps: int, results: dict[str, list[dict[str, Any]]], errors: dict[str, list[str]]) -> None:
    """``reps`` interleaved rounds of every runner after one untimed warm-up round (page cache, templates)."""
    for rnd in range(reps + 1):
        order = runners[rnd % len(runners) :] + runners[: rnd % len(runners)]
        for name, fn in order:
            os.sync()  # untimed: no lifecycle pays for the previous one's writeback
            r = fn()
            if rnd == 0:
                continue
            if "error" in r:
                errors[name].append(r["error"])
            elif r["bad"]:
                errors[name].append("; ".join(r["bad"]))
            else:
                results[name].append(r)


def measure(sif: Path, a: argparse.Namespace) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """Every lifecycle, the memory per sandbox and the local-copy costs; the summary and the raw rows."""
    load0 = Path("/proc/loadavg").read_text().split()[:3]
    peers: list[Peer] = []
    if not a.no_peers:
        py = ensure_peers_venv(a.peers_venv)
        peers = [Peer(n, py, sif) for n in PEERS]
    results: dict[str, list[dict[str, Any]]] = {"et-hpc": [], "et-hpc unpacked": [], "et-hpc warm": [], **{p.name: [] for p in peers}}
    errors: dict[str, list[str]] = {k: [] for k in results}
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as d:
        scratch = Path(d)
        from et_hpc.images.local_copy import local_tree

        tree = local_tree(sif, None, scratch=scratch / "trees")  # once per node, untimed (see local_copy_bench)
        runners = [
            ("et-hpc", lambda: et_lifecycle(sif, scratch)),
            ("et-hpc unpacked", lambda: et_lifecycle(tree.path, scratch)),
            ("et-hpc warm", lambda: et_warm_lifecycle(sif, scratch)),
        ] + [(p.name, p.run) for p in peers]
        _lifecycles(runners, a.reps, results, errors)
        for p in peers:
            p.close()
        mem = sandbox_memory(sif, scratch, a.mem_sandboxes)
        mem_tree = sandbox_memory(tree.path, scratch, a.mem_sandboxes)
        tree.release()
        lc = local_copy_bench(sif, scratch, a.reps)
    load1 = Path("/proc/loadavg").read_text().split()[:3]
    rows = {k: _row(v) for k, v in results.items() if v}
    out = {
        "load_start": load0,
        "load_end": load1,
        "rows": rows,
        "errors": errors,
        "memory": mem,
        "memory_unpacked": mem_tree,
        "local_copy": lc,
        "versions": {p.name: p.version for p in peers},
    }
    return out, results


def _print_ratios(rows: dict[str, Any]) -> None:
    if not rows.get("et-hpc"):
        return
    for mine in ("et-hpc", "et-hpc unpacked"):
        for k, target in (("hermes", 6), ("mini", 25)):
            if k in rows and mine in rows:
                ratio = rows[k]["median"] / rows[mine]["median"]
                print(f"\n{k} / {mine} (medians): {ratio:.1f}x (target >= {target}x: {'met' if ratio >= target else 'NOT met'})", end="")
    warm = rows.get("et-hpc warm")
    if warm and "hermes" in rows:
        ratio = rows["hermes"]["median"] / warm["median"]
        print(f"\nhermes (cold) / et-hpc warm (medians): {ratio:.1f}x (target >= 30x: {'met' if ratio >= 30 else 'NOT met'})", end="")
    print()


def print_markdown(out: dict[str, Any], reps: int) -> None:
    rows, mem, mem_tree, lc = out["rows"], out["memory"], out["memory_unpacked"], out["local_copy"]
    print(
        f"load average at start {' '.join(out['load_start'])}, at end {' '.join(out['load_end'])}; {reps} "
        "lifecycles each (after one warm-up round), interleaved; peers: " + ", ".join(f"{k} {v}" for k, v in out["versions"].items()) + "\n"
    )
    print(
        "| lifecycle (new sandbox, 10 commands, teardown; warm: started ahead, untimed) | n | median s | p95 s "
        "| setup s | 10 commands s | teardown s |"
    )
    print("|---|---|---|---|---|---|---|")
    for k, r in rows.items():
        bg = f" (+{r['bg_stop']:.2f} in the background)" if r["bg_stop"] else ""
        print(f"| {k} | {r['n']} | {r['median']:.2f} | {r['p95']:.2f} | {r['setup']:.2f} | {r['cmds']:.3f} | {r['stop']:.2f}{bg} |")
    _print_ratios(rows)
    for k, errs in out["errors"].items():
        if errs:
            print(f"\n{k}: {len(errs)} failed lifecycles, first: {errs[0][:300]}")
    for what, m in (("from the SIF", mem), ("from the unpacked tree", mem_tree)):
        print(
            f"\nMemory, {what}: {m['sandboxes']} live et-hpc sandboxes (each with its shell), {m['processes']} "
            f"processes: {m['rss_mb_per_sandbox']:.1f} MB RSS, {m['pss_mb_per_sandbox']:.1f} MB PSS per sandbox."
        )
    st = lc["starts"]
    print(
        f"\nLocal copy of the {lc['size_mb']:.0f} MB SIF: copy+sha256 {statistics.median(lc['copy_s']):.2f} s "
        f"(median of {len(lc['copy_s'])}), reuse of a present copy {lc['reuse_s'] * 1000:.1f} ms; "
        f"unpacking it (sha256 + unsquashfs) {statistics.median(lc['unpack_s']):.2f} s (median of "
        f"{len(lc['unpack_s'])}); sandbox start from the cache {statistics.median(st['cache']):.3f} s vs from "
        f"the copy {statistics.median(st['local']):.3f} s vs from the unpacked tree "
        f"{statistics.median(st['tree']):.3f} s (medians of {len(st['cache'])}; "
        f"{'same filesystem here' if lc['same_fs'] else 'different filesystems'})."
    )


def main() -> None:
    a = _parse_args()
    if a.driver:
        driver(a.driver, str(a.sif))
        return
    sif = a.sif
    if sif is None:
        from et_hpc.images.base import ensure_base

        sif = ensure_base(source="debian").path
    out, raw = measure(Path(sif), a)
    if a.json_out:
        a.json_out.write_text(json.dumps({**out, "raw": raw}, indent=1))
    if a.markdown:
        print_markdown(out, a.reps)
    else:
        print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
