"""The one-time preparation of a new instance (``PREPARE_SCRIPT``), on real apptainer.

The task image has a ``user`` account (uid 1000) owning ``/home/user``; apptainer adds the host
account (our uid) to the instance's ``/etc/passwd``. After the first shell, our uid and gid are
``user``'s, the host account's line is gone, every other line is kept, and ``$HOME`` is ours.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from et_hpc.sandbox.sandbox import Sandbox

pytestmark = pytest.mark.apptainer


def _sh(sb: Sandbox, script: str) -> str:
    cp = sb.exec(["bash", "-c", script])
    assert cp.returncode == 0, cp.stdout
    return cp.stdout.decode()


def _lines(text: str) -> list[str]:
    return text.splitlines()


def _id_field(line: str) -> str | None:
    """The third field of a passwd or group line (its uid or gid), None for a shorter line."""
    return (line.split(":")[2:3] or [None])[0]


@pytest.fixture(params=["sif", "unpacked", "sif, no pristine bind"])
def image(request: pytest.FixtureRequest, task_sif: Path) -> tuple[Path, bool]:
    if request.param == "unpacked":
        return request.getfixturevalue("task_tree"), True
    return task_sif, request.param == "sif"


def test_first_shell_names_us_user_and_keeps_the_rest(image: tuple[Path, bool], tmp_path: Path) -> None:
    path, pristine = image
    me, mg = os.getuid(), os.getgid()
    with Sandbox(path, run_prefix="t-prep", scratch=tmp_path, prepare_home=False, pristine=pristine) as sb:
        before_pw = _sh(sb, "cat /etc/passwd")
        before_gr = _sh(sb, "cat /etc/group")
        # positive control: unprepared, we are the host account and `user` has its own ids
        assert _sh(sb, "id -un").strip() != "user"
        assert any(ln.startswith("user:x:1000:") for ln in _lines(before_pw)), before_pw
    with Sandbox(path, run_prefix="t-prep", scratch=tmp_path, pristine=pristine) as sb:
        sh = sb.shell()
        r = sh.run('id -un; id -gn; stat -c \'%u %g\' "$HOME" "$HOME/notes.txt"; cat notes.txt; echo x > new && echo ok')
        assert r.exit_code == 0, r.output
        assert r.output.split("\n")[:6] == ["user", "user", f"{me} {mg}", f"{me} {mg}", "keep me", "ok"], r.output
        pw, gr = _sh(sb, "cat /etc/passwd"), _sh(sb, "cat /etc/group")
    mine = [ln for ln in _lines(pw) if _id_field(ln) == str(me)]
    rest = before_pw.split("\nuser:x:1000:1000:", 1)[1].split("\n", 1)[0]
    assert mine == [f"user:x:{me}:{mg}:{rest}"], pw
    # every other line as it was: only the host account's line (our uid) and user's changed
    kept = [ln for ln in _lines(before_pw) if not ln.startswith("user:") and _id_field(ln) != str(me)]
    assert [ln for ln in _lines(pw) if not ln.startswith("user:")] == kept and pw.endswith("\n")
    assert [ln for ln in _lines(gr) if _id_field(ln) == str(mg)] == [f"user:x:{mg}:"], gr
    kept = [ln for ln in _lines(before_gr) if not ln.startswith("user:") and _id_field(ln) != str(mg)]
    assert [ln for ln in _lines(gr) if not ln.startswith("user:")] == kept


def test_account_with_uid_1000_when_there_is_no_user(task_sif: Path, tmp_path: Path) -> None:
    """No ``user`` account: the one with uid 1000 is ours; a last line without its newline and an
    empty line in between are kept."""
    me = os.getuid()
    with Sandbox(task_sif, run_prefix="t-prep", scratch=tmp_path, prepare_home=False) as sb:
        # (apptainer binds both files into the instance: rewritten in place, not renamed over)
        _sh(
            sb,
            "p=$(sed 's/^user:/dev:/' /etc/passwd) && g=$(sed 's/^user:/dev:/' /etc/group) && "
            "printf '%s\\n\\n%s\\nsvc:x:1234:1234::/srv:/bin/false' \"${p%%$'\\n'*}\" \"${p#*$'\\n'}\" "
            "> /etc/passwd && printf '%s\\n' \"$g\" > /etc/group",
        )
        before = _sh(sb, "cat /etc/passwd")
        assert "\n\n" in before and before.endswith("/bin/false")  # the trap is set
        sb.prepare_home = True  # then prepared as its own exec (what scoring does without a shell)
        sb.prepare()
        after = _sh(sb, "id -un; cat /etc/passwd")
    assert after.startswith("dev\n"), after
    after = after[len("dev\n") :]
    assert "\n\n" in after and after.endswith("svc:x:1234:1234::/srv:/bin/false\n"), after
    assert [ln for ln in _lines(after) if _id_field(ln) == str(me)][0].startswith(f"dev:x:{me}:")
