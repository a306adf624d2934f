"""``et-hpc model serve``: a CPU model server (llama.cpp's llama-server) published through an endpoint file."""

from __future__ import annotations

import argparse
from pathlib import Path

from et_hpc.errors import UserError

DEFAULT_ENDPOINT = Path.home() / ".et-hpc" / "model-endpoint.json"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "model",
        help="serve a model on CPU (llama.cpp) for the openai policy",
        description="Serve a GGUF model on CPU with llama.cpp's llama-server.",
    )
    sub = p.add_subparsers(dest="model_command", metavar="SUBCOMMAND")
    s = sub.add_parser(
        "serve",
        help="serve the embedded model (or a GGUF file) and write an endpoint file",
        description="Start llama-server on 127.0.0.1 with a fresh API key, wait until it answers, and write "
        "the endpoint file (mode 0600, the format slurm/vllm.sbatch writes; model_version is the GGUF's "
        "digest), so policy.endpoint_file or policy.endpoint_dir use it unchanged. Runs until interrupted; "
        "the file is removed on exit. Flags after -- go to llama-server.",
        epilog="example: et-hpc model serve --endpoint-file ~/.et-hpc/model-endpoint.json &\n"
        "         et-hpc run defs/demo --policy openai --set policy.endpoint_file=~/.et-hpc/model-endpoint.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument(
        "--model",
        default=None,
        help="a model name (smollm2-135m: plumbing, the default; qwen2.5-coder-0.5b: fast; qwen2.5-coder-1.5b: "
        "solves tasks; installed by scripts/provision-debian into $ET_HPC_MODELS or /var/lib/et-hpc/models) "
        "or the path of any .gguf file",
    )
    s.add_argument("--sha256", default=None, help="refuse the GGUF unless its sha256 is this (named models: their pinned one)")
    s.add_argument("--endpoint-file", type=Path, default=DEFAULT_ENDPOINT, help=f"where to publish the server (default {DEFAULT_ENDPOINT})")
    s.add_argument(
        "--endpoint-dir",
        type=Path,
        default=None,
        help="publish as DIR/<job or host-pid>.json instead, one of many replicas (policy.endpoint_dir)",
    )
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    s.add_argument("--alias", default=None, help="the served model name (default: the file name)")
    s.add_argument("--ctx-size", type=int, default=8192, help="context tokens, shared by the slots (default 8192)")
    s.add_argument("--parallel", type=int, default=2, help="concurrent request slots (default 2)")
    s.add_argument("--threads", type=int, default=None, help="CPU threads (default: llama-server's choice)")
    s.add_argument("--log-file", type=Path, default=None, help="llama-server's output (default: discarded)")
    s.add_argument("extra", nargs=argparse.REMAINDER, help="-- then flags for llama-server")
    s.set_defaults(func=cmd_serve)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def cmd_serve(args) -> int:
    import os

    from et_hpc.model.catalog import prepare
    from et_hpc.model.server import ServerConfig, serve_forever

    if not 0 <= args.port < 65536:
        raise UserError(f"--port {args.port}: give a port between 1 and 65535 (or 0 for a free one)")
    if args.ctx_size < 256 or args.parallel < 1:
        raise UserError("--ctx-size must be at least 256 and --parallel at least 1")
    extra = list(args.extra)
    if extra and extra[0] == "--":
        extra = extra[1:]
    endpoint = args.endpoint_file.expanduser()
    if args.endpoint_dir is not None:
        name = os.environ.get("SLURM_JOB_ID") or f"{os.uname().nodename}-{os.getpid()}"
        endpoint = args.endpoint_dir.expanduser() / f"{name}.json"
    model, digest = prepare(args.model, args.sha256)
    cfg = ServerConfig(
        model=model.path,
        digest=digest,
        endpoint_file=endpoint,
        host=args.host,
        port=args.port,
        alias=args.alias or model.alias,
        ctx_size=args.ctx_size,
        parallel=args.parallel,
        threads=args.threads,
        log_file=args.log_file.expanduser() if args.log_file else None,
        extra=extra,
    )
    return serve_forever(cfg, announce=lambda m: print(m, flush=True))
