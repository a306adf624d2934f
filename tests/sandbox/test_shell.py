"""The persistent Shell on a host bash: markers, exit codes, timeouts, restarts, output limits."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from et_hpc.sandbox.shell import Shell, bash_quote
from helpers.hostile import RAW as HIDDEN

BASH = ["bash", "--noprofile", "--norc"]


@pytest.fixture
def sh(tmp_path: Path):
    with Shell(BASH, home=str(tmp_path), env={"ET_TEST": "1"}) as s:
        yield s


def _pids_with(arg: str) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmd = Path(f"/proc/{name}/cmdline").read_bytes()
            except OSError:
                continue
            if arg.encode() in cmd:
                out.append(int(name))
    return out


def _wait_for(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.02)


def test_output_exit_code_and_merged_stderr(sh: Shell, tmp_path: Path) -> None:
    r = sh.run("echo out; echo err >&2; pwd; echo $ET_TEST $HOME")
    assert r.exit_code == 0 and not r.timed_out and not r.shell_restarted
    assert r.output == f"out\nerr\n{tmp_path}\n1 {tmp_path}\n"
    assert sh.run("false").exit_code == 1
    assert sh.run("(exit 42)").exit_code == 42


def test_cd_export_and_variables_persist(sh: Shell) -> None:
    sh.run("cd /tmp && export FOO=bar && x=5")
    assert sh.run("pwd; echo $FOO $x; env | grep ^FOO=").output == "/tmp\nbar 5\nFOO=bar\n"


def test_stdin_readers_do_not_eat_next_commands(sh: Shell) -> None:
    r = sh.run("cat; read -r line; echo got:$line")
    assert r.exit_code == 0 and r.output == "got:\n"
    assert sh.run("echo still-here").output == "still-here\n"


def test_quoting_heredoc_and_unicode(sh: Shell, tmp_path: Path) -> None:
    cmd = "cat > f.txt <<'EOF'\nline 'one' \"two\" $HOME \\n\nEOF\ncat f.txt; echo é☃ $'\\x41'"
    r = sh.run(cmd)
    assert r.exit_code == 0
    assert r.output == "line 'one' \"two\" $HOME \\n\né☃ A\n"
    assert (tmp_path / "f.txt").exists()


def test_syntax_error_keeps_shell(sh: Shell) -> None:
    r = sh.run("echo 'unclosed")
    assert r.exit_code == 2 and "unexpected EOF" in r.output
    assert sh.run("echo ok").output == "ok\n"
    r = sh.run("return 3")
    assert r.exit_code not in (0, None) and not r.shell_restarted


def test_fake_marker_in_output_does_not_end_command(sh: Shell) -> None:
    r = sh.run("printf '\\n__ET_deadbeef:0:\\n__ET_deadbeef.\\n'; sleep 0.2; echo after; exit_code_is() { :; }; false")
    assert "after" in r.output and r.exit_code == 1


def test_background_job_returns_at_once_and_survives_later_timeouts(sh: Shell) -> None:
    tag = f"{secrets.randbelow(10**6)}.5"  # a distinctive duration to find the process by
    r = sh.run(f"sleep {tag} & echo started", timeout=10)
    assert r.exit_code == 0 and r.output == "started\n" and r.duration_s < 5
    _wait_for(lambda: _pids_with(tag))
    t = sh.run("sleep 30", timeout=1)
    assert t.timed_out and t.exit_code is None and not t.shell_restarted
    assert "timed out after 1 s" in t.output
    assert _pids_with(tag), "a background job from an earlier command was killed"
    assert "Running" in sh.run("jobs").output


def test_timeout_kills_whole_command_and_keeps_partial_output(sh: Shell) -> None:
    tag = f"{secrets.randbelow(10**6)}.25"
    r = sh.run(f"echo begin; (sleep {tag}; printf 'n%sr\\n' eve) & sleep {tag} | cat", timeout=1)
    assert r.timed_out and r.exit_code is None
    assert r.output.startswith("begin\n") and "never" not in r.output
    assert not _pids_with(tag), "processes of the timed-out command survived"
    assert sh.run("echo next").output.endswith("next\n")


def test_builtin_busy_loop_times_out_with_restart(sh: Shell, tmp_path: Path) -> None:
    sh.run("cd /")
    r = sh.run("while :; do :; done", timeout=1)
    assert r.timed_out and r.shell_restarted and "new shell" in r.output
    r2 = sh.run("pwd; echo $ET_TEST")
    assert r2.exit_code == 0 and r2.output == f"{tmp_path}\n1\n"


@pytest.mark.parametrize("cmd", ["exit 3", "exec bash", "kill -9 $$", "sleep 100 & exit"])
def test_shell_death_is_reported_and_recovered(sh: Shell, cmd: str) -> None:
    sh.run("export GONE=1")
    r = sh.run(cmd, timeout=20)
    assert r.exit_code is None and r.shell_restarted and "new shell" in r.output
    assert r.duration_s < 10
    r2 = sh.run("echo ${GONE:-reset}")
    assert r2.output == "reset\n" and r2.exit_code == 0


def test_binary_ansi_and_cr_are_shown_as_escapes(sh: Shell) -> None:
    r = sh.run("printf 'a\\r\\033[1;31mred\\033[0m\\x00\\x01b\\302\\2333m\\n'; head -c 2000 /dev/urandom")
    assert r.exit_code == 0
    assert r.output.startswith("a\\x0d\\x1b[1;31mred\\x1b[0m\\x00\\x01b\\x9b3m\n")
    assert r.escaped >= 6
    assert not HIDDEN.search(r.output)


def test_output_is_truncated_head_and_tail(tmp_path: Path) -> None:
    with Shell(BASH, home=str(tmp_path), output_limit=1000) as s:
        r = s.run("seq 1 100000")
        assert r.exit_code == 0 and r.truncated
        assert r.output.startswith("1\n2\n3\n") and r.output.endswith("99999\n100000\n")
        assert "bytes omitted" in r.output
        assert len(r.output) < 1200
        small = s.run("seq 1 10")
        assert not small.truncated and small.output == "\n".join(map(str, range(1, 11))) + "\n"


def test_huge_output_is_bounded(sh: Shell) -> None:
    r = sh.run("yes | head -c 300M", timeout=120)
    assert r.exit_code == 0 and r.truncated
    assert len(r.output) < 51_000
    assert r.output.startswith("y\ny\n")
    assert sh.run("echo fine").output == "fine\n"


def test_late_background_output_is_not_taken_as_completion(sh: Shell) -> None:
    r = sh.run("(sleep 0.3; echo late) & echo early")
    assert r.output == "early\n"
    time.sleep(0.6)
    r2 = sh.run("echo now")
    assert r2.output == "late\nnow\n" and r2.exit_code == 0


def test_close_ends_background_jobs(tmp_path: Path) -> None:
    tag = f"{secrets.randbelow(10**6)}.75"
    s = Shell(BASH, home=str(tmp_path))
    s.start()
    s.run(f"sleep {tag} &")
    _wait_for(lambda: _pids_with(tag))
    s.close()
    deadline = time.monotonic() + 5
    while _pids_with(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _pids_with(tag)


def test_bash_quote_round_trips(sh: Shell, tmp_path: Path) -> None:
    s = 'a\'b\\c\n\t"$x" é \x7f ☃ end'
    r = sh.run(f"printf %s {bash_quote(s)} > q.bin")
    assert r.exit_code == 0
    assert (tmp_path / "q.bin").read_bytes() == s.encode()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(b=b"\xff")
@example(b=b"a\xc3\xa9\xed\xa0\x80\xfe'\\z")
@given(b=st.binary(min_size=1, max_size=24).filter(lambda b: b"\x00" not in b))  # a bash word holds no NUL
def test_bash_quote_gives_back_the_bytes_a_string_came_from(sh: Shell, tmp_path: Path, b: bytes) -> None:
    """A command string decoded from bytes with ``surrogateescape`` (as the shell decodes output)
    reaches bash as those bytes: ``\\udcff`` is the byte 0xff, not its three surrogatepass bytes."""
    s = b.decode("utf-8", "surrogateescape")
    assert "\\xff" in bash_quote("\udcff") and "\\xed" not in bash_quote("\udcff")
    r = sh.run(f"printf %s {bash_quote(s)} > q.bin")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "q.bin").read_bytes() == b
    r = sh.run(f"printf %s '{s.replace(chr(39), '')}' > c.bin")  # the command itself goes through bash_quote
    assert r.exit_code == 0, r.output
    assert (tmp_path / "c.bin").read_bytes() == b.replace(b"'", b"")


def test_bash_quote_keeps_other_lone_surrogates(sh: Shell, tmp_path: Path) -> None:
    """A lone surrogate that no byte became (U+D800) is written as UTF-8 would (surrogatepass)."""
    r = sh.run(f"printf %s {bash_quote('x' + chr(0xD800) + 'y')} > q.bin")
    assert r.exit_code == 0
    assert (tmp_path / "q.bin").read_bytes() == b"x\xed\xa0\x80y"
