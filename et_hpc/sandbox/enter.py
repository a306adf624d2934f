"""Enter a running instance from the host and run its final tests with nothing the agent wrote.

Contract. ``helper_argv()`` is the argv of a fresh, single-threaded host Python (this file's own
source run with ``sys.executable -I -S``; stdlib only, every module it needs imported before it
enters the container). It reads one JSON config on stdin (its byte count on a line first) and prints one line ``MARKER{json}``
on stdout, then exits 0. The JSON has ``kind``:

- ``"ran"``: the tests ran; ``rc``/``signal`` of pytest, ``timed_out``, ``junit`` (text or None),
  ``out`` (output tail), ``killed``, ``cwd``, ``notes`` (what scoring saw or changed);
- ``"agent"``: the state the agent left stops the tests (``error`` says how, ``stage`` is
  ``survivors`` or ``view``);
- ``"disturbed"``: the driver died, failed or hung after the tests started;
- ``"interp"``: the tests' interpreter did not start (``control``: see step 7);
- ``"infra"``: something outside the agent's reach failed (``error``).

``et_hpc.sandbox.scoring.blame`` decides status and reward from these (one table).

What it does, in order (no file of the instance's writable layer is executed or loaded as code
before the pristine interpreter runs the tests, and none is read to decide how it starts). The
host has already stopped and killed every process of the instance but init
(``et_hpc.sandbox.sweep``), before this helper starts and before the agent's shells are closed:

1. opens ``/proc/PID/{stat,ns/*}`` of the instance's init (PID and start time checked against the
   ones recorded at start), then ``setns`` into its user namespace first (we own it, so we get
   every capability inside it), then mnt, pid, net and ipc (only those that differ from ours).
   The root is then the mount namespace's root: it is checked to be the container's (the same
   inode as ``/proc/1/root``, and the pristine tree is there). ``sys.path`` is emptied so that
   nothing is ever imported from the container's files;
2. ``unshare(CLONE_NEWNS)`` and makes ``/`` rprivate: a private copy of the instance's mounts;
3. forks: the child is in the instance's pid namespace and marks itself non-dumpable. Any
   process other than init found there now outlived the host's sweep: it is killed and the
   episode is the agent's 0 (``"agent"``, stage ``survivors``); no tests run;
4. builds the tests' root (``runtime_view``) and ``pivot_root``s into it: a tmpfs holding bind
   mounts of every entry of the agent's ``/``, ``/usr`` and ``/etc`` (a symlink is copied, anything
   else is bound; entries are never opened or read), except that ``/lib*``, ``/usr/lib*`` (the
   loader's default directories, gconv, locales) and ``/etc``'s ``ld.so.preload``,
   ``ld.so.cache``, ``ld.so.conf*`` and ``nsswitch.conf`` are the pristine tree's, whatever the
   agent left there. The agent's own tree is untouched evidence. An entry that cannot be listed
   or bound is the state's failure (``"agent"``, stage ``view``);
5. mounts a fresh 64 MiB tmpfs (mode 0700) on a directory of the pristine read-only tree
   (``/.et-pristine/tmp``) and writes the test file, an empty pytest config there, with a ``tmp``
   directory in it that is the tests' ``TMPDIR`` (pytest's capture files, ``tmp_path``): scoring
   needs no writable place of the agent's, so an agent that fills every disk it can reach still
   gets its tests run. Locales come from the pristine tree (``LOCPATH``);
6. tells the helper the tests start (from here on, programs the tests run can signal, stop or
   prlimit the driver: whatever then ends or breaks it is ``"disturbed"``, the state's doing)
   and starts the pristine loader ``/.et-pristine/.../ld-linux*.so`` with ``--inhibit-cache
   --library-path <pristine lib dirs>`` on ``/.et-pristine/usr/bin/python3 -I -S -B``, pytest with
   ``-p no:cacheprovider --noconftest -c <empty ini> --rootdir <tmpfs>`` and ``-p no:`` for the
   builtin plugins that only act on options scoring never passes (``UNUSED_PLUGINS``), autoload of
   plugins off,
   a clean environment, stdin the host's ``/dev/null``; in the child before ``execve``: scoring
   rlimits (address space, processes, file size, CPU time, no core), no_new_privs, every
   capability dropped (bounding, ambient, effective, permitted), cwd ``/home/user`` if usable by
   the agent's uid, else ``/``. The pristine Python marks itself non-dumpable and kills every
   other process of the instance before pytest writes its JUnit report (a program a test runs
   cannot rewrite it), removes whatever such a program left at the report's path, and exits
   without the interpreter's teardown once its output is flushed;
7. waits with the verifier timeout, kills what is left, reads the JUnit report from the tmpfs (a
   regular file only: never blocking on a FIFO) and sends the result to the host process over a
   pipe only the driver holds. If the interpreter did not start (exit 127 from the loader, or
   pytest missing), the same interpreter is started once more chrooted into the pristine tree
   alone (``_pristine_control``): ``"interp"`` with ``control`` True means the state the agent
   left stopped it, False that the image itself is broken.

Warm-up mode (``"mode": "warm"`` in the config; ``et_hpc.sandbox.scoring.start_warmup``, once the
agent's first shell started): step 1, then the pristine python of step 6 without capabilities, niced, output to
the host's /dev/null, importing pytest and its builtin plugins and nothing else. Nothing is killed,
mounted or neutralised, and nothing it prints is read: ``kind`` ``"warm"``, with its exit status.

Every stage leaves a ``time.monotonic()`` mark (the host's clock: the helper, the driver and the
pristine Python share it) in the result's ``stages``; ``et_hpc.sandbox.scoring`` turns them into
``ScoreResult.stages`` (seconds from the start of scoring), for benchmarks and telemetry.
"""

from __future__ import annotations

import time

T_START = time.monotonic()  # when this helper began (stage timings, CLOCK_MONOTONIC: host-comparable)

import ctypes
import json
import os
import select
import signal
import subprocess
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
NAMESPACES = (("user", CLONE_NEWUSER), ("mnt", CLONE_NEWNS), ("pid", CLONE_NEWPID),
              ("net", CLONE_NEWNET), ("ipc", CLONE_NEWIPC))
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 4096, 16384, 1 << 18
PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 4, 24, 38, 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
PR_SET_PDEATHSIG = 1
WORK_DIRS = ("tmp", "mnt", "media", "srv", "opt", "run")  # in the pristine tree, first that exists
# Builtin pytest plugins that only act on command-line options scoring never passes (--pastebin,
# --setup-only/--setup-plan/--setup-show, --stepwise) or on the ini's ``pythonpath`` (the ini is
# empty): blocked to save their import and option set-up. Everything a test can use (fixtures such
# as tmp_path, tmpdir, capsys, caplog, monkeypatch, recwarn, doctest_namespace; nose-style setup;
# unittest; skip/xfail marks; warnings) stays.
UNUSED_PLUGINS = ("pastebin", "setuponly", "setupplan", "stepwise", "python_path")
STAGES: dict[str, float] = {"helper_start": T_START}  # stage -> time.monotonic(), sent with the result


def _mark(stage: str) -> None:
    STAGES[stage] = time.monotonic()

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)


class Refused(Exception):
    """The state the agent left cannot be scored safely (the agent's failure)."""


class Infra(Exception):
    """A failure outside the agent's reach."""


def helper_argv() -> list[str]:
    """Host argv of the entry helper: this source, run by our own Python in isolated mode."""
    with open(__file__, encoding="utf-8") as f:
        src = f.read()
    return [sys.executable, "-I", "-S", "-B", "-c", src]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _mount(src: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(src.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                       data.encode() if data else None), f"mount {target}")


def _stat_fields(text: str) -> list[str]:
    return text[text.rfind(")") + 2:].split()


def _others(me: int) -> list[int]:
    out = []
    for n in os.listdir("/proc"):
        if not n.isdigit() or int(n) in (1, me):
            continue
        try:
            with open(f"/proc/{n}/stat") as f:
                st = f.read()
        except OSError:
            continue
        if _stat_fields(st)[:1] not in (["Z"], ["X"]):
            out.append(int(n))
    return out


def kill_all(me: int, rounds: int = 500) -> tuple[bool, int]:
    """SIGKILL every process of this pid namespace but init and ``me``; (none left, how many)."""
    killed = 0
    for _ in range(rounds):
        left = _others(me)
        if not left:
            return True, killed
        killed += len(left)
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
        time.sleep(0.01)
    return not _others(me), killed


def _read_small(path: str, limit: int = 65536) -> str | None:
    """A regular file of ours (the report, stage times: on scoring's own tmpfs) as text, or None
    if it is absent or not a regular file (never blocks on a FIFO a test's program left there)."""
    import stat as _st
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if not _st.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, limit).decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


# -- the tests' root: the agent's state, with the runtime the loader and libc read from the image --

MNT_DETACH = 2
LIB_NAMES = ("lib", "lib32", "lib64", "libx32")  # at / and in /usr: the loader's default dirs
ETC_RUNTIME = ("ld.so.preload", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "nsswitch.conf")
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
VIEW_DIRS = ("mnt", "media", "srv", "opt", "run", "tmp")  # in the pristine tree, first free one


def _agent_state(what: str, e: OSError) -> Refused:
    return Refused(f"the state left cannot be mapped for the tests: {what} ({e.strerror or e})")


def _place(src: str, st: os.stat_result, dst: str) -> None:
    """``dst`` (in the view) shows ``src``: the same symlink, or a bind mount of the object itself
    (a directory recursively, with what is mounted below it)."""
    import stat as _st
    if _st.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), dst)
        return
    if _st.S_ISDIR(st.st_mode):
        os.mkdir(dst, 0o755)
        _mount(src, dst, None, MS_BIND | MS_REC)
    else:
        os.close(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        _mount(src, dst, None, MS_BIND)


def _mirror(src_dir: str, dst: str, skip: tuple[str, ...], owner: str) -> int:
    """Every entry of the directory the path ``src_dir`` leads to, placed in ``dst`` (see
    ``_place``), except the names in ``skip``. ``owner`` names whose state it is (for the error);
    anything that cannot be read or placed is the state's failure (Refused). Entries are never
    opened or read: only their type decides how they are shown (a symlink is copied, anything
    else is bound), so every path shows the tests what it showed the agent."""
    try:
        names = os.listdir(src_dir)
    except OSError as e:
        raise _agent_state(f"{owner}{src_dir} cannot be listed", e) from None
    n = 0
    for name in names:
        if name in skip:
            continue
        src = os.path.join(src_dir, name)
        try:
            _place(src, os.lstat(src), os.path.join(dst, name))
        except OSError as e:
            raise _agent_state(f"{owner}{src} cannot be shown to the tests", e) from None
        n += 1
    return n


def _pristine_entries(pristine: str, rel: str, names: tuple[str, ...], dst: str) -> None:
    """The pristine tree's own ``rel/name`` for each name it has, placed in ``dst`` (Infra on error)."""
    for name in names:
        src = f"{pristine}{rel}/{name}"
        try:
            st = os.lstat(src)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise Infra(f"the pristine tree cannot be read: {src}: {e.strerror}") from None
        try:
            _place(src, st, os.path.join(dst, name))
        except OSError as e:
            raise Infra(f"could not place the pristine {src} in the tests' root: {e}") from None


def _dir_like(src: str, dst: str) -> None:
    """A fresh directory in the view with the mode and owner of the agent's directory ``src``
    (a directory the agent's path leads to; 0755 and ours if it leads to none)."""
    os.mkdir(dst, 0o755)
    try:
        st = os.stat(src)
    except OSError:
        return
    import stat as _st
    if _st.S_ISDIR(st.st_mode):
        os.chmod(dst, _st.S_IMODE(st.st_mode))
        try:
            os.chown(dst, st.st_uid, st.st_gid)
        except OSError:
            pass  # an owner not mapped in the instance's user namespace: ours it stays


def runtime_view(pristine: str, avoid: str, notes: list[str]) -> None:
    """Step 5 of the module doc: make ``/`` (of scoring's private mount namespace) a new root that
    shows the agent's final state everywhere, except that what the dynamic loader and libc read
    from the root is the pristine image's, unconditionally: ``/lib*``, ``/usr/lib*`` (the default
    library dirs with gconv and locales) and ``/etc``'s ``ld.so.preload``, ``ld.so.cache``,
    ``ld.so.conf*`` and ``nsswitch.conf`` (absent when the image has none). Nothing of the agent's
    is read to decide this; its state itself is untouched (the new root is only bind mounts of it).
    """
    view = None
    for d in VIEW_DIRS:
        cand = f"{pristine}/{d}"
        if d != avoid and os.path.isdir(cand) and not os.path.islink(cand):
            view = cand
            break
    if view is None:
        raise Infra(f"no directory to build the tests' root on in {pristine}")
    try:
        _mount("et-root", view, "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=0755")
        # the pristine tree first, while the view is empty; the copy of the view itself it
        # brings along (the view is mounted in it) is dropped
        os.makedirs(view + pristine, 0o755)
        _mount(pristine, view + pristine, None, MS_BIND | MS_REC)
        _check(_libc.umount2((view + view).encode(), MNT_DETACH), "umount the view's copy")
    except OSError as e:
        raise Infra(f"could not build the tests' root: {e}") from None
    skip_top = (*LIB_NAMES, "usr", "etc", pristine.strip("/"))
    n = _mirror("/", view, skip_top, "")
    try:
        _dir_like("/usr", view + "/usr")
        _dir_like("/etc", view + "/etc")
    except OSError as e:
        raise Infra(f"could not build the tests' root: {e}") from None
    import stat as _st
    for d, skip in (("/usr", LIB_NAMES), ("/etc", ETC_RUNTIME)):
        try:
            is_dir = _st.S_ISDIR(os.stat(d).st_mode)
        except OSError:
            is_dir = False
        if is_dir:
            n += _mirror(d, view + d, skip, "")
        else:
            notes.append(f"{d} is not a directory: the tests saw only the image's runtime files there")
    _pristine_entries(pristine, "", LIB_NAMES, view)
    _pristine_entries(pristine, "/usr", LIB_NAMES, view + "/usr")
    _pristine_entries(pristine, "/etc", ETC_RUNTIME, view + "/etc")
    nr = SYS_PIVOT_ROOT.get(os.uname().machine, 155)
    try:
        os.chdir(view)
        _check(_libc.syscall(nr, b".", b"."), "pivot_root")
        _check(_libc.umount2(b".", MNT_DETACH), "umount the old root")
        os.chdir("/")
    except OSError as e:
        raise Infra(f"could not switch to the tests' root: {e}") from None
    STAGES["view_entries"] = float(n)


def _usable_dir(path: str) -> str | None:
    """Why ``path`` is not a directory the agent's uid can enter and list, or None if it is."""
    try:
        import stat as _st
        st = os.stat(path)
    except OSError as e:
        return f"{path} is unusable ({e.strerror})"
    if not _st.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if not os.access(path, os.X_OK | os.R_OK):  # real uid, no capabilities
        return f"{path} is not accessible (mode {oct(st.st_mode & 0o7777)})"
    return None


class _Caps(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


class _CapHdr(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


def drop_privileges() -> None:
    """Every capability gone (bounding, ambient, effective, permitted, inheritable), no_new_privs."""
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    for cap in range(64):
        _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    hdr = _CapHdr(0x20080522, 0)
    data = (_Caps * 2)()
    _check(_libc.capset(ctypes.byref(hdr), data), "capset")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def _limits(cfg: dict) -> None:
    import resource as _r
    lim = cfg.get("limits") or {}
    for name, res, scale in (("vmem_mb", _r.RLIMIT_AS, 1 << 20), ("nproc", _r.RLIMIT_NPROC, 1),
                             ("fsize_mb", _r.RLIMIT_FSIZE, 1 << 20), ("cpu_s", _r.RLIMIT_CPU, 1)):
        v = lim.get(name)
        if v:
            _r.setrlimit(res, (int(v) * scale, int(v) * scale))
    _r.setrlimit(_r.RLIMIT_CORE, (0, 0))


# Run by the pristine python: its own site dirs only, non-dumpable, a fence before the report.
BOOT = r'''
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
'''


# Warm-up mode: the pristine python as far as pytest and its builtin plugins, nothing of a task's.
WARM = r'''
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
'''


def _warm(cfg: dict, devnull: int) -> dict:
    """Warm-up mode (see ``et_hpc.sandbox.scoring.start_warmup``): run the pristine python once, as far as
    importing pytest and its plugins, so the final tests find those files in the pristine mount's
    page cache. It runs as the agent's uid without capabilities, niced, output to the host's
    /dev/null; nothing it does is read back (only its exit status)."""
    pristine = cfg["pristine"]
    loader, python = cfg["loader"], pristine + "/usr/bin/python3"
    ver = _python_version(pristine)
    if ver is None or not (os.path.isfile(loader) and os.path.isfile(python)):
        return {"kind": "warm", "ran": False}
    argv = [loader, "--inhibit-cache", "--library-path", ":".join(cfg["libdirs"]), python, "-I", "-S", "-B",
            "-c", WARM % {"sitedirs": _sitedirs(pristine, ver)}]
    env = {"PATH": cfg["path"], "HOME": "/", "LANG": "C.UTF-8", "LOCPATH": pristine + "/usr/lib/locale"}

    def child() -> None:  # niced already: the helper is
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        _libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)  # ends with the helper (if it is SIGKILLed)
        _limits(cfg)
        drop_privileges()

    # SIGTERM waits until the python's pid is known (a helper that died while it forked would
    # leave the child to its parent-death signal: see ended)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        p = subprocess.Popen(argv, env=env, stdin=devnull, stdout=devnull, stderr=devnull, close_fds=True,
                             start_new_session=True, preexec_fn=child, cwd="/")
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
    _mark("warmed")
    return {"kind": "warm", "ran": True, "rc": rc, "stages": STAGES}


def _sitedirs(pristine: str, ver: str) -> list[str]:
    pre = pristine + "/usr"
    return [pre + "/local/lib/" + ver + "/dist-packages", pre + "/lib/python3/dist-packages",
            pre + "/lib/" + ver + "/dist-packages", pre + "/local/lib/" + ver + "/site-packages",
            pre + "/lib/" + ver + "/site-packages"]


def _python_version(pristine: str) -> str | None:
    try:
        names = sorted(n for n in os.listdir(pristine + "/usr/lib") if n.startswith("python3.")
                       and os.path.isfile(f"{pristine}/usr/lib/{n}/os.py"))
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
    argv = [cfg["loader"][n:], "--inhibit-cache", "--library-path", ":".join(d[n:] for d in cfg["libdirs"]),
            "/usr/bin/python3", "-I", "-S", "-B", "-c", CONTROL % {"sitedirs": _sitedirs("", ver)}]
    env = {"PATH": cfg["path"], "HOME": "/", "LANG": "C.UTF-8", "LOCPATH": "/usr/lib/locale"}

    def child() -> None:
        os.chroot(pristine)
        os.chdir("/")
        _limits(cfg)
        drop_privileges()

    try:
        p = subprocess.Popen(argv, env=env, stdin=devnull, stdout=devnull, stderr=devnull, close_fds=True,
                             start_new_session=True, preexec_fn=child, cwd="/")
        return p.wait(timeout=60) == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _run_pytest(cfg: dict, send, devnull: int) -> dict:
    """Steps 3-7, in the instance's pid namespace with capabilities."""
    me = os.getpid()
    _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    left = _others(me)
    if left:  # the host's sweep ended every process of the instance before we entered
        ok, _ = kill_all(me)
        _mark("killed")
        raise Refused(f"{len(left)} process(es) of the instance outlived the sweep from the host "
                      f"({'killed' if ok else 'not all could be killed'})", "survivors")
    _mark("killed")
    pristine = cfg["pristine"]
    loader, python = cfg["loader"], pristine + "/usr/bin/python3"
    for p in (loader, python):
        if not os.path.isfile(p):
            raise Infra(f"the image's pristine interpreter is missing: no {p}")
    ver = _python_version(pristine)
    if ver is None:
        raise Infra(f"the image's pristine tree has no python3 standard library under {pristine}/usr/lib")
    work_dir = None
    for d in WORK_DIRS:
        cand = f"{pristine}/{d}"
        if os.path.isdir(cand) and not os.path.islink(cand):
            work_dir = d
            break
    if work_dir is None:
        raise Infra(f"no directory to mount the scoring tmpfs on in {pristine}")
    notes: list[str] = []
    runtime_view(pristine, work_dir, notes)
    _mark("view")
    work = f"{pristine}/{work_dir}"
    _mount("et-score", work, "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=0700")
    path = os.path.join(work, cfg["name"])
    tmpdir = os.path.join(work, "tmp")  # the tests' TMPDIR: never a place the agent could fill
    os.mkdir(tmpdir, 0o700)
    with open(path, "w", encoding="utf-8") as f:
        f.write(cfg["source"])
    ini = os.path.join(work, "pytest.ini")
    with open(ini, "w") as f:
        f.write("[pytest]\n")
    junit = os.path.join(work, "junit.xml")
    stages = os.path.join(work, "stages.json")
    _mark("tmpfs")
    home = cfg["home"]
    why = _usable_dir(home)
    cwd = home if why is None else "/"
    if why:
        notes.append(f"{why}: the tests ran from /")
    libdirs = ":".join(cfg["libdirs"])
    argv = [loader, "--inhibit-cache", "--library-path", libdirs, python, "-I", "-S", "-B", "-c",
            BOOT % {"sitedirs": _sitedirs(pristine, ver), "junit": junit, "stages": stages},
            "-p", "no:cacheprovider", *(a for n in UNUSED_PLUGINS for a in ("-p", "no:" + n)),
            "--rootdir", work, "-c", ini, "--noconftest", "--junitxml", junit, "-q", path]
    env = {"PATH": cfg["path"], "HOME": home, "LANG": "C.UTF-8", "LOCPATH": pristine + "/usr/lib/locale",
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "TMPDIR": tmpdir}

    def child() -> None:
        _limits(cfg)
        drop_privileges()
        os.umask(0o022)
        try:
            os.chdir(cwd)
        except OSError:
            os.chdir("/")

    # From here on code of the agent's may run (programs the tests start) and reach this driver:
    # whatever ends or breaks it is the state's doing (see main)
    send({"stage": "pytest_started"})
    try:
        p = subprocess.Popen(argv, env=env, stdin=devnull, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             close_fds=True, start_new_session=True, preexec_fn=child, cwd="/")
    except OSError as e:
        raise Infra(f"the pristine interpreter could not be started: {e}") from None
    _mark("pytest_spawned")
    tail, limit = b"", int(cfg["tail"])
    deadline = time.monotonic() + float(cfg["timeout"])
    timed_out = False
    fd = p.stdout.fileno()
    while True:
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            timed_out = True
            break
        r, _, _ = select.select([fd], [], [], min(left_s, 1.0))
        if r:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            tail = (tail + chunk)[-limit:]
    _mark("pytest_eof")
    if timed_out:
        kill_all(me)
    rc = p.wait()
    # Output written after EOF was seen is not waited for; a last sweep for what the tests started.
    _, killed_after = kill_all(me)
    report = _read_small(junit, 8 << 20)  # a regular file only: never blocking on a FIFO
    _read_stages(stages)
    _mark("report_read")
    out = tail.decode("utf-8", "replace")
    interp = None
    if rc == 97 and "ET-NO-PYTEST" in out:
        interp = "pytest could not be imported"
    elif rc == 127 and report is None and "error while loading shared libraries" in out:
        interp = "the pristine interpreter could not start"
    if interp is not None:
        control = _pristine_control(cfg, ver, devnull)
        _mark("control")
        return {"kind": "interp", "control": control, "error": interp + ": " + out.strip()[-300:],
                "out": out, "notes": notes, "stages": STAGES}
    return {"kind": "ran", "rc": rc if rc >= 0 else None, "signal": -rc if rc < 0 else None,
            "timed_out": timed_out, "junit": report, "out": out, "killed": 0,
            "killed_after": killed_after, "cwd": cwd, "notes": notes, "stages": STAGES}


def _read_stages(path: str) -> None:
    """The pristine python's own stage times (numbers only; a missing or odd file is ignored)."""
    try:
        got = json.loads(_read_small(path, 4096) or "{}")
        STAGES.update({"py_" + str(k): float(v) for k, v in dict(got).items()})
    except (ValueError, TypeError):
        pass


def _enter(cfg: dict) -> None:
    """Steps 1-2 of the module doc (raises Infra when the instance cannot be entered)."""
    pid = int(cfg["pid"])
    try:
        dfd = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise Infra(f"instance init {pid} is gone ({e.strerror})") from None
    try:
        with open("stat", opener=lambda p, fl: os.open(p, fl, dir_fd=dfd)) as f:
            fields = _stat_fields(f.read())
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
        _check(_libc.setns(fd, flag), f"setns({name})")
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
    _mark("entered")
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _mount("none", "/", None, MS_REC | MS_PRIVATE)
    _mark("private_mounts")


def _read_config() -> bytes:
    """The config on stdin: its byte count on a line, then the bytes (no end of file is awaited)."""
    size = int(sys.stdin.buffer.readline())
    raw = sys.stdin.buffer.read(size)
    if len(raw) != size:
        raise EOFError(f"config cut short ({len(raw)} of {size} bytes)")
    return raw


def main() -> None:
    import resource  # noqa: F401 - needed after entering, when nothing can be imported
    import stat  # noqa: F401
    _mark("imported")
    raw = _read_config()
    _mark("config_read")
    cfg = json.loads(raw)
    marker = cfg["marker"]

    def emit(d: dict) -> None:
        os.write(1, ("\n" + marker + json.dumps(d) + "\n").encode())
        os._exit(0)

    devnull = os.open("/dev/null", os.O_RDWR)  # the host's, opened before entering
    _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # and what it forks, until they exec
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
        emit(_warm(cfg, devnull))
    r, w = os.pipe()
    cpid = os.fork()
    if cpid == 0:
        os.close(r)

        def send(d: dict) -> None:
            data = (json.dumps(d) + "\n").encode()
            while data:
                data = data[os.write(w, data):]

        try:
            send(_run_pytest(cfg, send, devnull))
        except Refused as e:
            send({"kind": "agent", "error": str(e.args[0]), "stage": e.args[1] if len(e.args) > 1 else "view"})
        except Infra as e:
            send({"kind": "infra", "error": str(e.args[0]),
                  "stage": e.args[1] if len(e.args) > 1 else "prepare"})
        except BaseException as e:  # noqa: BLE001 - our bug, or (once the tests started) theirs
            send({"kind": "failed", "error": f"scoring driver failed: {type(e).__name__}: {e}"})
        os._exit(0)
    os.close(w)
    buf = b""
    deadline = time.monotonic() + float(cfg["timeout"]) + 60
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
    msgs = []
    for line in buf.decode("utf-8", "replace").splitlines():
        try:
            msgs.append(json.loads(line))
        except ValueError:
            pass
    final = [m for m in msgs if "kind" in m]
    started = any(m.get("stage") == "pytest_started" for m in msgs)
    if final:
        _mark("driver_done")
        res = final[-1]
        if res["kind"] == "failed":  # an exception in the driver: who could have caused it
            res = {**res, "kind": "disturbed" if started else "infra"}
        res["stages"] = {**res.get("stages", {}), **STAGES}
        emit(res)
    how = (f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
           else f"exit {os.WEXITSTATUS(status)}")
    # once the tests started, programs they run (the agent's) can kill it or lower its rlimits
    emit({"kind": "disturbed" if started else "infra", "stage": "tests" if started else "prepare",
          "error": f"the scoring driver ended ({how}) {'while the tests ran' if started else 'before the tests ran'}"})

if __name__ == "__main__":
    try:
        main()
    except BaseException as e:  # noqa: BLE001
        sys.stdout.write("\nET-ENTER-FAILED " + f"{type(e).__name__}: {e}" + "\n")
        sys.exit(3)
