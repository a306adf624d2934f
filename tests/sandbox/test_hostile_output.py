"""Agent bytes in command output, file names and the argv the shell guard names reach the model
shown, never raw: a real shell (a host bash, and an instance from the SIF) prints hostile bytes,
lists files named with them, and leaves a process holding its command pipe whose argv carries
them; the guard ends it and its note names the argv. Positive controls: the bytes do reach the
output and the note (as escapes of exactly those bytes), and ``raw`` mode of the same shell's
capture holds them before the sanitizer (``escaped`` counts them)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

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
    """What the shell shows for bytes it read: UTF-8 (bad bytes as U+FFFD), then visible."""
    return visible(b.decode("utf-8", "replace"))


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
@given(b=hostile_bytes(max_size=12))
def test_guard_note_names_the_argv_shown(shell: Shell, b: bytes) -> None:
    find_fd = "for fd in {3..30} 255; do [[ -p /dev/fd/$fd ]] && { true <&$fd; } 2>/dev/null && break; done"
    r = shell.run(f'{find_fd}\nv={_printf(b)}; (exec -a "${{v%x}}" sleep 60) <&$fd >/dev/null 2>&1 & echo armed', timeout=30)
    assert "[ended background process" in r.output and shell_guard.HOLDER_NOTE in r.output, r.output  # positive control
    assert not RAW.search(r.output), repr(r.output)
    named = visible((b + b" 60").decode("utf-8", "replace").strip()[:80])  # as the guard reads /proc/PID/cmdline
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
