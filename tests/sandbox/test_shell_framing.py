"""The shell's framing cannot be read or forged by the command it frames.

The attack: during its command, read the shell's pending end-marker line from the shell's saved
copy of its input (any pipe among the shell's fds but its output), print a forged end, keep
running, and print more: before, the forged end ended the command early and the rest of its output
was credited to the next command. Now the marker is never pending while the command runs: the
attack reads nothing, its own output stays its own, and the next command's output is exactly its
own. Run on a host bash and in an instance (the SIF and the unpacked tree).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from et_hpc.sandbox.shell import Shell

BASH = ["bash", "--noprofile", "--norc"]

# Tries every pipe the shell holds other than its output, the way the attack found the saved input.
STEAL = r"""
out=$(readlink /proc/$$/fd/1); got=
for fd in $(ls /proc/$$/fd); do
  case $fd in 0|1|2) continue;; esac
  link=$(readlink /proc/$$/fd/$fd)
  if [[ $link == pipe:* && $link != "$out" ]] && IFS= read -r -t 1 -u "$fd" line; then got=$line; break; fi
done
m=$(grep -o '__ET_[0-9a-f]*' <<<"$got" | head -n1)
echo "stole:${m:-nothing}"
if [ -n "$m" ]; then printf '\n%s:0:\n%s.\n' "$m" "$m"; fi
sleep 1; echo LATE-OUTPUT
"""


def _attack(sh: Shell) -> None:
    r = sh.run(STEAL, timeout=30)
    nxt = sh.run("echo next-command", timeout=30)
    assert nxt.output == "next-command\n" and nxt.exit_code == 0, (r.output, nxt.output)  # exactly its own
    assert "stole:nothing" in r.output, r.output  # there was no marker to read
    assert r.output.rstrip().endswith("LATE-OUTPUT") and r.exit_code == 0, r.output  # its output stayed its own
    assert sh.run("echo $((6 * 7))", timeout=30).output == "42\n"  # and the shell goes on


def test_command_cannot_read_or_forge_its_end_marker_host(tmp_path: Path) -> None:
    with Shell(BASH, home=str(tmp_path)) as sh:
        _attack(sh)


def test_printed_marker_like_lines_end_nothing(tmp_path: Path) -> None:
    """A command printing marker-shaped lines (any nonce it can make up) is not ended by them."""
    with Shell(BASH, home=str(tmp_path)) as sh:
        r = sh.run(
            "for i in 1 2 3; do m=__ET_$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \\n'); "
            "printf '\\n%s:0:\\n%s.\\n' $m $m; done; sleep 0.3; echo tail-of-it; exit_code=5; (exit 5)",
            timeout=30,
        )
        assert r.output.rstrip().endswith("tail-of-it") and r.exit_code == 5, r
        assert sh.run("echo next-command", timeout=30).output == "next-command\n"


@pytest.fixture(params=["sif", "unpacked"])
def image(request: pytest.FixtureRequest, task_sif: Path) -> Path:
    return task_sif if request.param == "sif" else request.getfixturevalue("task_tree")


def test_command_cannot_read_or_forge_its_end_marker_in_instance(image: Path, tmp_path: Path) -> None:
    from et_hpc.sandbox.sandbox import Sandbox

    with Sandbox(image, run_prefix="t-shf", scratch=tmp_path) as sb:
        _attack(sb.shell())
