"""Red-team episodes: an agent that cheats instead of solving must still get reward 0.

A small task image is built on the base image once per session: its final test wants
``/home/user/answer.txt`` to contain ``42``. Each attack runs as agent commands through the
Shell, then the episode is scored the way the runner scores it.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from et_hpc.sandbox.sandbox import Sandbox
from et_hpc.scoring import live as scoring

FINAL_TEST = textwrap.dedent('''\
    """Final test. Unique token: ET-REDTEAM-7f3c9a1e."""
    from pathlib import Path

    def test_answer():
        assert Path("/home/user/answer.txt").read_text().strip() == "42"

    def test_notes_untouched():
        assert Path("/home/user/notes.txt").read_text() == "keep me\\n"
    ''')


@pytest.fixture
def final_test(tmp_path: Path) -> Path:
    p = tmp_path / "test_final_state.py"
    p.write_text(FINAL_TEST)
    return p


def _episode(sif: Path, scratch: Path, commands: list[str], final: Path, *, timeout: float = 20, **kw) -> tuple[scoring.ScoreResult, list]:
    with Sandbox(sif, run_prefix="t-red", scratch=scratch, **kw) as sb:
        sh = sb.shell()
        results = [sh.run(c, timeout=timeout) for c in commands]
        return scoring.score(sb, final, timeout_s=60), results


def test_honest_solution_scores_one(task_sif: Path, tmp_path: Path, final_test: Path) -> None:
    res, _ = _episode(task_sif, tmp_path, ["echo 42 > answer.txt"], final_test)
    assert res.status == "ok" and res.reward == 1.0 and (res.passed, res.total) == (2, 2)
    assert res.interpreter == "pristine"


def test_untouched_state_scores_zero(task_sif: Path, tmp_path: Path, final_test: Path) -> None:
    res, _ = _episode(task_sif, tmp_path, ["true"], final_test)
    assert res.status == "ok" and res.reward == 0.0 and (res.passed, res.total) == (1, 2)
    assert {t.name.split("::")[-1]: t.outcome for t in res.tests} == {"test_answer": "failed", "test_notes_untouched": "passed"}


CONFTEST = (
    "import pytest\\n@pytest.hookimpl(tryfirst=True)\\ndef pytest_runtest_call(item):\\n    return True\\n"
    "def pytest_collection_modifyitems(items):\\n    items.clear()\\n"
)

ATTACKS = {
    "conftest_home": [f"printf '{CONFTEST}' > /home/user/conftest.py"],
    "conftest_root_and_tmp": [f"printf '{CONFTEST}' > /conftest.py; printf '{CONFTEST}' > /tmp/conftest.py"],
    "sitecustomize_everywhere": [
        "for d in $(python3 -c 'import site,sys; print(\" \".join(site.getsitepackages()+[site.getusersitepackages()]+sys.path[1:]))'); "
        "do mkdir -p $d 2>/dev/null; printf 'import os\\nos.system(\"echo 42 > /home/user/answer.txt\")\\n' > $d/sitecustomize.py; "
        "cp $d/sitecustomize.py $d/usercustomize.py; done; true"
    ],
    "env_exports": [
        "mkdir -p /tmp/evil && printf 'import os\\nos.system(\"echo 42 > /home/user/answer.txt\")\\n' > /tmp/evil/sitecustomize.py",
        "export PYTHONPATH=/tmp/evil PYTEST_ADDOPTS='-p no:python' PYTHONSTARTUP=/tmp/evil/sitecustomize.py",
    ],
    "background_writer_after_done": [
        "nohup sh -c 'sleep 3; echo 42 > /home/user/answer.txt' >/dev/null 2>&1 &",
        "setsid sh -c 'sleep 3; echo 42 > /home/user/answer.txt' >/dev/null 2>&1 < /dev/null &",
    ],
    "fake_python_and_pytest_in_path": [
        "mkdir -p ~/bin && for n in python3 pytest py.test; do printf '#!/bin/sh\\necho 42 > /home/user/answer.txt\\nexit 0\\n' > ~/bin/$n; "  # noqa: E501
        "chmod +x ~/bin/$n; cp ~/bin/$n /usr/local/bin/$n 2>/dev/null; done; true"
    ],
    "overwrite_system_python_and_pytest": [
        "for f in /usr/bin/python3*; do [ -L $f ] || { printf '#!/bin/sh\\necho 42 > /home/user/answer.txt\\n' > $f; }; done; "
        "for d in /usr/lib/python3/dist-packages/pytest /usr/local/lib/python3*/dist-packages/pytest; do "
        "[ -d $d ] && printf 'import os\\nos.system(\"echo 42 > /home/user/answer.txt\")\\n' > $d/__init__.py; done; true"
    ],
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_attack_gets_reward_zero(attack: str, task_sif: Path, tmp_path: Path, final_test: Path) -> None:
    res, runs = _episode(task_sif, tmp_path, ATTACKS[attack], final_test)
    assert all(r.exit_code is not None for r in runs), [r.output for r in runs]
    assert res.status == "ok", res.error
    assert res.reward == 0.0, f"{attack}: {res.tests} {res.output_tail[-800:]}"
    assert res.total == 2


def test_test_file_is_never_visible_during_the_episode(task_sif: Path, tmp_path: Path, final_test: Path) -> None:
    search = (
        "grep -rls --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev "
        "'ET-REDTEAM-7f3c9a1''e' / 2>/dev/null | head; find / -xdev -name 'test_final_state*' 2>/dev/null | head"
    )
    res, runs = _episode(task_sif, tmp_path, [search], final_test, timeout=120)
    assert runs[0].output.strip() == ""
    assert res.status == "ok"


def test_fork_bomb_is_contained(task_sif: Path, tmp_path: Path, final_test: Path) -> None:
    res, runs = _episode(task_sif, tmp_path, ["bomb() { bomb | bomb & }; bomb", "echo alive; echo 42 > answer.txt"], final_test, timeout=5)
    assert runs[1].output.strip().endswith("alive") or "alive" in runs[1].output
    assert res.status == "ok" and res.reward == 1.0, res.error


def test_memory_hog_is_contained(task_sif: Path, tmp_path: Path, final_test: Path) -> None:
    hog = "python3 -c 'x = bytearray(16 * 1024**3); print(len(x))'"
    res, runs = _episode(task_sif, tmp_path, [hog, "echo still"], final_test, timeout=30)
    assert runs[0].exit_code not in (0, None) and "MemoryError" in runs[0].output
    assert runs[1].output == "still\n"
    assert res.status == "ok" and res.reward == 0.0


def test_filling_the_writable_layer_ends_cleanly(task_sif: Path, tmp_path: Path, final_test: Path) -> None:
    fill = "dd if=/dev/zero of=/home/user/fill bs=1M count=200 2>&1 | tail -1; df -m / | tail -1"
    res, runs = _episode(task_sif, tmp_path, [fill, "echo alive"], final_test, timeout=60, overlay_mb=64)
    assert "No space left" in runs[0].output
    assert runs[1].output == "alive\n"
    assert res.status == "ok" and res.reward == 0.0  # scoring works in a full layer (tests go to /tmp)


def test_tampering_with_passwd_does_not_help(task_sif: Path, tmp_path: Path, final_test: Path) -> None:
    res, _ = _episode(task_sif, tmp_path, ["echo 'root:x:0:0::/root:/bin/sh' > /etc/passwd; echo 41 > answer.txt"], final_test)
    assert res.status == "ok" and res.reward == 0.0
