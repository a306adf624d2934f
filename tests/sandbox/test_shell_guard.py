"""Nothing a command leaves behind can read the shell's next command line, nor forge its end.

Each attack first runs against a shell with the guard off (``Shell(guard=False)``: a plain,
dumpable bash fed the same way), where it takes effect: it stops the idle shell, reads the next
command's line with its end marker, prints a forged end and a forged output, and the next command's
result is the forged one. Then the same attack against the guarded shell: it is ended at the
command boundary (a fork that never exec'd, or a holder of the command pipe) or denied by the
kernel (``/proc/SHELL/fd``, ``/proc/SHELL/mem``, ``ptrace``: the shell is non-dumpable), and the next
command's output is exactly its own. On a host bash, and in an instance from the SIF and the
unpacked tree.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from et_hpc.sandbox import shell_guard
from et_hpc.sandbox.shell import Shell, ShellDied

BASH = ["bash", "--noprofile", "--norc"]
NEXT = "echo next-command"

# Prints the end of the command whose line is in $line, after a forged output of its own.
FORGE = (
    'forge() { local m; m=$(grep -o \'__ET_[0-9a-f]*\' <<<"$1" | head -n1); [ -n "$m" ] && printf \'FORGED\\n%s:0:\\n%s.\\n\' "$m" "$m"; }'
)
# The shell's saved copy of its input: a pipe at a high fd while the command runs.
FIND_FD = "for fd in {3..30} 255; do [[ -p /dev/fd/$fd ]] && { true <&$fd; } 2>/dev/null && break; done"

# A background subshell (a fork of the shell that never execs) waits until the shell is idle,
# stops it, and reads the next line from the saved copy.
SUBSHELL = (
    FORGE
    + "\n"
    + FIND_FD
    + """
S=$$; ( sleep 3; kill -STOP $S; IFS= read -r -u $fd line; forge "$line"; kill -CONT $S ) 2>/dev/null &
echo armed"""
)

# The same from a grandchild forked by a subshell that ends a moment after the command ends.
RELAY = (
    FORGE
    + "\n"
    + FIND_FD
    + """
S=$$; ( sleep 0.3; ( sleep 3; kill -STOP $S; IFS= read -r -u $fd line; forge "$line"; kill -CONT $S ) & ) 2>/dev/null &
echo armed"""
)

# The same from a program (dumpable) given a copy of the saved input by a redirection.
PROGRAM = (
    FIND_FD
    + """
bash -c '"""
    + FORGE.replace("'", "'\\''")
    + """
sleep 3; kill -STOP $1; IFS= read -r line; forge "$line"; kill -CONT $1' _ $$ <&$fd 2>/dev/null &
echo armed"""
)

# A program that opens the shell's input again through /proc (same uid).
REOPEN = (
    """rm -f ~/.r; bash -c '"""
    + FORGE.replace("'", "'\\''")
    + """
out=$(readlink /proc/$1/fd/1)
for f in /proc/$1/fd/*; do l=$(readlink $f) || continue
  if [[ $l == pipe:* && $l != "$out" ]] && exec 3<$f; then echo opened >~/.r; break; fi; done
[ -s ~/.r ] || { ls /proc/$1/fd >~/.r 2>&1; exit; }
sleep 2; kill -STOP $1; IFS= read -r line <&3; forge "$line"; kill -CONT $1' _ $$ &
until [ -s ~/.r ]; do sleep 0.05; done; cat ~/.r"""
)

# Reads the shell's memory for end markers, and attaches to it with ptrace.
MEMORY = r"""python3 - $$ <<'EOF'
import ctypes, os, re, sys
pid = int(sys.argv[1])
try:
    found = set()
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for line in maps:
            span, perms = line.split()[:2]
            if perms.startswith("rw"):
                a, b = (int(x, 16) for x in span.split("-"))
                try:
                    mem.seek(a)
                    found |= set(re.findall(rb"__ET_[0-9a-f]{24}", mem.read(b - a)))
                except OSError:
                    pass
    print("mem: markers", len(found))
except OSError as e:
    print("mem: denied", e.errno)
libc = ctypes.CDLL(None, use_errno=True)
if libc.ptrace(16, pid, 0, 0) == 0:
    os.waitpid(pid, 0x40000000)
    libc.ptrace(17, pid, 0, 0)
    print("ptrace: attached")
else:
    print("ptrace: denied", ctypes.get_errno())
EOF"""


def _state(pid: int) -> str:
    data = Path(f"/proc/{pid}/stat").read_bytes()
    return data[data.rfind(b")") + 2 :].split()[0].decode()


def _wait_stopped(pid: int | None) -> None:
    assert pid is not None
    deadline = time.monotonic() + 30
    while _state(pid) != "T" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _state(pid) == "T", "the attack never stopped the shell"


MakeShell = Callable[[bool], Shell]


@pytest.fixture(params=["host", "sif", "unpacked"])
def make_shell(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MakeShell]:
    if request.param == "host":
        shells: list[Shell] = []

        def host(guard: bool) -> Shell:
            sh = Shell(BASH, home=str(tmp_path), guard=guard)
            sh.start()
            shells.append(sh)
            return sh

        yield host
        for sh in shells:
            sh.close()
        return
    from et_hpc.sandbox.sandbox import Sandbox

    image = request.getfixturevalue("task_sif" if request.param == "sif" else "task_tree")
    with Sandbox(image, run_prefix="t-shg", scratch=tmp_path) as sb:
        yield lambda guard: sb.shell(guard=guard)


@pytest.mark.parametrize("attack", [SUBSHELL, RELAY, PROGRAM], ids=["subshell", "relay", "program"])
def test_saved_input_cannot_be_read_by_what_a_command_leaves(make_shell: MakeShell, attack: str) -> None:
    control = make_shell(False)
    assert "armed" in control.run(attack, timeout=30).output
    _wait_stopped(control.host_pid)
    forged = control.run(NEXT, timeout=30)
    assert "FORGED" in forged.output and "next-command" not in forged.output, forged  # the trick works
    control.close()

    sh = make_shell(True)
    r = sh.run(attack, timeout=30)
    assert r.output.startswith("armed\n") and "[ended background process" in r.output, r.output
    why = shell_guard.HOLDER_NOTE if attack is PROGRAM else shell_guard.BACKGROUND_NOTE
    assert why in r.output, r.output
    nxt = sh.run(NEXT, timeout=30)
    assert nxt.output == "next-command\n" and nxt.exit_code == 0, nxt  # exactly its own
    assert sh.run("echo $((6 * 7))", timeout=30).output == "42\n"


def test_shell_input_cannot_be_opened_again_through_proc(make_shell: MakeShell) -> None:
    control = make_shell(False)
    assert control.run(REOPEN, timeout=30).output == "opened\n"
    _wait_stopped(control.host_pid)
    forged = control.run(NEXT, timeout=30)
    assert "FORGED" in forged.output and "next-command" not in forged.output, forged
    control.close()

    sh = make_shell(True)
    r = sh.run(REOPEN, timeout=30)
    assert "Permission denied" in r.output and "opened" not in r.output, r.output
    assert sh.run(NEXT, timeout=30).output == "next-command\n"


def test_shell_memory_and_ptrace_are_out_of_reach(make_shell: MakeShell) -> None:
    control = make_shell(False)
    out = control.run(MEMORY, timeout=60).output
    assert "ptrace: attached" in out and "mem: markers" in out and "mem: markers 0" not in out, out
    control.close()

    sh = make_shell(True)
    out = sh.run(MEMORY, timeout=60).output
    assert "mem: denied 13" in out and "ptrace: denied 1" in out, out  # EACCES, EPERM
    assert sh.run(NEXT, timeout=30).output == "next-command\n"


def test_background_programs_survive_and_shell_code_jobs_end(make_shell: MakeShell) -> None:
    sh = make_shell(True)
    r = sh.run(
        "sleep 100 & echo $! >~/.a; nohup sleep 200 >/dev/null 2>&1 & echo $! >~/.b; "
        "(while :; do sleep 1; done) & echo $! >~/.c; (sleep 300 & echo $! >~/.d); echo started",
        timeout=30,
    )
    assert r.output.startswith("started\n"), r.output
    assert r.output.count("[ended background process") == 1 and shell_guard.BACKGROUND_NOTE in r.output
    nxt = sh.run("for f in a b c d; do kill -0 $(cat ~/.$f) 2>/dev/null && echo $f alive || echo $f gone; done", timeout=30)
    assert nxt.output == "a alive\nb alive\nc gone\nd alive\n", nxt  # and nothing else (no job report)


def test_a_job_and_the_forks_it_makes_are_one_note(make_shell: MakeShell) -> None:
    """A shell-code job that forks all the time (a pipeline of builtins never execs) is caught
    with forks of its own in flight: all of them end, and the model reads one note for the job."""
    sh = make_shell(True)
    r = sh.run("(while :; do : | : | :; done) & echo $! >~/.c; echo started", timeout=30)
    assert r.output.startswith("started\n"), r.output
    assert r.output.count("[ended background process") == 1, r.output
    assert r.output.count(shell_guard.BACKGROUND_NOTE) == 1, r.output
    assert sh.run("kill -0 $(cat ~/.c) 2>/dev/null && echo alive || echo gone", timeout=30).output == "gone\n"


def test_guard_off_leaves_shell_code_jobs_running(make_shell: MakeShell) -> None:
    """The positive control of the test above: without the guard the subshell is not ended."""
    sh = make_shell(False)
    r = sh.run("(while :; do sleep 1; done) & echo $! >~/.c; echo started", timeout=30)
    assert r.output == "started\n"
    assert sh.run("kill -0 $(cat ~/.c) && echo alive; kill $(cat ~/.c)", timeout=30).output.startswith("alive")


def test_a_shell_that_cannot_be_made_private_does_not_start(tmp_path: Path) -> None:
    """With no working ``chmod`` the copy stays readable: the shell is refused, never used."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "chmod").write_text("#!/bin/sh\nexit 0\n")
    (fake / "chmod").chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "HOME": str(tmp_path)}
    with Shell(BASH, home=str(tmp_path), popen_env=env, guard=False) as control:
        assert control.run("echo ok").output == "ok\n"  # the environment itself runs a shell
    with pytest.raises(ShellDied, match="could not be made private"):
        Shell(BASH, home=str(tmp_path), popen_env=env).start()


def test_agent_that_breaks_the_copy_ends_its_shell_as_its_own_doing(task_sif: Path, tmp_path: Path) -> None:
    from et_hpc.sandbox.sandbox import Sandbox

    with Sandbox(task_sif, run_prefix="t-shg", scratch=tmp_path) as sb:
        sh = sb.shell()
        r = sh.run("printf '#!/bin/sh\\nexit 0\\n' >/usr/bin/chmod; exit", timeout=30)
        assert "could not be made private" in r.output and r.shell_restarted, r
        with pytest.raises(ShellDied, match="could not be made private"):
            sh.run("echo hi", timeout=30)
        assert sb.health() == "alive"  # decided the agent's doing (shell_broken, status ok)
