"""Agent bytes in command output, file names and the argv the shell guard names reach the model
shown, never raw: a real shell (a host bash, and an instance from the SIF) prints hostile bytes,
lists files named with them, and leaves a process holding its command pipe whose argv carries
them; the guard ends it and its note names the argv. Positive controls: the bytes do reach the
output and the note (as escapes of exactly those bytes), and ``raw`` mode of the same shell's
capture holds them before the sanitizer (``escaped`` counts them)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from et_hpc.sandbox import shell_guard
from et_hpc.sandbox.shell import Shell
from et_hpc.text import visible
from helpers.hostile import RAW, hostile_bytes

BASH = ["bash", "--noprofile", "--norc"]
FEW = settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _printf(b: bytes) -> str:
    """A bash word that expands to exactly ``b`` (printf octal escapes)."""
    return "\"$(printf '%b' '" + "".join(f"\\0{c:03o}" for c in b) + "x')\""


@pytest.fixture(params=["host", pytest.param("sif", marks=pytest.mark.apptainer)])
def shell(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shell]:
    home = tmp_path_factory.mktemp("home")
    if request.param == "host":
        with Shell(BASH, home=str(home)) as sh:
            yield sh
        return
    from et_hpc.sandbox.sandbox import Sandbox

    image = request.getfixturevalue("task_sif")
    with Sandbox(image, run_prefix="t-hst", scratch=home) as sb:
        yield sb.shell()


def _expect(b: bytes) -> str:
    """What the shell shows for bytes it read: UTF-8 (bad bytes as lone surrogates), then visible."""
    return visible(b.decode("utf-8", "surrogateescape"))


@FEW
@given(b=hostile_bytes(max_size=12))
def test_output_and_file_names_are_shown(shell: Shell, b: bytes) -> None:
    r = shell.run(f'v={_printf(b)}; printf \'%s\' "${{v%x}}"; echo; cd "$(mktemp -d)" && touch -- "${{v%x}}" && ls', timeout=30)
    assert r.exit_code == 0, r.output
    assert not RAW.search(r.output), repr(r.output)
    shown = _expect(b)
    assert r.output.startswith(shown + "\n"), (repr(r.output), shown)  # positive control: the bytes got there
    assert r.escaped >= 1


@FEW
@example(b=b"ok \xff\xfe \xc3( \xe2\x82 \xed\xa0\x80 \x1b[2J\xc2\x9b\x00end")
@given(b=st.binary(min_size=1, max_size=24))
def test_any_output_bytes_stay_bytes(shell: Shell, b: bytes) -> None:
    """Any bytes the agent prints: the observation is valid text (no raw control, no lone surrogate:
    it goes to the model as JSON), each byte that is not UTF-8 is there as its ``\\udcHH`` escape
    and counted. Positive control: ``od`` of the same output in the shell shows the raw bytes."""
    out = "printf '%b' '" + "".join(f"\\0{c:03o}" for c in b) + "'"
    r = shell.run(f"{out}; printf '\\n@od@\\n'; {out} | od -An -v -tx1", timeout=30)
    assert r.exit_code == 0, r.output
    assert not RAW.search(r.output), repr(r.output)
    json.dumps({"content": r.output}, ensure_ascii=False).encode("utf-8")  # sendable as it is
    shown, _, od = r.output.rpartition("\n@od@\n")
    assert od.split() == [f"{c:02x}" for c in b], (od, b)  # positive control: the raw bytes were emitted
    assert shown == _expect(b), (shown, b)
    invalid = [c for c in b.decode("utf-8", "surrogateescape") if "\udc80" <= c <= "\udcff"]
    for c in invalid:  # each byte that is not UTF-8, as its escape (not U+FFFD)
        assert f"\\udc{ord(c) - 0xDC00:02x}" in shown, (shown, b)
    assert "\ufffd" not in shown or "\ufffd".encode() in b
    assert r.escaped >= len(invalid) + sum(1 for c in b if c < 0x20 and c not in (9, 10) or c == 0x7F)


@FEW
@given(b=hostile_bytes(max_size=12))
def test_guard_note_names_the_argv_shown(shell: Shell, b: bytes) -> None:
    find_fd = "for fd in {3..30} 255; do [[ -p /dev/fd/$fd ]] && { true <&$fd; } 2>/dev/null && break; done"
    r = shell.run(f'{find_fd}\nv={_printf(b)}; (exec -a "${{v%x}}" sleep 60) <&$fd >/dev/null 2>&1 & echo armed', timeout=30)
    assert "[ended background process" in r.output and shell_guard.HOLDER_NOTE in r.output, r.output  # positive control
    assert not RAW.search(r.output), repr(r.output)
    named = visible((b + b" 60").decode("utf-8", "surrogateescape").strip()[:80])  # as the guard reads /proc/PID/cmdline
    assert f"({named})" in r.output, (r.output, named)  # positive control: the agent's argv reached the note


@pytest.mark.apptainer
@pytest.mark.parametrize("b", [b"m\x1b]0;pwned\x07\x1b[2J\xc2\x9b31m\xff"], ids=["osc-csi-c1-bad-utf8"])
def test_watchdog_note_names_the_mount_point_shown(task_sif: Path, tmp_path: Path, b: bytes) -> None:
    """A tmpfs in a nested mount namespace, mounted at a directory named with hostile bytes and
    filled past the ceiling: the watchdog's line names the mount point (raw in its own ``events``:
    the positive control), the command's result shows it escaped."""
    from et_hpc.sandbox.sandbox import Sandbox
    from et_hpc.sandbox.watchdog import Watchdog

    with Sandbox(task_sif, run_prefix="t-hwd", scratch=tmp_path) as sb:
        sh = sb.shell()
        assert sb.wait_warmup()
        mount = 'unshare -rm sh -c \'mount -t tmpfs t "$d" && head -c 400M /dev/zero > "$d/f" && sleep 60\''
        fill = f'v={_printf(b)}; d="/tmp/${{v%x}}"; mkdir -p "$d"; export d; {mount}'
        with Watchdog(sb, protect=lambda: {sh.host_pid}, on_event=sh.add_note, memory_mb=250) as wd:
            r = sh.run(fill, timeout=60)
        assert "the sandbox's processes were killed" in r.output, r.output
    mount_point = "/tmp/" + b.decode("utf-8", "surrogateescape")
    assert mount_point in wd.events[0], wd.events  # positive control: the agent's bytes reach the note raw
    assert RAW.search(wd.events[0])
    assert visible(mount_point) in r.output, r.output  # the same note, shown
    assert not RAW.search(r.output), repr(r.output)
