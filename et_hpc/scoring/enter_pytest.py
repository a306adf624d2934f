"""The scoring entry helper's pytest part: the tests, the warm-up, the control run.

``run_pytest(cfg, send, devnull)`` is steps 3-7 of docs/sandbox.md ("Scoring entry"), run in
the instance's pid namespace: no survivors, the tests' root (``runtime_view``), a scoring tmpfs
with the test file, then the pristine loader and Python running pytest (``BOOT``) without
capabilities under scoring rlimits; it returns the ``"ran"`` or ``"interp"`` result (``stages``
included) or raises ``Refused``/``Infra``. ``warm_up(cfg, devnull)`` is warm-up mode (``WARM``: the
pristine Python as far as importing pytest); ``_pristine_control`` tells a broken image from a
broken state. Runs inside the helper program after ``enter_view`` (``enter.helper_argv``).
"""

import json
import os
import select
import signal
import subprocess
import time
from collections.abc import Callable

if __spec__ is not None:  # imported; in the helper program every part shares one namespace
    from et_hpc.scoring.enter_sys import (
        MS_NODEV,
        MS_NOSUID,
        PR_SET_DUMPABLE,
        PR_SET_PDEATHSIG,
        STAGES,
        Infra,
        Refused,
        drop_privileges,
        kill_all,
        libc,
        mark,
        mount,
        others,
        read_small,
        read_small_bytes,
        set_limits,
    )
    from et_hpc.scoring.enter_view import runtime_view, usable_dir

WORK_DIRS = ("tmp", "mnt", "media", "srv", "opt", "run")  # in the pristine tree, first that exists
# Builtin pytest plugins that only act on command-line options scoring never passes (--pastebin,
# --setup-only/--setup-plan/--setup-show, --stepwise) or on the ini's ``pythonpath`` (the ini is
# empty): blocked to save their import and option set-up. Everything a test can use (fixtures such
# as tmp_path, tmpdir, capsys, caplog, monkeypatch, recwarn, doctest_namespace; nose-style setup;
# unittest; skip/xfail marks; warnings) stays.
UNUSED_PLUGINS = ("pastebin", "setuponly", "setupplan", "stepwise", "python_path")
# Run by the pristine python: its own site dirs only, non-dumpable, a fence before the report.
BOOT = r"""
import time
_t = {"start": time.monotonic()}
import os, sys, site
for d in %(sitedirs)r:
    if os.path.isdir(d) and not os.path.islink(d):
        site.addsitedir(d)
try:
    import ctypes
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
except Exception:
    pass
try:
    import pytest
except ImportError as e:
    sys.stderr.write("ET-NO-PYTEST: %%s\n" %% e)
    sys.exit(97)
_t["pytest_imported"] = time.monotonic()

def _fence():
    keep = (1, os.getpid(), os.getppid())
    for _ in range(200):
        left = []
        for n in os.listdir("/proc"):
            if n.isdigit() and int(n) not in keep:
                try:
                    os.kill(int(n), 9)
                    left.append(n)
                except OSError:
                    pass
        if not left:
            return

class _Fence:
    def pytest_sessionstart(self, session):
        _t["session_start"] = time.monotonic()

    def pytest_collection_finish(self, session):
        _t["collected"] = time.monotonic()

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session, exitstatus):
        _t["tests_done"] = time.monotonic()
        _fence()  # nothing a test started can touch the report written after this
        for p in (%(junit)r, %(stages)r):  # whatever a test's program left at these paths goes
            try:
                os.unlink(p)
            except OSError:
                pass
        _t["fenced"] = time.monotonic()

rc = pytest.main(plugins=[_Fence()])
_t["end"] = time.monotonic()
try:
    import json
    fd = os.open(%(stages)r, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    os.write(fd, json.dumps(_t).encode())
    os.close(fd)
except Exception:
    pass
# The report is written and every other process is gone: skip the interpreter's teardown of
# hundreds of modules (tens of ms, more on a cold image) once the output is out.
for f in (sys.stdout, sys.stderr):
    try:
        f.flush()
    except Exception:
        pass
os._exit(rc if isinstance(rc, int) else 1)
"""


# Warm-up mode: the pristine python as far as pytest and its builtin plugins, nothing of a task's.
WARM = r"""
import os, sys, site
for d in %(sitedirs)r:
    if os.path.isdir(d) and not os.path.islink(d):
        site.addsitedir(d)
try:
    import ctypes, json
    import pytest
    from _pytest.config import default_plugins
    for n in default_plugins:
        try:
            __import__("_pytest." + n)
        except Exception:
            pass
    import xml.etree.ElementTree
except Exception:
    pass
os._exit(0)
"""


def warm_up(cfg: dict, devnull: int) -> dict:
    """Warm-up mode (see ``et_hpc.scoring.live.start_warmup``): run the pristine python once, as far as
    importing pytest and its plugins, so the final tests find those files in the pristine mount's
    page cache. It runs as the agent's uid without capabilities, niced, output to the host's
    /dev/null; nothing it does is read back (only its exit status)."""
    pristine = cfg["pristine"]
    loader, python = cfg["loader"], pristine + "/usr/bin/python3"
    ver = _python_version(pristine)
    if ver is None or not (os.path.isfile(loader) and os.path.isfile(python)):
        return {"kind": "warm", "ran": False}
    argv = [
        loader,
        "--inhibit-cache",
        "--library-path",
        ":".join(cfg["libdirs"]),
        python,
        "-I",
        "-S",
        "-B",
        "-c",
        WARM % {"sitedirs": _sitedirs(pristine, ver)},
    ]
    env = {"PATH": cfg["path"], "HOME": "/", "LANG": "C.UTF-8", "LOCPATH": pristine + "/usr/lib/locale"}

    def child() -> None:  # niced already: the helper is
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)  # ends with the helper (if it is SIGKILLed)
        set_limits(cfg)
        drop_privileges()

    # SIGTERM waits until the python's pid is known (a helper that died while it forked would
    # leave the child to its parent-death signal: see ended)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        p = subprocess.Popen(
            argv, env=env, stdin=devnull, stdout=devnull, stderr=devnull, close_fds=True, start_new_session=True, preexec_fn=child, cwd="/"
        )
    except OSError as e:
        return {"kind": "warm", "ran": False, "error": str(e)}

    def ended(*_: object) -> None:
        # Asked to end (Sandbox.stop_warmup): kill and reap the python here. A child left to its
        # parent-death signal would be a zombie in the instance's pid namespace that only the
        # host's init reaps, and apptainer does not finish stopping the instance until it has.
        if p.returncode is None:  # not p.wait(): the interrupted p.wait below may hold its lock
            try:
                os.kill(p.pid, signal.SIGKILL)
                os.waitpid(p.pid, 0)
            except OSError:  # reaped already
                pass
        os._exit(0)

    signal.signal(signal.SIGTERM, ended)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    try:
        rc = p.wait(timeout=float(cfg["timeout"]))
    except subprocess.TimeoutExpired:
        p.kill()
        rc = p.wait()
    mark("warmed")
    return {"kind": "warm", "ran": True, "rc": rc, "stages": STAGES}


def _sitedirs(pristine: str, ver: str) -> list[str]:
    pre = pristine + "/usr"
    return [
        pre + "/local/lib/" + ver + "/dist-packages",
        pre + "/lib/python3/dist-packages",
        pre + "/lib/" + ver + "/dist-packages",
        pre + "/local/lib/" + ver + "/site-packages",
        pre + "/lib/" + ver + "/site-packages",
    ]


def _python_version(pristine: str) -> str | None:
    try:
        names = sorted(
            n for n in os.listdir(pristine + "/usr/lib") if n.startswith("python3.") and os.path.isfile(f"{pristine}/usr/lib/{n}/os.py")
        )
    except OSError:
        return None
    return names[-1] if names else None


# Run by the pristine python chrooted into the pristine tree itself (no state of the agent's at
# all), when the tests' interpreter did not start: tells a broken image from a broken state.
CONTROL = r"""
import site, sys
for d in %(sitedirs)r:
    site.addsitedir(d)
import pytest
"""


def _pristine_control(cfg: dict, ver: str, devnull: int) -> bool:
    """Whether the pristine loader, Python and pytest start in a root that is the pristine tree
    alone (chroot), with the same rlimits and no capabilities: True means the failure seen in the
    tests' root came from the state the agent left."""
    pristine = cfg["pristine"]
    n = len(pristine)
    argv = [
        cfg["loader"][n:],
        "--inhibit-cache",
        "--library-path",
        ":".join(d[n:] for d in cfg["libdirs"]),
        "/usr/bin/python3",
        "-I",
        "-S",
        "-B",
        "-c",
        CONTROL % {"sitedirs": _sitedirs("", ver)},
    ]
    env = {"PATH": cfg["path"], "HOME": "/", "LANG": "C.UTF-8", "LOCPATH": "/usr/lib/locale"}

    def child() -> None:
        os.chroot(pristine)
        os.chdir("/")
        set_limits(cfg)
        drop_privileges()

    try:
        p = subprocess.Popen(
            argv, env=env, stdin=devnull, stdout=devnull, stderr=devnull, close_fds=True, start_new_session=True, preexec_fn=child, cwd="/"
        )
        return p.wait(timeout=60) == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _no_survivors(me: int) -> None:
    """Step 3: Refused (stage ``survivors``) if a process of the instance outlived the host's sweep
    (every one is killed first); marks ``killed``."""
    left = others(me)
    if left:  # the host's sweep ended every process of the instance before we entered
        ok, _ = kill_all(me)
        mark("killed")
        raise Refused(
            f"{len(left)} process(es) of the instance outlived the sweep from the host ({'killed' if ok else 'not all could be killed'})",
            "survivors",
        )
    mark("killed")


def _pristine_python(cfg: dict) -> tuple[str, str, str]:
    """The pristine loader, python and python version (``python3.X``); Infra if one is missing."""
    pristine = cfg["pristine"]
    loader, python = cfg["loader"], pristine + "/usr/bin/python3"
    for p in (loader, python):
        if not os.path.isfile(p):
            raise Infra(f"the image's pristine interpreter is missing: no {p}")
    ver = _python_version(pristine)
    if ver is None:
        raise Infra(f"the image's pristine tree has no python3 standard library under {pristine}/usr/lib")
    return loader, python, ver


def _work_dir(pristine: str) -> str:
    """The first of ``WORK_DIRS`` that is a real directory of the pristine tree (Infra if none)."""
    for d in WORK_DIRS:
        cand = f"{pristine}/{d}"
        if os.path.isdir(cand) and not os.path.islink(cand):
            return d
    raise Infra(f"no directory to mount the scoring tmpfs on in {pristine}")


def _scoring_tmpfs(work: str, cfg: dict) -> tuple[str, str, str]:
    """Step 5: the scoring tmpfs on ``work`` with the test file, an empty ini and the tests'
    ``TMPDIR``; returns (test file, ini, tmpdir)."""
    mount("et-score", work, "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=0700")
    path = os.path.join(work, cfg["name"])
    tmpdir = os.path.join(work, "tmp")  # the tests' TMPDIR: never a place the agent could fill
    os.mkdir(tmpdir, 0o700)
    with open(path, "w", encoding="utf-8") as f:
        f.write(cfg["source"])
    ini = os.path.join(work, "pytest.ini")
    with open(ini, "w") as f:
        f.write("[pytest]\n")
    return path, ini, tmpdir


def _read_output(p: subprocess.Popen, limit: int, timeout: float) -> tuple[bytes, bool]:
    """The last ``limit`` bytes ``p`` wrote before EOF or ``timeout`` seconds, and whether it timed out."""
    tail = b""
    deadline = time.monotonic() + timeout
    assert p.stdout is not None  # started with stdout=PIPE
    fd = p.stdout.fileno()
    while True:
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            return tail, True
        r, _, _ = select.select([fd], [], [], min(left_s, 1.0))
        if r:
            chunk = os.read(fd, 65536)
            if not chunk:
                return tail, False
            tail = (tail + chunk)[-limit:]


def _interp_failure(rc: int, out: str, report: str | None) -> str | None:
    """Why the tests' interpreter did not start (pytest missing, or the loader's exit 127), or None."""
    if rc == 97 and "ET-NO-PYTEST" in out:
        return "pytest could not be imported"
    if rc == 127 and report is None and "error while loading shared libraries" in out:
        return "the pristine interpreter could not start"
    return None


def _account_lines(data: bytes, name: bytes, drop: bytes, new: list[bytes]) -> bytes | None:
    """``data`` (an /etc/passwd or /etc/group) with ``name``'s id fields set to ``new`` and other
    lines holding the id ``drop`` removed; None when ``name`` has no line (left as it is)."""
    out, found = [], False
    for ln in data.split(b"\n"):
        f = ln.split(b":")
        if f[0] == name and len(f) > 2:
            found = True
            f[2 : 2 + len(new)] = new
            out.append(b":".join(f))
        elif len(f) > 2 and f[2] == drop:
            continue
        elif ln:
            out.append(ln)
    return b"\n".join(out) + b"\n" if found else None


def _rewrite_small(path: str, edit: Callable[[bytes], bytes | None]) -> bool:
    """Rewrite the regular file ``path`` (at most 1 MiB, never a FIFO, device or symlink) with ``edit``."""
    data = read_small_bytes(path, 1 << 20)
    new = edit(data) if data is not None else None
    if new is None:
        return False
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY)
    try:
        import stat as _st

        if not _st.S_ISREG(os.fstat(fd).st_mode):
            return False
        os.ftruncate(fd, 0)
        view = memoryview(new)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    return True


def _name_account() -> None:
    """Name the agent's uid ``user`` in the instance's /etc/passwd and /etc/group, as the first
    shell of a live episode does (et_hpc.sandbox.prepare_script, step 1), in this process: no
    program of the instance runs. Called without capabilities, as the agent's uid."""
    me, mg = str(os.getuid()).encode(), str(os.getgid()).encode()
    data = read_small_bytes("/etc/passwd", 1 << 20) or b""
    rows = [ln.split(b":") for ln in data.split(b"\n")]
    name = b"user" if any(f[0] == b"user" for f in rows) else next((f[0] for f in rows if len(f) > 2 and f[2] == b"1000"), None)
    if name and _rewrite_small("/etc/passwd", lambda d: _account_lines(d, name, me, [me, mg])):
        _rewrite_small("/etc/group", lambda d: _account_lines(d, name, mg, [mg]))


def _accounts(cfg: dict, notes: list[str]) -> None:
    """``_name_account`` in a child without capabilities, when the sandbox was not prepared (a kept
    state, or an episode whose shell never started); a failure is a note, never a result."""
    if not cfg.get("accounts"):
        return
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            drop_privileges()
            _name_account()
            code = 0
        except BaseException:  # noqa: BLE001 - the state's files: nothing to report but the status
            pass
        os._exit(code)
    deadline = time.monotonic() + 10
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            break
        time.sleep(0.005)
    if status != 0:
        notes.append("the agent's uid could not be named 'user' in the instance's /etc/passwd")
    mark("accounts")


def run_pytest(cfg: dict, send: Callable[[dict], None], devnull: int) -> dict:
    """Steps 3-7, in the instance's pid namespace with capabilities."""
    me = os.getpid()
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    _no_survivors(me)
    notes: list[str] = []
    _accounts(cfg, notes)
    pristine = cfg["pristine"]
    loader, python, ver = _pristine_python(cfg)
    work_dir = _work_dir(pristine)
    runtime_view(pristine, work_dir, notes)
    mark("view")
    work = f"{pristine}/{work_dir}"
    path, ini, tmpdir = _scoring_tmpfs(work, cfg)
    junit = os.path.join(work, "junit.xml")
    stages = os.path.join(work, "stages.json")
    mark("tmpfs")
    home = cfg["home"]
    why = usable_dir(home)
    cwd = home if why is None else "/"
    if why:
        notes.append(f"{why}: the tests ran from /")
    libdirs = ":".join(cfg["libdirs"])
    argv = [
        loader,
        "--inhibit-cache",
        "--library-path",
        libdirs,
        python,
        "-I",
        "-S",
        "-B",
        "-c",
        BOOT % {"sitedirs": _sitedirs(pristine, ver), "junit": junit, "stages": stages},
        "-p",
        "no:cacheprovider",
        *(a for n in UNUSED_PLUGINS for a in ("-p", "no:" + n)),
        "--rootdir",
        work,
        "-c",
        ini,
        "--noconftest",
        "--junitxml",
        junit,
        "-q",
        path,
    ]
    env = {
        "PATH": cfg["path"],
        "HOME": home,
        "LANG": "C.UTF-8",
        "LOCPATH": pristine + "/usr/lib/locale",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "TMPDIR": tmpdir,
    }

    def child() -> None:
        set_limits(cfg)
        drop_privileges()
        os.umask(0o022)
        try:
            os.chdir(cwd)
        except OSError:
            os.chdir("/")

    # From here on code of the agent's may run (programs the tests start) and reach this driver:
    # whatever ends or breaks it is the state's doing (see enter.main)
    send({"stage": "pytest_started"})
    try:
        p = subprocess.Popen(
            argv,
            env=env,
            stdin=devnull,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            close_fds=True,
            start_new_session=True,
            preexec_fn=child,
            cwd="/",
        )
    except OSError as e:
        raise Infra(f"the pristine interpreter could not be started: {e}") from None
    mark("pytest_spawned")
    tail, timed_out = _read_output(p, int(cfg["tail"]), float(cfg["timeout"]))
    mark("pytest_eof")
    if timed_out:
        kill_all(me)
    rc = p.wait()
    # Output written after EOF was seen is not waited for; a last sweep for what the tests started.
    _, killed_after = kill_all(me)
    report = read_small(junit, 8 << 20)  # a regular file only: never blocking on a FIFO
    _read_stages(stages)
    mark("report_read")
    out = tail.decode("utf-8", "replace")
    interp = _interp_failure(rc, out, report)
    if interp is not None:
        control = _pristine_control(cfg, ver, devnull)
        mark("control")
        return {
            "kind": "interp",
            "control": control,
            "error": interp + ": " + out.strip()[-300:],
            "out": out,
            "notes": notes,
            "stages": STAGES,
        }
    return {
        "kind": "ran",
        "rc": rc if rc >= 0 else None,
        "signal": -rc if rc < 0 else None,
        "timed_out": timed_out,
        "junit": report,
        "out": out,
        "killed": 0,
        "killed_after": killed_after,
        "cwd": cwd,
        "notes": notes,
        "stages": STAGES,
    }


def _read_stages(path: str) -> None:
    """The pristine python's own stage times (numbers only; a missing or odd file is ignored)."""
    try:
        got = json.loads(read_small(path, 4096) or "{}")
        STAGES.update({"py_" + str(k): float(v) for k, v in dict(got).items()})
    except (ValueError, TypeError):
        pass
