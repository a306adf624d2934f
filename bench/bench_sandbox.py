"""Sandbox speed: command round trip through the Shell vs a fresh exec, and episode start+stop.

Run as an unprivileged user (apptainer refuses root here):
    python bench/bench_sandbox.py [--sif PATH] [--commands 300] [--episodes 10] [--markdown]
    python bench/bench_sandbox.py --setup [--sif PATH] [--episodes 10]
Without --sif the cached base image (et_hpc.images.base.ensure_base) is used.

``--setup`` measures an episode's setup as et_hpc.episode does it (start, the first shell, the
umask round trip) and teardown, split into parts, beside a bare ``apptainer instance start``
and a bare ``apptainer exec instance:// true`` (medians over ``--episodes`` fresh sandboxes).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from et_hpc.sandbox.sandbox import Sandbox


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1000


def bench_commands(sif: Path, scratch: Path, n: int) -> dict[str, float]:
    with Sandbox(sif, run_prefix="bench", scratch=scratch) as sb:
        sh = sb.shell()
        for _ in range(20):
            sh.run("true")
        shell_t = []
        for _ in range(n):
            t = time.perf_counter()
            r = sh.run("true")
            shell_t.append(time.perf_counter() - t)
            assert r.exit_code == 0
        exec_t = []
        for _ in range(max(10, n // 10)):
            t = time.perf_counter()
            cp = sb.exec(["true"])
            exec_t.append(time.perf_counter() - t)
            assert cp.returncode == 0
    return {"shell_ms": _median_ms(shell_t), "exec_ms": _median_ms(exec_t)}


def bench_episodes(sif: Path, scratch: Path, n: int, **kw: object) -> dict[str, float]:
    starts, stops, totals = [], [], []
    for _ in range(n):
        t = time.perf_counter()
        sb = Sandbox(sif, run_prefix="bench", scratch=scratch, **kw)  # type: ignore[arg-type]
        sb.start()
        t1 = time.perf_counter()
        sb.stop()
        t2 = time.perf_counter()
        starts.append(t1 - t)
        stops.append(t2 - t1)
        totals.append(t2 - t)
    return {"start_ms": _median_ms(starts), "stop_ms": _median_ms(stops), "total_ms": _median_ms(totals)}


def bench_setup(sif: Path, scratch: Path, n: int) -> list[tuple[str, float]]:
    """Median ms of each part of an episode's setup and teardown (see the module doc)."""
    from et_hpc.host import apptainer

    parts: dict[str, list[float]] = {}

    def add(k: str, v: float) -> None:
        parts.setdefault(k, []).append(v)

    for i in range(n):
        t = time.perf_counter()
        sb = Sandbox(sif, run_prefix="bench", scratch=scratch)
        sb.start()
        t1 = time.perf_counter()
        sh = sb.shell()
        t2 = time.perf_counter()
        sh.run("umask 0002")
        t3 = time.perf_counter()
        sb.stop()
        t4 = time.perf_counter()
        add("overlay copy, registry, pristine bind options", sb.timings["overlay_s"])
        add("`apptainer instance start`", sb.timings.get("instance_s", float("nan")))
        add("init pid and start time", sb.timings.get("init_s", float("nan")))
        add("Sandbox.start total", t1 - t)
        add("first shell (apptainer exec + bash + prepare + ulimits)", t2 - t1)
        add("umask round trip", t3 - t2)
        add("setup total (start + shell + umask)", t3 - t)
        add("teardown (Sandbox.stop)", t4 - t3)
        # references: a bare instance start, a bare exec, the first shell without the prepare script
        name = f"bench-bare-{i}"
        t = time.perf_counter()
        apptainer.instance_start(sif, name, ["--containall", "--cleanenv", "--writable-tmpfs"])
        t1 = time.perf_counter()
        apptainer.run(["-s", "exec", "--cleanenv", f"instance://{name}", "true"])
        t2 = time.perf_counter()
        apptainer.instance_stop(name, timeout_s=0, check=False)
        apptainer.wait_gone(name)
        add("reference: bare `instance start --writable-tmpfs`", t1 - t)
        add("reference: bare `apptainer exec instance:// true` (first)", t2 - t1)
        with Sandbox(sif, run_prefix="bench", scratch=scratch, prepare_home=False) as sb2:
            t = time.perf_counter()
            sb2.shell()
            add("reference: first shell without the prepare script", time.perf_counter() - t)
    return [(k, statistics.median(v) * 1000) for k, v in parts.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sif", type=Path)
    ap.add_argument("--commands", type=int, default=300)
    ap.add_argument("--episodes", type=int, default=10)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--setup", action="store_true", help="only the setup/teardown breakdown")
    a = ap.parse_args()
    sif = a.sif
    if sif is None:
        from et_hpc.images.base import ensure_base

        sif = ensure_base(source="debian").path
    load = Path("/proc/loadavg").read_text().split()[:3]
    if a.setup:
        with tempfile.TemporaryDirectory() as d:
            Sandbox(sif, run_prefix="bench", scratch=Path(d)).start().stop()  # warm template and page cache
            rows = bench_setup(sif, Path(d), a.episodes)
        print(f"load average at start: {' '.join(load)}, at end: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}\n")
        print("| episode setup part | median ms |\n|---|---|")
        for name, ms in rows:
            print(f"| {name} | {ms:.1f} |")
        return
    with tempfile.TemporaryDirectory() as d:
        scratch = Path(d)
        Sandbox(sif, run_prefix="bench", scratch=scratch).start().stop()  # warm template and page cache
        cmd = bench_commands(sif, scratch, a.commands)
        rows = [
            ("overlay (copied sparse template) + network none", bench_episodes(sif, scratch, a.episodes)),
            ("overlay, host network", bench_episodes(sif, scratch, a.episodes, network_none=False)),
            ("writable-tmpfs + network none", bench_episodes(sif, scratch, a.episodes, writable_tmpfs=True)),
            (
                "writable-tmpfs, host network, no pristine bind",
                bench_episodes(sif, scratch, a.episodes, writable_tmpfs=True, network_none=False, pristine=False),
            ),
        ]
        t = time.perf_counter()
        subprocess.run(["apptainer", "-s", "overlay", "create", "--sparse", "--size", "512", str(scratch / "x.img")], check=True)
        create_ms = (time.perf_counter() - t) * 1000
        t = time.perf_counter()
        subprocess.run(["cp", "--sparse=always", str(scratch / "x.img"), str(scratch / "y.img")], check=True)
        copy_ms = (time.perf_counter() - t) * 1000
    if a.markdown:
        print(f"load average at start: {' '.join(load)}\n")
        print("| command round trip | median ms |\n|---|---|")
        print(f"| persistent Shell (`true`) | {cmd['shell_ms']:.2f} |")
        print(f"| fresh `apptainer exec instance://` | {cmd['exec_ms']:.1f} |\n")
        print("| episode sandbox | start ms | stop ms | start+stop ms |\n|---|---|---|---|")
        for name, r in rows:
            print(f"| {name} | {r['start_ms']:.0f} | {r['stop_ms']:.0f} | {r['total_ms']:.0f} |")
        print(
            f"\n512 MiB sparse overlay: `apptainer overlay create` {create_ms:.0f} ms, `cp --sparse=always` of a template {copy_ms:.0f} ms."
        )
    else:
        print(cmd, rows, {"overlay_create_ms": create_ms, "overlay_copy_ms": copy_ms})


if __name__ == "__main__":
    main()
