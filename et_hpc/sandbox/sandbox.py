"""One Apptainer instance per episode, with its own writable layer, that always gets stopped.

``Sandbox(sif, ...)`` is a context manager (``sif``: a SIF file or an unpacked root directory).
``start()`` copies a sparse ext3 overlay from a per-size template in node-local scratch and starts
``apptainer instance start --containall --cleanenv --overlay OV [--net --network none]``;
``stop()`` kills the instance at once and deletes the overlay, on ``with`` exit, at interpreter
exit and on SIGTERM/SIGINT/SIGUSR2. A registry file ``<scratch>/live/<name>.json`` lets
``et_hpc.sandbox.reaper`` clean up after a killed worker. Nothing of the host environment reaches
the container (``--cleanenv``, no ``APPTAINER*``/``SINGULARITY*`` variable of the caller's); host
paths come in only through ``binds``. Options in docs/sandbox.md ("The sandbox").
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from et_hpc.errors import InfraError
from et_hpc.host import apptainer, procfs
from et_hpc.sandbox.config import DEFAULT_OVERLAY_MB
from et_hpc.sandbox.prepare_script import PREPARE_SCRIPT
from et_hpc.sandbox.scratch import copy_sparse, new_instance_name, overlay_template, scratch_paths
from et_hpc.sandbox.shell import Shell, kill_session

log = logging.getLogger(__name__)

HOME = "/home/user"
PRISTINE = "/.et-pristine"  # where the image is bound read-only (see et_hpc.scoring.live)
# Shell limits: contain fork bombs and memory hogs without cgroups (rootless, no systemd here).
DEFAULT_NPROC = 512
DEFAULT_VMEM_MB = 8192
DEFAULT_FSIZE_MB = 4096  # ulimit -f: largest file a command may write (a 100 GB sparse file is refused)
# longer than apptainer.instance_start's own timeout, so every start in flight has ended
START_WAIT_S = 130.0
_LIVE: set[Sandbox] = set()
_LIVE_LOCK = threading.Lock()
_HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)
_installed = False


class Sandbox:
    """One apptainer instance for one episode (the options: docs/sandbox.md, "The sandbox").

    ``overlay_mb``: the per-episode writable layer (``None`` or ``writable_tmpfs=True``: apptainer's
    ``--writable-tmpfs``); ``network_none``: loopback only (``network_isolated`` says whether the
    host allowed it); ``nproc``/``vmem_mb``/``fsize_mb``: ``ulimit -u``/``-v``/``-f`` of every shell
    and of scoring; ``warm_scoring``: warm the pristine python and pytest once the first shell is
    up; ``overlay_image`` (``overlay_readonly``): start on a kept overlay, which the sandbox owns;
    ``before_overlay_delete(path)``: called by ``stop()`` before the overlay is deleted.
    """

    def __init__(
        self,
        sif: Path,
        *,
        run_prefix: str = "et",
        overlay_mb: int | None = DEFAULT_OVERLAY_MB,
        writable_tmpfs: bool = False,
        network_none: bool = True,
        scratch: Path | None = None,
        nproc: int | None = DEFAULT_NPROC,
        vmem_mb: int | None = DEFAULT_VMEM_MB,
        fsize_mb: int | None = DEFAULT_FSIZE_MB,
        prepare_home: bool = True,
        pristine: bool = True,
        home: str = HOME,
        warm_scoring: bool = True,
        overlay_image: Path | None = None,
        overlay_readonly: bool = False,
        binds: list[str] | tuple[str, ...] = (),
    ) -> None:
        self.sif = Path(sif)
        self.run_prefix = run_prefix
        self.overlay_mb = None if writable_tmpfs else overlay_mb
        self.writable_tmpfs = writable_tmpfs or overlay_mb is None
        self.network_none = network_none
        self.network_isolated = False
        self.scratch = scratch
        self.nproc = nproc
        self.vmem_mb = vmem_mb
        self.fsize_mb = fsize_mb
        self.prepare_home = prepare_home
        self.pristine = pristine
        self.pristine_bound = False
        self.home = home
        self.warm_scoring = warm_scoring
        self.overlay_image = Path(overlay_image) if overlay_image is not None else None
        self.overlay_readonly = overlay_readonly
        if self.overlay_image is not None:
            self.writable_tmpfs = overlay_readonly
        self.before_overlay_delete: Callable[[Path], None] | None = None
        self.binds = list(binds)  # extra apptainer options, e.g. SandboxConfig.bind_options()
        self._warm_pending = False
        self._warmer: subprocess.Popen[bytes] | None = None
        self.name: str | None = None
        self.overlay: Path | None = None
        self.registry: Path | None = None
        self.timings: dict[str, float] = {}
        self._shells: list[Shell] = []
        self._init: tuple[int, str] | None = None  # (host pid, start time) of the instance's init
        self._stopped = True
        self._starting = False  # `apptainer instance start` may be in flight
        self.stopped_by: str | None = None  # "kill" (init killed from the host) or "apptainer"
        self._prepared = False

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> Sandbox:
        if not (self.sif.is_file() or self.unpacked):
            raise InfraError(f"image {self.sif} does not exist")
        t0 = time.monotonic()
        live, overlays, templates = scratch_paths(self.scratch)
        self.name = new_instance_name(self.run_prefix)
        self.registry = live / f"{self.name}.json"
        options = ["--containall", "--cleanenv"]
        if self.overlay_image is not None:
            self.overlay = self.overlay_image
            self._write_registry()
            if self.overlay_readonly:
                options += ["--overlay", f"{self.overlay}:ro", "--writable-tmpfs"]
            else:
                options += ["--overlay", str(self.overlay)]
        elif self.overlay_mb:
            tmpl = overlay_template(self.overlay_mb, templates)
            self.overlay = overlays / f"{self.name}.img"
            self._write_registry()  # before anything exists, so a crash leaves a trail
            copy_sparse(tmpl, self.overlay)
            options += ["--overlay", str(self.overlay)]
        else:
            self._write_registry()
            options.append("--writable-tmpfs")
        # the image itself, read-only, for scoring with an interpreter the agent cannot touch
        if self.pristine and self.unpacked:
            options += ["--bind", f"{self.sif}:{PRISTINE}:ro"]
            self.pristine_bound = True
        elif self.pristine and (part := apptainer.sif_rootfs_id(self.sif)) is not None:
            options += ["--bind", f"{self.sif}:{PRISTINE}:image-src=/,id={part}"]
            self.pristine_bound = True
        options += self.binds
        self.timings["overlay_s"] = time.monotonic() - t0
        _install_handlers()
        with _LIVE_LOCK:
            _LIVE.add(self)
        self._stopped = False
        self._init = None
        try:
            t1 = time.monotonic()
            self._starting = True
            try:
                self._start_instance(options)
            finally:
                self._starting = False
            t2 = time.monotonic()
            self.init_process()
            self.timings["instance_s"], self.timings["init_s"] = t2 - t1, time.monotonic() - t2
        except BaseException:
            self.stop()
            raise
        # with the first shell; an unpacked tree needs none: its page cache is the node's, not the instance's
        self._warm_pending = self.warm_scoring and self.pristine_bound and not self.unpacked
        self.timings["start_s"] = time.monotonic() - t0
        log.debug("sandbox %s started in %.3f s", self.name, self.timings["start_s"])
        return self

    def _start_instance(self, options: list[str]) -> None:
        assert self.name
        if self.network_none:
            try:
                apptainer.instance_start(self.sif, self.name, [*options, "--net", "--network", "none"])
                self.network_isolated = True
                return
            except InfraError as e:
                msg = str(e).lower()
                if "net" not in msg:
                    raise
                log.warning(
                    "this host does not allow '--net --network none' for unprivileged users (%s); "
                    "the sandbox shares the host network. Ask the admins to allow it "
                    "('allow net networks = none' in apptainer.conf) or pass network_none=False.",
                    str(e)[-200:],
                )
        apptainer.instance_start(self.sif, self.name, options)

    def _prepare_script(self) -> str:
        # without the pristine bind nothing tells that the image's files are ours: $HOME is searched
        ours = f"[ -O {PRISTINE} ]" if self.pristine_bound else "false"
        return PREPARE_SCRIPT.replace("__HOME__", shlex.quote(self.home)).replace("__IMAGE_IS_OURS__", ours)

    @property
    def prepared(self) -> bool:
        """Whether ``PREPARE_SCRIPT`` ran (the first shell's startup, or ``prepare``)."""
        return self._prepared

    def prepare(self) -> None:
        """Apply ``PREPARE_SCRIPT`` once (no-op when a shell already did it). It runs the instance's
        ``bash``: only for a state no agent touched (a fresh image); scoring never calls it."""
        if self._prepared or not self.prepare_home:
            return
        cp = self.exec(["bash", "-c", self._prepare_script()], timeout=120)
        if cp.returncode != 0:
            log.warning("preparing %s in %s failed: %s", self.home, self.name, cp.stdout[-300:])
        self._prepared = True

    def wait_warmup(self, timeout_s: float = 60.0) -> bool:
        """Wait until the scoring warm-up started with the first shell is over (True), or
        ``timeout_s``. Until then it is one more process of the instance (``_start_warmup``)."""
        if self._warmer is None:
            return True
        try:
            self._warmer.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def stop_warmup(self) -> None:
        """End the scoring warm-up if it still runs, so none starts late, e.g. while the final
        tests run. Its helper kills and reaps its python in the instance before it exits."""
        self._warm_pending = False
        if self._warmer is not None:
            if self._warmer.poll() is None:
                # SIGTERM: the helper kills and reaps its python (see et_hpc.scoring.enter_pytest.warm_up); SIGKILL only
                # if it does not end, which leaves a zombie for the host's init to reap
                self._warmer.terminate()
                try:
                    self._warmer.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    self._warmer.kill()
            self._warmer.wait()
            self._warmer = None

    def end_agent(self):
        """End everything of the agent's before scoring, in this order: the scoring warm-up (ours),
        then every process of the instance but init, stopped and killed from the host
        (``et_hpc.scoring.sweep``), and only then the agent's shells, so that nothing armed on a
        shell's exit is still alive to act. Returns the ``SweepResult``."""
        from et_hpc.scoring.sweep import SweepResult, sweep

        self.stop_warmup()
        if self._init is None or self._stopped:
            res = SweepResult()
        else:
            res = sweep(*self._init)
        self.close_shells()
        return res

    def close_shells(self) -> None:
        for sh in self._shells:
            try:
                sh.close()
            except Exception:  # noqa: BLE001 - stopping must go on
                log.debug("closing a shell failed", exc_info=True)
        self._shells.clear()

    def stop(self) -> None:
        """Kill the instance and delete its overlay and registry file. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        t0 = time.monotonic()
        self.close_shells()
        self.stop_warmup()
        if self._starting and self.name:
            # stopped by a signal or another thread while its start runs: stopping now would find
            # nothing, and the instance would appear afterwards with no one left to stop it
            wait_for_start(self.name)
        try:
            if self.name and not self._kill_init():
                self.stopped_by = "apptainer"
                apptainer.instance_stop(self.name, timeout_s=0, check=False)
                if not apptainer.wait_gone(self.name):
                    log.warning("instance %s still listed 10 s after it was stopped", self.name)
        except Exception as e:  # noqa: BLE001
            log.warning("stopping instance %s failed: %s", self.name, e)
        if self.overlay is not None and self.before_overlay_delete is not None:
            try:
                self.before_overlay_delete(self.overlay)
            except Exception as e:  # noqa: BLE001 - stopping must go on
                log.warning("the hook on overlay %s failed: %s", self.overlay, e)
        for p in (self.overlay, self.registry):
            if p is not None:
                try:
                    p.unlink()
                except FileNotFoundError:
                    pass
                except OSError as e:
                    log.warning("could not delete %s: %s", p, e)
        with _LIVE_LOCK:
            _LIVE.discard(self)
        self.timings["stop_s"] = time.monotonic() - t0

    def _kill_init(self) -> bool:
        """SIGKILL the instance's init from the host, what ``apptainer instance stop -t 0`` sends it,
        without starting apptainer (~30 ms): its PID namespace dies with it and apptainer's own
        monitor removes the instance's state. True when the instance is gone; False (nothing done,
        or not gone within 2 s) leaves the stop to apptainer."""
        if self._init is None:
            return False
        pid, start = self._init
        if procfs.start_time(pid) != start:
            return False  # already gone or the pid is another process's now: ask apptainer
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            return False
        if not apptainer.wait_gone(self.name or "", timeout=2.0):
            return False
        self.stopped_by = "kill"
        return True

    def __enter__(self) -> Sandbox:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _write_registry(self) -> None:
        assert self.registry
        rec = {
            "name": self.name,
            "pid": os.getpid(),
            "pid_start": procfs.start_time(os.getpid()),  # tells the reaper a reused pid apart
            "host": socket.gethostname(),
            "overlay": str(self.overlay) if self.overlay else None,
            "sif": str(self.sif),
            "started": time.time(),
        }
        tmp = self.registry.with_name(f".{self.registry.name}.tmp")
        tmp.write_text(json.dumps(rec))
        os.replace(tmp, self.registry)

    # -- using it --------------------------------------------------------------------------

    @property
    def unpacked(self) -> bool:
        """True when the image is a directory (a node-local unpacked tree, et_hpc.images.local_copy)."""
        return self.sif.is_dir()

    @property
    def live(self) -> bool:
        return not self._stopped

    def init_process(self) -> tuple[int, str]:
        """(host pid, start time in ticks) of the instance's init (``appinit``), found once per start.

        Scoring enters the instance through it (``et_hpc.scoring.enter``); the start time tells a
        reused pid apart. Raises ``InfraError`` when the instance is not listed.
        """
        if self._init is None:
            if not self.name or self._stopped:
                raise InfraError("the sandbox is not running")
            pid = apptainer.instance_pid(self.name)
            if pid is None:
                found = [i for i in apptainer.instance_list() if i.name == self.name and i.pid > 0]
                if not found:
                    raise InfraError(f"instance {self.name} is not running")
                pid = found[0].pid
            start = procfs.start_time(pid)  # bytes-safe: a command name is any bytes
            if start is None:
                raise InfraError(f"instance {self.name}: init {pid} is gone")
            self._init = (pid, start)
        return self._init

    def health(self) -> str:
        """Where a broken shell or a failed entry came from, decided from the host (no exec inside).

        ``"alive"``: init still runs (whatever broke, broke inside the instance: the agent's doing);
        ``"gone"``: init has exited while the sandbox was live; an agent can do this from inside
        (``kill -TERM 1`` ends an instance), so it counts as the agent's doing too;
        ``"stopped"``: we stopped it (teardown, a signal to the worker); ``"host: ..."``: apptainer
        or /proc failed on the host (infrastructure).
        """
        if self._stopped:
            return "stopped"
        if self._init is not None:
            pid, start = self._init
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    st = f.read()
                return "alive" if st[st.rfind(b")") + 2 :].split()[19].decode() == start else "gone"
            except FileNotFoundError:
                return "gone"
            except OSError as e:
                return f"host: /proc/{pid}: {e}"
        try:
            listed = any(i.name == self.name for i in apptainer.instance_list())
        except InfraError as e:
            return f"host: {e}"
        return "alive" if listed else "gone"

    def exec_argv(self, argv: list[str], *, pwd: str | None = None) -> list[str]:
        if not self.name or self._stopped:
            raise InfraError("the sandbox is not running")
        return apptainer.exec_argv(self.name, argv, pwd=pwd or self.home, env={"HOME": self.home})

    def exec(
        self, argv: list[str], timeout: float = 60.0, input: bytes | None = None, *, pwd: str | None = None
    ) -> subprocess.CompletedProcess[bytes]:
        """A fresh ``apptainer exec instance://NAME ARGV``: merged output in ``stdout`` (bytes).

        On timeout everything it started is killed and ``subprocess.TimeoutExpired`` is raised.
        """
        full = self.exec_argv(argv, pwd=pwd)
        proc = subprocess.Popen(
            full,
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=apptainer.host_env(),
        )
        try:
            out, _ = proc.communicate(input=input, timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_session(proc.pid)
            proc.kill()
            out, _ = proc.communicate()
            raise subprocess.TimeoutExpired(full, timeout, output=out) from None
        return subprocess.CompletedProcess(full, proc.returncode, out, None)

    def shell_init(self) -> str:
        """Startup lines of every shell: the one-time preparation (first shell), then ulimits."""
        lines = []
        if self.prepare_home and not self._prepared:
            lines.append(f"( {self._prepare_script()} )")
            self._prepared = True
        if self.nproc:
            lines.append(f"ulimit -S -u {int(self.nproc)} 2>/dev/null; ulimit -H -u {int(self.nproc)} 2>/dev/null")
        if self.vmem_mb:
            kb = int(self.vmem_mb) * 1024
            lines.append(f"ulimit -S -v {kb} 2>/dev/null; ulimit -H -v {kb} 2>/dev/null")
        if self.fsize_mb:
            kb = int(self.fsize_mb) * 1024  # bash counts -f in 1024-byte blocks
            lines.append(f"ulimit -S -f {kb} 2>/dev/null; ulimit -H -f {kb} 2>/dev/null")
        lines.append("ulimit -S -c 0 2>/dev/null; ulimit -H -c 0 2>/dev/null")
        return "\n".join(lines)

    def shell(self, **kw: Any) -> Shell:
        """A started persistent bash in the instance, cwd and HOME ``/home/user``."""
        kw.setdefault("home", self.home)
        kw.setdefault("init", self.shell_init())
        kw.setdefault("popen_env", apptainer.host_env())
        sh = Shell(self.exec_argv(["bash", "--noprofile", "--norc"]), **kw)
        sh.start()
        self._shells.append(sh)
        if self._warm_pending:  # after the shell, so the two do not compete for the CPU
            self._warm_pending = False
            self._start_warmup()
        return sh

    def _start_warmup(self) -> None:
        """Load the pristine python and pytest in the background while the agent works
        (``et_hpc.scoring.live.start_warmup``): the final tests then find them in the page cache."""
        from et_hpc.scoring.live import start_warmup  # scoring imports enter, which this module loads lazily too

        try:
            self._warmer = start_warmup(self)
        except (InfraError, OSError) as e:  # only a cost: scoring reads the files itself
            log.warning("could not start the scoring warm-up in %s: %s", self.name, e)


def wait_for_start(name: str, timeout_s: float = START_WAIT_S) -> bool:
    """Wait until no `apptainer instance start ... NAME` runs on this host (True), or ``timeout_s``.
    It polls the process table, so it also works in a signal handler of the thread that started it."""
    deadline = time.monotonic() + timeout_s
    while procfs.with_argument(name):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# -- stopping on signals and exit ------------------------------------------------------------


def live_sandboxes() -> list[Sandbox]:
    with _LIVE_LOCK:
        return list(_LIVE)


def stop_all() -> None:
    for sb in live_sandboxes():
        try:
            sb.stop()
        except Exception:  # noqa: BLE001
            log.warning("stopping sandbox %s failed", sb.name, exc_info=True)


def _install_handlers() -> None:
    """Once per process (main thread only): stop live sandboxes on SIGTERM/SIGINT/SIGUSR2, then
    hand the signal to whatever handled it before (default: die of it)."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    _installed = True
    atexit.register(stop_all)
    for sig in _HANDLED:
        prev = signal.getsignal(sig)

        def handler(signum: int, frame: Any, _prev: Any = prev) -> None:
            stop_all()
            if callable(_prev):
                _prev(signum, frame)
            elif _prev == signal.SIG_IGN:
                return
            else:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        try:
            signal.signal(sig, handler)
        except (ValueError, OSError):  # not allowed here
            pass
