"""``et-hpc view``: write (and optionally serve) the static trajectory viewer of one or more runs."""

from __future__ import annotations

import argparse
import functools
import http.server
import sys
from pathlib import Path

from et_hpc.cli.common import add_command
from et_hpc.errors import UserError

DESCRIPTION = """\
Write a self-contained static site to read what the agents did: one HTML page plus data files
(no CDN, no network), opened from file://, from a cluster's web space, or with --serve.

Run page: every episode (deduped: one per task and sample) in a sortable, filterable, paged table
(task, sample, group, status, reward, passed/total, stop_reason, score_note, policy version, turns,
tokens, time split), and plots: pass rate per task, mean reward by policy version, where the time
went, episode length. Episode page: the prompt, then each turn (the model's text, reasoning and
tool call, the command, its output with long output folded, the exit code), the per-test
verdicts, score note, events, timings and peak memory, and the token ids with their logprobs (and
where they drift) when the run recorded them. Episode details load only when an episode is opened,
so runs of 100k episodes open quickly. Agent output is shown as text, never run as HTML.
"""
EPILOG = """\
examples:
  et-hpc view et-hpc-runs/my-run                       # writes et-hpc-runs/_view/my-run/index.html
  et-hpc view et-hpc-runs/run-a et-hpc-runs/run-b -o ~/public_html/runs
  et-hpc view et-hpc-runs/my-run --serve --port 8765   # then: ssh -L 8765:127.0.0.1:8765 login-node
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers,
        "view",
        help="write a static HTML viewer of runs' episodes (optionally serve it)",
        description=DESCRIPTION,
        epilog=EPILOG,
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folder(s), or run names inside --store")
    p.add_argument("--store", type=Path, help="store root to find runs given by name (default: $ET_HPC_STORE)")
    p.add_argument("-o", "--output", type=Path, help="folder to write the site into (default: STORE/_view/RUN)")
    p.add_argument("--serve", action="store_true", help="serve the site on 127.0.0.1 until interrupted")
    p.add_argument("--port", type=int, default=8765, help="--serve: the port (default 8765; 0 picks a free one)")
    p.set_defaults(func=cmd_view)


def _run_dir(run: str, store: Path | None) -> Path:
    """A run folder given as a path, or by name inside --store (default: $ET_HPC_STORE)."""
    from et_hpc.paths import store_dir

    p = Path(run).expanduser()
    q = Path(store or store_dir()).expanduser() / run
    return q if not p.exists() and q.is_dir() else p


def cmd_view(args: argparse.Namespace) -> int:
    from et_hpc.runs.view import build_site, default_out

    if not 0 <= args.port < 65536:
        raise UserError(f"--port {args.port}: give a port number from 0 to 65535")
    dirs = [_run_dir(r, args.store) for r in args.runs]
    out = args.output or default_out(dirs)
    site = build_site(dirs, out)
    n = sum(r.episodes for r in site.runs)
    print(f"wrote {site.index} ({len(site.runs)} run(s), {n} episodes)")
    print(f"open: {site.index.resolve().as_uri()}")
    if not args.serve:
        return 0
    handler = functools.partial(_Quiet, directory=str(site.out))
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), handler)
    except OSError as e:
        raise UserError(f"cannot serve on 127.0.0.1:{args.port} ({e.strerror}); pick another --port") from e
    port = server.server_address[1]
    print(f"serving on http://127.0.0.1:{port}/ (Ctrl-C stops; from another machine: ssh -L {port}:127.0.0.1:{port} THIS-HOST)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        print(f"{self.address_string()} {format % args}", file=sys.stderr)
