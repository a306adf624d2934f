"""The scoring entry helper: enter a running instance from the host and run its final tests.

``helper_argv()`` is the argv of a fresh, single-threaded host Python running the helper program:
the sources of ``PARTS`` joined in order (``enter_sys`` stamps the start time first; this module
is last and runs ``main``), with ``-I -S -B``, stdlib only, every module imported before it
enters the container and nothing imported after. It reads one JSON config on stdin (its byte
count on a line first), prints one line ``MARKER{json}`` on stdout and exits 0; ``kind`` is
``"ran"``, ``"agent"``, ``"disturbed"``, ``"interp"``, ``"infra"`` or (warm-up mode) ``"warm"``,
with the ``stages`` reached. ``et_hpc.scoring.live.blame`` turns it into status and reward.
The steps, and what no file of the agent's can change about them: docs/sandbox.md, "Scoring entry".
"""

import json
import os
import select
import signal
import sys
import time
from collections.abc import Callable

if __spec__ is not None:  # imported; in the helper program every part shares one namespace
    from et_hpc.scoring.enter_pytest import run_pytest, warm_up
    from et_hpc.scoring.enter_sys import (
        MS_PRIVATE,
        MS_REC,
        PR_SET_DUMPABLE,
        STAGES,
        Infra,
        Refused,
        check,
        libc,
        mark,
        mount,
        stat_fields,
    )

PARTS = ("enter_sys.py", "enter_view.py", "enter_pytest.py", "enter.py")  # the helper program, in order
CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
NAMESPACES = (("user", CLONE_NEWUSER), ("mnt", CLONE_NEWNS), ("pid", CLONE_NEWPID), ("net", CLONE_NEWNET), ("ipc", CLONE_NEWIPC))


def helper_argv() -> list[str]:
    """Host argv of the entry helper: the sources of ``PARTS`` as one program, run by our own Python
    in isolated mode."""
    here = os.path.dirname(os.path.abspath(__file__))
    src = []
    for name in PARTS:
        with open(os.path.join(here, name), encoding="utf-8") as f:
            src.append(f.read())
    return [sys.executable, "-I", "-S", "-B", "-c", "\n".join(src)]


def _enter(cfg: dict) -> None:
    """Steps 1-2 of docs/sandbox.md ("Scoring entry") (raises Infra when the instance cannot be entered)."""
    pid = int(cfg["pid"])
    try:
        dfd = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise Infra(f"instance init {pid} is gone ({e.strerror})") from None
    try:
        with open("stat", opener=lambda p, fl: os.open(p, fl, dir_fd=dfd)) as f:
            fields = stat_fields(f.read())
        if cfg.get("starttime") and fields[19] != str(cfg["starttime"]):
            raise Infra(f"instance init {pid} is gone (the pid now belongs to another process)")
        fds = []
        for name, flag in NAMESPACES:
            fd = os.open(f"ns/{name}", os.O_RDONLY, dir_fd=dfd)
            if os.fstat(fd).st_ino == os.stat(f"/proc/self/ns/{name}").st_ino:
                os.close(fd)
                if name == "user":
                    raise Infra("the instance shares our user namespace; refusing to enter it")
                continue
            fds.append((name, flag, fd))
    except FileNotFoundError as e:
        raise Infra(f"instance init {pid} is gone ({e.strerror})") from None
    finally:
        os.close(dfd)
    for name, flag, fd in fds:
        check(libc.setns(fd, flag), f"setns({name})")
        os.close(fd)
    os.chdir("/")
    sys.path[:] = []  # from here on nothing may be imported: these paths are the container's
    sys.path_importer_cache.clear()
    try:
        root, init_root = os.stat("/"), os.stat("/proc/1/root/")
    except OSError as e:
        raise Infra(f"cannot check the container's root: {e}") from None
    if (root.st_dev, root.st_ino) != (init_root.st_dev, init_root.st_ino):
        raise Infra("after entering, / is not the instance's root")
    if not os.path.isdir(cfg["pristine"]):
        raise Infra(f"the image's pristine copy is not mounted at {cfg['pristine']}")
    mark("entered")
    check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    mount("none", "/", None, MS_REC | MS_PRIVATE)
    mark("private_mounts")


def _read_config() -> bytes:
    """The config on stdin: its byte count on a line, then the bytes (no end of file is awaited)."""
    size = int(sys.stdin.buffer.readline())
    raw = sys.stdin.buffer.read(size)
    if len(raw) != size:
        raise EOFError(f"config cut short ({len(raw)} of {size} bytes)")
    return raw


Emit = Callable[[dict], None]  # writes the result line and exits


def _emitter(marker: str) -> Emit:
    def emit(d: dict) -> None:
        os.write(1, ("\n" + marker + json.dumps(d) + "\n").encode())
        os._exit(0)

    return emit


def _drive(cfg: dict, w: int, devnull: int) -> None:
    """The driver (forked child): runs the tests and sends its messages, one JSON line each, on ``w``."""

    def send(d: dict) -> None:
        data = (json.dumps(d) + "\n").encode()
        while data:
            data = data[os.write(w, data) :]

    try:
        send(run_pytest(cfg, send, devnull))
    except Refused as e:
        send({"kind": "agent", "error": str(e.args[0]), "stage": e.args[1] if len(e.args) > 1 else "view"})
    except Infra as e:
        send({"kind": "infra", "error": str(e.args[0]), "stage": e.args[1] if len(e.args) > 1 else "prepare"})
    except BaseException as e:  # noqa: BLE001 - our bug, or (once the tests started) theirs
        send({"kind": "failed", "error": f"scoring driver failed: {type(e).__name__}: {e}"})
    os._exit(0)


def _collect(r: int, cpid: int, timeout: float, emit: Emit) -> tuple[bytes, int]:
    """Everything the driver sends on ``r`` until it closes it, and its wait status; a driver
    still running after ``timeout`` seconds is killed and that is the result (``emit``)."""
    buf = b""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            os.kill(cpid, signal.SIGKILL)
            os.waitpid(cpid, 0)
            if b'"pytest_started"' in buf:  # stopped by a program the tests ran (SIGSTOP), say
                emit({"kind": "disturbed", "stage": "tests", "error": "the scoring driver did not finish"})
            emit({"kind": "infra", "error": "the scoring driver did not finish"})
        rr, _, _ = select.select([r], [], [], min(left, 1.0))
        if rr:
            chunk = os.read(r, 1 << 20)
            if not chunk:
                break
            buf += chunk
    _, status = os.waitpid(cpid, 0)
    return buf, status


def _driver_result(buf: bytes, status: int) -> dict:
    """The helper's result from the driver's messages and wait status: its last result, or what
    ended it (``"disturbed"`` once the tests started: programs they run can kill it, else ``"infra"``)."""
    msgs = []
    for line in buf.decode("utf-8", "replace").splitlines():
        try:
            msgs.append(json.loads(line))
        except ValueError:
            pass
    final = [m for m in msgs if "kind" in m]
    started = any(m.get("stage") == "pytest_started" for m in msgs)
    if final:
        mark("driver_done")
        res = final[-1]
        if res["kind"] == "failed":  # an exception in the driver: who could have caused it
            res = {**res, "kind": "disturbed" if started else "infra"}
        res["stages"] = {**res.get("stages", {}), **STAGES}
        return res
    how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
    # once the tests started, programs they run (the agent's) can kill it or lower its rlimits
    return {
        "kind": "disturbed" if started else "infra",
        "stage": "tests" if started else "prepare",
        "error": f"the scoring driver ended ({how}) {'while the tests ran' if started else 'before the tests ran'}",
    }


def main() -> None:
    import resource  # noqa: F401 - needed after entering, when nothing can be imported
    import stat  # noqa: F401

    mark("imported")
    raw = _read_config()
    mark("config_read")
    cfg = json.loads(raw)
    emit = _emitter(cfg["marker"])
    devnull = os.open("/dev/null", os.O_RDWR)  # the host's, opened before entering
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # and what it forks, until they exec
    warm = cfg.get("mode") == "warm"
    if warm:
        os.nice(10)
    try:
        _enter(cfg)
    except Infra as e:
        emit({"kind": "infra", "error": str(e), "stage": "enter"})
    except OSError as e:
        emit({"kind": "infra", "error": f"could not enter the instance: {e}", "stage": "enter"})
    if warm:
        emit(warm_up(cfg, devnull))
    r, w = os.pipe()
    cpid = os.fork()
    if cpid == 0:
        os.close(r)
        _drive(cfg, w, devnull)
    os.close(w)
    buf, status = _collect(r, cpid, float(cfg["timeout"]) + 60, emit)
    emit(_driver_result(buf, status))


if __name__ == "__main__":
    try:
        main()
    except BaseException as e:  # noqa: BLE001
        sys.stdout.write("\nET-ENTER-FAILED " + f"{type(e).__name__}: {e}" + "\n")
        sys.exit(3)
