"""The red-team plants, kept and rescored: a kept final state is agent-written data, and scoring it
must be as safe as live scoring.

Each attack of the red-team suites (tests/sandbox/test_redteam.py, test_redteam_entry.py) runs as
agent commands in a sandbox whose overlay is kept when it stops (``Sandbox.before_overlay_delete``
+ ``final_state.keep``, as an episode with ``sandbox.keep_final_state`` does), then the kept state is
scored by ``score_kept_state``, what ``et-hpc rescore`` runs for every unit. The final test file
holds the suite's two tests plus ``test_planted``, which passes when the attack's files are in the
rescored state (the positive control: the trick reached the state being scored). Every attack must
score 0 with ``test_answer`` failed; where the plant persists, ``test_planted`` must pass. Plants
that scoring neutralises before the tests run (ld.so.preload, nsswitch.conf) are shown by scoring's
own notes instead, and the dodges (a fifo, a home made unusable) by the agent's-0 note they get.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from et_hpc.runner.config import RunConfig
from et_hpc.runner.rescore import score_kept_state
from et_hpc.runs import final_state as fs
from et_hpc.sandbox.sandbox import Sandbox
from et_hpc.tasks.model import Limits
from sandbox.test_redteam import ATTACKS
from sandbox.test_redteam_entry import FINAL_TEST, FORGERIES, PY_PAYLOAD, evil_so  # noqa: F401 - evil_so: a fixture

pytestmark = [pytest.mark.apptainer]

EVIL_HOME = "/home/user/.evil.so"
NSS = "/usr/lib/x86_64-linux-gnu/libnss_evil.so.2"

# attack -> (agent commands, where to put the preload library or None, test_planted's assertion or
# None when nothing of it can persist: a tmpfs, a process, an exported variable)
CASES: dict[str, tuple[list[str], str | None, str | None]] = {
    "conftest_home": (ATTACKS["conftest_home"], None, 'os.path.isfile("/home/user/conftest.py")'),
    "conftest_root_and_tmp": (ATTACKS["conftest_root_and_tmp"], None, 'os.path.isfile("/conftest.py")'),
    "sitecustomize_everywhere": (
        ATTACKS["sitecustomize_everywhere"],
        None,
        'glob.glob("/usr/local/lib/python3*/dist-packages/sitecustomize.py")',
    ),
    "env_exports": (ATTACKS["env_exports"], None, None),
    "background_writer_after_done": (ATTACKS["background_writer_after_done"], None, None),
    "fake_python_and_pytest_in_path": (ATTACKS["fake_python_and_pytest_in_path"], None, 'os.path.isfile("/home/user/bin/python3")'),
    "overwrite_system_python_and_pytest": (
        ATTACKS["overwrite_system_python_and_pytest"],
        None,
        'any(open(p, "rb").read(9) == b"#!/bin/sh" for p in glob.glob("/usr/bin/python3*") if not os.path.islink(p))',
    ),
    "env_script": (FORGERIES["env_script"], None, 'os.path.isfile("/.singularity.d/env/99-zz-forge.sh")'),
    "actions_exec": (FORGERIES["actions_exec"], None, '"ET-SCORE" in open("/.singularity.d/actions/exec").read()'),
    "bin_sh": (FORGERIES["bin_sh"], None, 'os.readlink("/bin/sh") == "/tmp/.sh"'),
    "ld_so_preload": ([f"echo {EVIL_HOME} > /etc/ld.so.preload"], EVIL_HOME, f'os.path.isfile("{EVIL_HOME}")'),
    "ld_preload_env": (
        [
            "echo 'export LD_PRELOAD=/home/user/.evil.so' >> /.singularity.d/env/90-environment.sh; "
            "echo 'LD_PRELOAD=/home/user/.evil.so' >> /etc/environment"
        ],
        EVIL_HOME,
        '"LD_PRELOAD" in open("/etc/environment").read()',
    ),
    # the tests' root shows the image's library directories and nsswitch.conf, so the plant is not
    # visible to test_planted: the rescore's "left out" event names the kept nsswitch.conf instead
    "nss_module": (["sed -i 's/^passwd:.*/passwd: evil files/' /etc/nsswitch.conf"], NSS, None),
    "python_pth_and_shadow_modules": (
        [
            f"printf 'import os; {PY_PAYLOAD}\\n' > /usr/lib/python3/dist-packages/zz-evil.pth",
            f"printf 'import sys\\n{PY_PAYLOAD}\\n' > /home/user/pathlib.py; printf 'raise SystemExit(0)\\n' > /home/user/pytest.py",
        ],
        None,
        'os.path.isfile("/home/user/pytest.py")',
    ),  # the .pth under /usr/lib: the tests' root shows the image's
    "fifo_notes": (["rm /home/user/notes.txt && mkfifo /home/user/notes.txt"], None, None),
    "home_chmod_000": (["echo 41 > answer.txt; chmod 000 /home/user"], None, None),
}
# what scoring reports about a plant it neutralised or a dodge the state holds (its note, its notes,
# the rescore's events)
NOTES = {
    "ld_so_preload": "/etc/ld.so.preload was left out",
    "nss_module": "nsswitch",
    "fifo_notes": "verifier timeout",
    "home_chmod_000": "/home/user",
}
# states that change what starting a sandbox runs: not started again (the agent's 0); the note names the plant
REFUSED = {"env_script": "/.singularity.d", "actions_exec": "/.singularity.d", "bin_sh": "/usr/bin/sh", "ld_preload_env": "/.singularity.d"}


def _final(tmp: Path, planted: str | None) -> Path:
    p = tmp / "test_final_state.py"
    extra = f"\n\ndef test_planted():\n    import glob, os\n    assert {planted}\n" if planted else ""
    p.write_text(FINAL_TEST + extra)
    return p


def _put(sb: Sandbox, src: Path, dst: str) -> None:
    cp = sb.exec(["sh", "-c", f"cat > {dst} && chmod 755 {dst}"], input=src.read_bytes())
    assert cp.returncode == 0, cp.stdout


def _kept(sif: Path, tmp: Path, commands: list[str], put: tuple[Path, str] | None) -> tuple[Path, str]:
    """Run ``commands`` as the agent; the state they leave, kept as an episode keeps it."""
    run_dir = tmp / "run"
    out: dict[str, str] = {}
    with Sandbox(sif, run_prefix="t-rsr", scratch=tmp) as sb:
        sb.before_overlay_delete = lambda p: out.setdefault("v", fs.keep(p, run_dir, 64))
        sh = sb.shell()
        if put is not None:
            _put(sb, *put)
        runs = [sh.run(c, timeout=60) for c in commands]
        assert all(r.exit_code is not None for r in runs), [r.output for r in runs]
    assert fs.digest_of(out.get("v")), out
    return run_dir, out["v"]


def _rescore(sif: Path, run_dir: Path, value: str, final: Path, timeout_s: float = 30):
    task = SimpleNamespace(final_tests=final, limits=Limits())
    cfg = RunConfig(scoring_timeout_s=timeout_s)
    return score_kept_state(run_dir, value, task, cfg, SimpleNamespace(path=sif, digest=None))


def test_an_honest_kept_state_rescores_one(task_sif: Path, tmp_path: Path) -> None:
    run_dir, value = _kept(task_sif, tmp_path, ["echo 42 > answer.txt", "rm -rf /usr/share/doc"], None)
    sc, _ = _rescore(task_sif, run_dir, value, _final(tmp_path, 'not os.path.exists("/usr/share/doc")'))
    assert sc.status == "ok" and sc.reward == 1.0 and (sc.passed, sc.total) == (3, 3), (sc.note, sc.output_tail[-800:])
    assert sc.interpreter == "pristine"


@pytest.mark.parametrize("attack", sorted(CASES))
def test_planted_state_rescores_zero(attack: str, task_sif: Path, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    commands, dst, planted = CASES[attack]
    put = (request.getfixturevalue("evil_so"), dst) if dst else None
    run_dir, value = _kept(task_sif, tmp_path, commands, put)
    sc, events = _rescore(task_sif, run_dir, value, _final(tmp_path, planted), timeout_s=5 if attack == "fifo_notes" else 30)
    assert sc.status == "ok", (attack, sc.error)
    assert sc.reward == 0.0, (attack, sc.tests, sc.output_tail[-800:])
    if attack in REFUSED:
        assert "changes what starts a sandbox" in sc.note and REFUSED[attack] in sc.note, sc.note
        assert sc.interpreter == "none" and not sc.tests
        return
    outcomes = {t.name.split("::")[-1]: t.outcome for t in sc.tests}
    if attack in NOTES:
        assert NOTES[attack] in " ".join([sc.note or "", *sc.notes, *events]), (attack, sc.note, sc.notes, events)
    if attack not in ("fifo_notes", "home_chmod_000"):
        assert outcomes.get("test_answer") == "failed", (attack, outcomes, sc.output_tail[-800:])
    if planted:  # the positive control: the plant is in the state that was scored
        assert outcomes.get("test_planted") == "passed", (attack, outcomes, sc.output_tail[-1200:])


def test_restarting_a_planted_state_unchecked_would_run_the_plant(task_sif: Path, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The positive control of the start check: the same kept ld.so.preload state, started as a
    plain sandbox (no check, nothing left out), runs the agent's library at the first exec."""
    so = request.getfixturevalue("evil_so")
    run_dir, value = _kept(task_sif, tmp_path, [f"echo {EVIL_HOME} > /etc/ld.so.preload"], (so, EVIL_HOME))
    img = tmp_path / "copy.img"
    fs.extract(fs.archive_path(run_dir, value), value, img)
    with Sandbox(task_sif, run_prefix="t-rsr", scratch=tmp_path, overlay_image=img, overlay_readonly=True) as sb:
        assert sb.exec(["true"]).returncode == 0
        assert sb.exec(["cat", "/home/user/answer.txt"]).stdout.strip() == b"42"


def test_final_test_text_is_the_suites() -> None:
    """The rescored final test is the red-team suite's own (plus test_planted), not a weaker copy."""
    assert "def test_answer" in FINAL_TEST and "def test_notes_untouched" in FINAL_TEST
    assert textwrap.dedent(FINAL_TEST) == FINAL_TEST
