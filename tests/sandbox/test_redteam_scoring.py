"""Red team, third round: what the loader and libc read, processes left behind, and who is to blame.

Every attack runs on a small task whose final test fails on the untouched state (it wants
``/home/user/answer.txt`` to hold ``42``), against the SIF and the unpacked tree
(``sandbox.local_copy: unpack``). Each first shows the trick takes effect in the sandbox (the
positive control: a normal process loads the planted library, the daemon acts on a new process,
the armed shell writes its file when it closes), then that scoring gives the agent's 0 with the
tests really run (status ok, never 1.0, never an error).
"""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from et_hpc.host import procfs
from et_hpc.sandbox.sandbox import Sandbox
from et_hpc.scoring import live as scoring
from et_hpc.scoring import sweep
from helpers import IN_CI

ARCH = "x86_64-linux-gnu" if os.uname().machine == "x86_64" else "aarch64-linux-gnu"

FINAL_TEST = textwrap.dedent("""\
    import os, pwd, socket
    from pathlib import Path

    OWNER = pwd.getpwuid(os.getuid()).pw_name  # an NSS lookup, as ownership checks do
    try:
        socket.getservbyname("ssh", "tcp")  # Debian's nsswitch.conf: "services: db files"
    except OSError:
        pass

    def test_answer():
        assert Path("/home/user/answer.txt").read_text().strip() == "42"

    def test_notes_untouched():
        assert Path("/home/user/notes.txt").read_text() == "keep me\\n"
    """)

# The answer, written by a library's constructor in any python process that loads it (the
# tests' process is one): the loader runs it whether it came by preload, NSS or a default dir.
FORGE_C = textwrap.dedent("""\
    #include <fcntl.h>
    #include <string.h>
    #include <unistd.h>
    __attribute__((constructor)) static void forge(void) {
        char cmd[4096];
        int fd = open("/proc/self/cmdline", O_RDONLY);
        if (fd < 0) return;
        ssize_t n = read(fd, cmd, sizeof cmd - 1);
        close(fd);
        if (n <= 0 || !memmem(cmd, n, "python", 6)) return;
        fd = open("/home/user/answer.txt", O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) { write(fd, "42\\n", 3); close(fd); }
    }
    """)


def _gcc(d: Path, out: str, src: str, *extra: str) -> Path:
    if not _which("gcc"):
        if IN_CI:
            pytest.fail("gcc is needed to build the planted libraries")
        pytest.skip("gcc is not installed")
    (d / (out + ".c")).write_text(src)
    cp = subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O1", "-D_GNU_SOURCE", "-o", str(d / out), str(d / (out + ".c")), *extra],
        capture_output=True,
        text=True,
    )
    assert cp.returncode == 0, cp.stderr
    return d / out


def _which(name: str) -> str | None:
    import shutil

    return shutil.which(name)


@pytest.fixture(scope="session")
def libs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``forge``: writes the answer from a python process; ``needs_missing``: needs a library
    (``libetmissing.so``) that exists only where it was linked, never in the sandbox."""
    d = tmp_path_factory.mktemp("planted-libs")
    forge = _gcc(d, "forge.so", FORGE_C)
    _gcc(d, "libetmissing.so", "int et_missing(void) { return 1; }\n")
    needs = _gcc(
        d,
        "needs_missing.so",
        "int et_missing(void);\nint et_uses(void) { return et_missing(); }\n",
        f"-L{d}",
        "-letmissing",
        "-Wl,--no-as-needed",
    )
    return {"forge": forge, "needs_missing": needs}


@pytest.fixture(params=["sif", "unpacked"])
def image(request: pytest.FixtureRequest, task_sif: Path) -> Path:
    return task_sif if request.param == "sif" else request.getfixturevalue("task_tree")


@pytest.fixture
def final_test(tmp_path: Path) -> Path:
    p = tmp_path / "test_final_state.py"
    p.write_text(FINAL_TEST)
    return p


def _put(sb: Sandbox, src: Path, dst: str) -> None:
    cp = sb.exec(["sh", "-c", f"cat > {dst} && chmod 755 {dst}"], input=src.read_bytes())
    assert cp.returncode == 0, cp.stdout


def _run(sb: Sandbox, *commands: str, timeout: float = 60) -> list[str]:
    sh = sb.shell()
    outs = []
    for c in commands:
        r = sh.run(c, timeout=timeout)
        assert r.exit_code == 0, (c, r.output)
        outs.append(r.output)
    return outs


def _zero_with_tests_run(res: scoring.ScoreResult, what: str) -> None:
    """The agent's 0 from the tests themselves: both ran, the answer test failed."""
    assert res.status == "ok" and res.reward == 0.0, f"{what}: {res.error} {res.note} {res.output_tail[-800:]}"
    assert res.interpreter == "pristine" and res.total == 2 and res.passed == 1, (what, res.tests, res.note)


def _answer(sb: Sandbox) -> bytes:
    return sb.exec(["sh", "-c", "cat /home/user/answer.txt 2>/dev/null || true"]).stdout.strip()


# -- 1. nothing the loader or libc reads comes from the agent ------------------------------------

LIB = f"/usr/lib/{ARCH}"
OVERSIZED = 'awk \'BEGIN { for (i = 0; i < 70000; i++) printf " "; print "/home/user/.f.so" }\' > /etc/ld.so.preload'
LOADER_ATTACKS = {
    # longer than any read limit: a reader that stops at 64 KiB sees only blanks, the loader reads it whole
    "oversized_preload": ("/home/user/.f.so", OVERSIZED),
    # a token glibc takes as a module name right after an action list (no blank between them)
    "nss_token": (f"{LIB}/libnss_etx.so.2", "sed -i 's/^passwd:.*/passwd: files [SUCCESS=continue]etx/' /etc/nsswitch.conf"),
    # the image's own nsswitch.conf names "db", which the image lacks: a module of that name
    # planted in a default library dir is what a services lookup would load
    "default_dir_module": (f"{LIB}/libnss_db.so.2", "ldconfig 2>/dev/null; true"),
}
CONTROL_PY = "import pwd, socket, os\npwd.getpwuid(os.getuid())\ntry:\n    socket.getservbyname('ssh', 'tcp')\nexcept OSError:\n    pass\n"


@pytest.mark.parametrize("attack", sorted(LOADER_ATTACKS))
def test_loader_and_libc_read_only_the_image(attack: str, image: Path, tmp_path: Path, final_test: Path, libs: dict[str, Path]) -> None:
    dst, command = LOADER_ATTACKS[attack]
    with Sandbox(image, run_prefix="t-rts", scratch=tmp_path) as sb:
        _run(sb, "true")
        _put(sb, libs["forge"], dst)
        _run(sb, command)
        # positive control: a normal python process in the sandbox loads the planted library
        cp = sb.exec(["python3", "-c", CONTROL_PY])
        assert cp.returncode == 0, cp.stdout
        assert _answer(sb) == b"42", f"control: the planted library was not loaded ({cp.stdout!r})"
        sb.exec(["rm", "-f", "/home/user/answer.txt"])
        assert _answer(sb) == b""
        res = scoring.score(sb, final_test, timeout_s=30)
        _zero_with_tests_run(res, attack)
        assert _answer(sb) == b""  # nothing of the tests' process loaded it


def test_unreadable_symlinks_where_the_loader_reads(image: Path, tmp_path: Path, final_test: Path) -> None:
    """Symlinks that open fine but fail on read (``/proc/self/mem``): the tests still run."""
    with Sandbox(image, run_prefix="t-rts", scratch=tmp_path) as sb:
        _run(
            sb,
            "ln -sf /proc/self/mem /etc/ld.so.preload && ln -sf /proc/self/mem /etc/nsswitch.conf "
            "&& ln -sf /proc/self/mem /etc/ld.so.cache",
        )
        cp = sb.exec(["sh", "-c", "cat /etc/ld.so.preload; echo rc=$?"])  # control: opens, then fails
        assert b"Input/output error" in cp.stdout and b"rc=1" in cp.stdout, cp.stdout
        res = scoring.score(sb, final_test, timeout_s=30)
        _zero_with_tests_run(res, "unreadable symlinks")
        # the agent's state is untouched evidence: the links are still there
        assert sb.exec(["readlink", "/etc/ld.so.preload"]).stdout.strip() == b"/proc/self/mem"


def test_preload_with_missing_dependency(image: Path, tmp_path: Path, final_test: Path, libs: dict[str, Path]) -> None:
    """A preloaded library whose dependency is missing stops every program in the sandbox
    (exit 127); the tests' process never reads that preload."""
    with Sandbox(image, run_prefix="t-rts", scratch=tmp_path) as sb:
        _run(sb, "true")
        _put(sb, libs["needs_missing"], "/home/user/.nd.so")
        sb.exec(["sh", "-c", "echo /home/user/.nd.so > /etc/ld.so.preload"])
        cp = sb.exec(["true"])  # control: a normal process cannot start any more
        assert cp.returncode == 127 and b"libetmissing.so" in cp.stdout, (cp.returncode, cp.stdout)
        res = scoring.score(sb, final_test, timeout_s=30)
        _zero_with_tests_run(res, "preload with a missing dependency")


ETC_TEST = textwrap.dedent("""\
    import pwd, subprocess
    from pathlib import Path

    def test_config_written():
        assert Path("/etc/myapp/app.conf").read_text() == "port=8080\\n"
        assert "myapp" in Path("/etc/motd").read_text()

    def test_tool_installed():
        out = subprocess.run(["/usr/local/bin/greet"], capture_output=True, text=True, timeout=20)
        assert out.stdout.strip() == "hello from greet"

    def test_runtime_files_are_the_agents_data_elsewhere():
        assert Path("/etc/ld.so.preload.d-notes").read_text() == "mine\\n"
    """)


def test_tests_still_read_the_agents_etc(image: Path, tmp_path: Path) -> None:
    """Files the agent wrote in /etc and /usr are the tests' data: an honest solution scores 1.0."""
    t = tmp_path / "test_final_state.py"
    t.write_text(ETC_TEST)
    with Sandbox(image, run_prefix="t-rts", scratch=tmp_path) as sb:
        _run(
            sb,
            "mkdir -p /etc/myapp && echo port=8080 > /etc/myapp/app.conf && echo 'welcome to myapp' > /etc/motd",
            "printf '#!/bin/sh\\necho hello from greet\\n' > /usr/local/bin/greet && chmod +x /usr/local/bin/greet",
            "echo mine > /etc/ld.so.preload.d-notes",
        )
        res = scoring.score(sb, t, timeout_s=30)
        assert res.status == "ok" and res.reward == 1.0 and res.total == 3, (res.tests, res.note, res.output_tail[-800:])
        t.write_text(ETC_TEST.replace("port=8080", "port=9090"))  # the same tests can fail
        res = scoring.score(sb, t, timeout_s=30)
        assert res.status == "ok" and res.reward == 0.0 and res.passed == 2, res.tests


# -- 2. no process of the agent's is alive when scoring enters -----------------------------------

# Watches /proc for new processes (the scoring driver is one) and acts on each: SIGKILL, lower its
# rlimits, or SIGTERM init. A process whose command line names ET-PROBE is the control's.
WATCHER = r"""
import os, resource, signal, sys, time
mode = sys.argv[1]
seen, pending = set(os.listdir("/proc")), {}
open("/tmp/.watching", "w").close()
while True:
    now = time.monotonic()
    for n in os.listdir("/proc"):
        if n.isdigit() and n not in seen:
            seen.add(n)
            pending[n] = now + 2  # its command line may change when it execs: looked at for 2 s
    for n, until in list(pending.items()):
        if now > until:
            del pending[n]
            continue
        try:
            cmd = open("/proc/%s/cmdline" % n, "rb").read()
        except OSError:
            del pending[n]
            continue
        probe = b"ET-PROBE" in cmd
        if not probe and b"-I\0-S\0-B\0" not in cmd:  # the control's probe, or a python started as scoring's are
            continue
        del pending[n]
        try:
            if mode == "kill":
                os.kill(int(n), signal.SIGKILL)
            elif mode == "prlimit":
                resource.prlimit(int(n), resource.RLIMIT_NOFILE, (3, 3))
                resource.prlimit(int(n), resource.RLIMIT_AS, (1 << 20, 1 << 20))
            else:
                os.kill(1, 0 if probe else signal.SIGTERM)
            if probe:
                open("/tmp/.acted", "w").close()
        except OSError:
            pass
    time.sleep(0.002)
"""
IDLE = 200  # idle processes left behind, each one more for an in-namespace kill sweep


@pytest.mark.parametrize("mode", ["kill", "prlimit", "term_init"])
def test_daemons_watching_for_scoring(mode: str, image: Path, tmp_path: Path, final_test: Path) -> None:
    with Sandbox(image, run_prefix="t-rts", scratch=tmp_path, nproc=2048) as sb:
        sb.exec(["sh", "-c", "cat > /tmp/.watch.py"], input=WATCHER.encode())
        _run(
            sb,
            f"for i in $(seq {IDLE}); do setsid sleep 1000 >/dev/null 2>&1 < /dev/null & done; "
            f"setsid python3 /tmp/.watch.py {mode} >/dev/null 2>&1 < /dev/null & "
            "for i in $(seq 100); do [ -e /tmp/.watching ] && break; sleep 0.05; done; test -e /tmp/.watching",
        )
        pid, _start = sb.init_process()
        assert len(sweep.members(pid)) >= IDLE + 1
        # positive control: a process that appears in the instance is acted on at once
        cp = sb.exec(["sh", "-c", "sleep 1; exec 3</etc/hostname && echo opened", "ET-PROBE"], timeout=30)
        assert sb.exec(["test", "-e", "/tmp/.acted"]).returncode == 0, cp.stdout
        if mode == "kill":
            assert cp.returncode in (-9, 137) and b"opened" not in cp.stdout, (cp.returncode, cp.stdout)
        elif mode == "prlimit":
            assert b"opened" not in cp.stdout, cp.stdout
        res = scoring.score(sb, final_test, timeout_s=30)
        _zero_with_tests_run(res, mode)
        assert res.killed_processes >= IDLE + 1, res.killed_processes
        assert sb.health() == "alive"


ARM = (
    "trap 'echo 42 > {trap}' EXIT; "
    "(setsid sh -c 'while kill -0 '$$' 2>/dev/null; do sleep 0.02; done; echo 42 > {daemon}' "
    ">/dev/null 2>&1 < /dev/null &); "
    "exec 7> >(unshare -Urpf --mount-proc sh -c 'cat >/dev/null; echo 42 > {nested}' >/dev/null 2>&1)"
)


def test_daemons_armed_on_the_shells_exit(image: Path, tmp_path: Path, final_test: Path) -> None:
    """A trap, a watcher of the shell's pid and a process in a nested PID namespace, each writing
    the answer when the agent's shell ends: the shell is closed only after all were killed."""
    with Sandbox(image, run_prefix="t-rts", scratch=tmp_path) as sb:
        control, attack = sb.shell(), sb.shell()
        ctl = ARM.format(trap="/tmp/ctl-trap", daemon="/tmp/ctl-daemon", nested="/tmp/ctl-nested")
        assert control.run(ctl, timeout=20).exit_code == 0
        ans = "/home/user/answer.txt"
        assert attack.run(ARM.format(trap=ans, daemon=ans, nested=ans) + "; sleep 0.3", timeout=20).exit_code == 0
        pid, _ = sb.init_process()
        # the nested namespace is real: the process is not in the instance's own PID namespace
        nested = [p for p in sweep.members(pid) if len(_nspids(p)) > len(_nspids(pid))]
        assert nested and not set(nested) & set(procfs.ns_members(procfs.pid_ns(pid) or "")), nested
        # positive control: closing a shell (what scoring did first) sets off all three
        control.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            got = sb.exec(["sh", "-c", "cat /tmp/ctl-trap /tmp/ctl-daemon /tmp/ctl-nested 2>/dev/null"]).stdout
            if got.split() == [b"42"] * 3:
                break
            time.sleep(0.1)
        assert got.split() == [b"42"] * 3, got
        res = scoring.score(sb, final_test, timeout_s=30)
        _zero_with_tests_run(res, "armed on exit")
        time.sleep(0.5)  # nothing fires later either: every one of them is dead
        assert _answer(sb) == b""


def _nspids(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((ln.split()[1:] for ln in f if ln.startswith("NSpid:")), [])
    except OSError:
        return []


# -- init ending after the agent's last turn -------------------------------------------------------

SOLVE_TEST = textwrap.dedent("""\
    import subprocess
    from pathlib import Path

    def test_program():
        out = subprocess.run(["/home/user/solve.sh"], capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == "42"

    def test_answer():
        assert Path("/home/user/answer.txt").read_text().strip() == "42"
    """)


@pytest.mark.parametrize("when", ["before_scoring", "during_tests"])
def test_init_ending_after_the_last_turn(when: str, image: Path, tmp_path: Path) -> None:
    t = tmp_path / "test_final_state.py"
    t.write_text(SOLVE_TEST)
    with Sandbox(image, run_prefix="t-rts", scratch=tmp_path) as sb:
        _run(sb, "printf '#!/bin/sh\\nkill -TERM 1\\nsleep 20\\necho 42\\n' > /home/user/solve.sh && chmod +x /home/user/solve.sh")
        pid, _ = sb.init_process()
        if when == "before_scoring":
            os.kill(pid, signal.SIGTERM)  # what the agent's `kill -TERM 1` sends it
            deadline = time.monotonic() + 10
            while sb.health() != "gone" and time.monotonic() < deadline:
                time.sleep(0.05)
        res = scoring.score(sb, t, timeout_s=30)
        assert sb.health() == "gone"  # the instance really ended
        assert res.status == "ok" and res.reward == 0.0 and res.note == scoring.GONE_NOTE, res


def test_a_process_found_at_entry_is_the_agents_zero(
    task_sif: Path, tmp_path: Path, final_test: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The entry's own check, behind the host's sweep: with the sweep made to do nothing (as if a
    process escaped it), what the driver finds in the instance ends the episode as the agent's 0."""
    with Sandbox(task_sif, run_prefix="t-rts", scratch=tmp_path) as sb:
        # setsid's child leaves the shell's session only once it ran: wait for that, or closing the
        # shell (its session is killed) can end it first under load and nothing is left to find
        _run(
            sb,
            "setsid sleep 1000 >/dev/null 2>&1 < /dev/null & echo 42 > /home/user/answer.txt; "
            "for i in $(seq 100); do for s in /proc/[0-9]*/stat; do read -r p c x y g sid r < $s 2>/dev/null; "
            '[ "$c" = "(sleep)" ] && [ "$sid" = "$p" ] && break 3; done; sleep 0.1; done',
        )
        monkeypatch.setattr(sweep, "sweep", lambda *a, **k: sweep.SweepResult())
        res = scoring.score(sb, final_test, timeout_s=30)
        assert res.status == "ok" and res.reward == 0.0, res  # a pass otherwise: the answer is right
        assert "outlived the sweep" in (res.note or ""), res.note
        monkeypatch.undo()
        res = scoring.score(sb, final_test, timeout_s=30)  # the control: nothing left now, it passes
        assert res.status == "ok" and res.reward == 1.0, (res.note, res.output_tail[-500:])
