"""CPU cost of the memory watchdog: one instance holding N processes, polled for a while.

Starts a sandbox on the base image, leaves N ``sleep`` processes in it, runs a Watchdog at the
given interval and reports the watchdog thread's CPU time per second of wall time and per poll
(with the tmpfs probe and without). Run as an unprivileged user:

    python bench/bench_watchdog.py --procs 20 --seconds 10 --interval 0.25
"""

from __future__ import annotations

import argparse
import time

from et_hpc.images.base import ensure_base
from et_hpc.sandbox.sandbox import Sandbox
from et_hpc.sandbox.watchdog import Watchdog


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--interval", type=float, default=0.25)
    args = ap.parse_args()
    sif = ensure_base().path
    with Sandbox(sif, run_prefix="bench-wd") as sb:
        sh = sb.shell()
        sh.run(f"for i in $(seq {args.procs}); do sleep 3600 & done", timeout=60)
        for tmpfs in (True, False):
            with Watchdog(sb, interval_s=args.interval, measure_tmpfs=tmpfs) as wd:
                t0 = time.monotonic()
                time.sleep(args.seconds)
                wall = time.monotonic() - t0
            print(
                f"processes={wd.peak_pids} tmpfs_probe={tmpfs} interval={args.interval}s polls={wd.polls}: "
                f"{1000 * wd.poll_s / wall:.2f} ms CPU per second, {1000 * wd.poll_s / max(wd.polls, 1):.2f} ms "
                f"per poll (thread CPU; the probe process adds its own, see below)"
            )
        # the whole process, probe included: a longer run with the default settings
        import resource

        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        s0 = resource.getrusage(resource.RUSAGE_SELF)
        with Watchdog(sb, interval_s=args.interval) as wd:
            time.sleep(args.seconds)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        s1 = resource.getrusage(resource.RUSAGE_SELF)
        child = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
        me = (s1.ru_utime + s1.ru_stime) - (s0.ru_utime + s0.ru_stime)
        print(
            f"whole process over {args.seconds:g} s: {1000 * me / args.seconds:.2f} ms/s in this process, "
            f"{1000 * child / args.seconds:.2f} ms/s in the tmpfs probe ({wd.polls} polls)"
        )


if __name__ == "__main__":
    main()
