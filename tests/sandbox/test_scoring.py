"""Scoring: JUnit parsing, error statuses, and real Endless Terminals fixtures built rootless."""

from __future__ import annotations

import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from et_hpc.sandbox.sandbox import Sandbox
from et_hpc.scoring import live as scoring
from helpers import until
from helpers.legacy_scoring import legacy_score

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0"
failures="1" skipped="1" tests="4"><testcase classname="test_final_state" name="test_a" time="0.001"/>
<testcase classname="test_final_state" name="test_b"><failure message="assert 1 == 2">x</failure></testcase>
<testcase classname="test_final_state" name="test_c"><skipped message="later"/></testcase>
<testcase classname="test_final_state" name="test_d"><error message="fixture broke"/></testcase>
</testsuite></testsuites>"""


def test_parse_junit_outcomes() -> None:
    tests = scoring.parse_junit(JUNIT)
    assert [(t.name, t.outcome) for t in tests] == [
        ("test_final_state::test_a", "passed"),
        ("test_final_state::test_b", "failed"),
        ("test_final_state::test_c", "skipped"),
        ("test_final_state::test_d", "error"),
    ]
    assert tests[1].message == "assert 1 == 2"


def test_result_rules() -> None:
    ok = scoring._result(
        {
            "rc": 0,
            "junit": JUNIT.replace("<failure", "<x").replace("</failure>", "</x>").replace('<error message="fixture broke"/>', ""),
            "out": "",
        },
        0.0,
        "pristine",
    )
    assert ok.status == "ok" and ok.reward == 1.0 and (ok.passed, ok.total) == (3, 3) and ok.note is None
    bad = scoring._result({"rc": 1, "junit": JUNIT, "out": ""}, 0.0, "pristine")
    assert bad.reward == 0.0 and (bad.passed, bad.total) == (1, 3)
    empty = scoring._result({"rc": 5, "junit": "<testsuites><testsuite/></testsuites>", "out": ""}, 0.0, "p")
    assert empty.reward == 0.0 and empty.total == 0 and "no test" in (empty.note or "")
    # what the state the agent left causes: ok, reward 0, a note; never None
    for res, says in (
        ({"rc": None, "timed_out": True, "junit": None, "out": ""}, "verifier timeout (7 s)"),
        ({"rc": None, "signal": 9, "junit": None, "out": "boom"}, "signal 9"),
        ({"rc": 2, "junit": None, "out": "boom"}, "exit 2"),
        ({"rc": 1, "junit": "<testsuites><testcase", "out": ""}, "unreadable"),
        ({"kind": "agent", "error": "/etc/ld.so.preload is a symlink"}, "symlink"),
    ):
        r = scoring._result(res, 0.0, "pristine", timeout_s=7)
        assert r.status == "ok" and r.reward == 0.0 and says in (r.note or ""), (res, r)
    # outside the agent's reach: error, reward None
    for res in (
        {"kind": "infra", "error": "the image's pristine interpreter is missing", "stage": "prepare"},
        {"kind": "infra", "error": "pytest is not installed", "stage": "tests"},
    ):
        r = scoring._result(res, 0.0, "pristine")
        assert r.status == "error" and r.reward is None and r.error
    assert scoring._result({"kind": "infra", "error": "x", "stage": "prepare"}, 0.0).interpreter == "none"


def test_missing_test_file_is_error(tmp_path: Path) -> None:
    class _Nope:
        pass

    r = scoring.run_tests(_Nope(), tmp_path / "absent.py")  # type: ignore[arg-type]
    assert r.status == "error" and r.reward is None and "cannot read" in (r.error or "")


@pytest.mark.apptainer
def test_verifier_timeout_is_the_agents_zero(base_sif: Path, tmp_path: Path) -> None:
    t = tmp_path / "test_slow.py"
    t.write_text("import time\ndef test_slow():\n    time.sleep(600)\n")
    with Sandbox(base_sif, run_prefix="t-score", scratch=tmp_path) as sb:
        r = scoring.score(sb, t, timeout_s=2)
        assert r.status == "ok" and r.reward == 0.0, r
        assert r.note == "tests exceeded the verifier timeout (2 s)" and r.interpreter == "pristine"
        left = sb.exec(["sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"]).stdout.decode()
        assert "test_slow" not in left


@pytest.mark.apptainer
def test_tests_run_in_home_with_clean_env(base_sif: Path, tmp_path: Path) -> None:
    t = tmp_path / "test_env.py"
    t.write_text(
        textwrap.dedent("""\
        import os, sys
        def test_env():
            assert os.getcwd() == "/home/user"
            assert os.environ["HOME"] == "/home/user"
            assert "FOO" not in os.environ and "PYTHONPATH" not in os.environ
            assert sys.flags.isolated == 1
        """)
    )
    with Sandbox(base_sif, run_prefix="t-score", scratch=tmp_path) as sb:
        sb.shell().run("export FOO=1 PYTHONPATH=/tmp; cd /tmp")
        r = scoring.score(sb, t)
        assert r.status == "ok" and r.reward == 1.0, r.output_tail
        # the scoring directory is removed afterwards
        assert b"et-score-" not in sb.exec(["ls", "-a", "/tmp"]).stdout


# A task's test file using what pytest offers tests: the plugins scoring blocks must not be missed.
BUILTINS_TEST = textwrap.dedent("""\
    import logging, os, unittest, warnings
    import pytest

    CALLED = []

    def setup():  # nose-style module setup (pytest's nose plugin, where the image's pytest has it)
        CALLED.append("setup")

    def test_tmp_path(tmp_path):
        (tmp_path / "a").write_text("x")
        assert (tmp_path / "a").read_text() == "x"

    def test_tmpdir(tmpdir):
        tmpdir.join("b").write("y")
        assert tmpdir.join("b").read() == "y"

    def test_capsys(capsys):
        print("hello")
        assert capsys.readouterr().out == "hello\\n"

    def test_capfd(capfd):
        os.write(1, b"fd\\n")
        assert capfd.readouterr().out == "fd\\n"

    def test_caplog(caplog):
        logging.getLogger("t").warning("warned")
        assert "warned" in caplog.text

    def test_monkeypatch(monkeypatch):
        monkeypatch.setenv("ET_X", "1")
        assert os.environ["ET_X"] == "1"

    def test_recwarn(recwarn):
        warnings.warn("w", UserWarning)
        assert len(recwarn) == 1

    def test_doctest_namespace(doctest_namespace):
        doctest_namespace["x"] = 1

    def test_nose_setup_ran(request):
        assert CALLED == (["setup"] if request.config.pluginmanager.has_plugin("nose") else [])

    @pytest.mark.skip(reason="skipped on purpose")
    def test_skipped():
        assert False

    @pytest.mark.xfail(reason="fails on purpose", strict=True)
    def test_xfail():
        assert False

    class TestUnit(unittest.TestCase):
        def test_unit(self):
            self.assertEqual(1 + 1, 2)

    def test_blocked_plugins_are_gone(request):
        pm = request.config.pluginmanager
        assert pm.has_plugin("tmpdir") and pm.has_plugin("junitxml") and pm.has_plugin("capture")
        assert not any(pm.has_plugin(n) for n in ("pastebin", "setuponly", "setupplan", "stepwise"))
    """)
BUILTIN_PASSES = [
    "test_tmp_path",
    "test_tmpdir",
    "test_capsys",
    "test_capfd",
    "test_caplog",
    "test_monkeypatch",
    "test_recwarn",
    "test_doctest_namespace",
    "test_nose_setup_ran",
    "test_unit",
    "test_blocked_plugins_are_gone",
]


@pytest.mark.apptainer
def test_task_tests_keep_pytest_builtins(base_sif: Path, tmp_path: Path) -> None:
    good = tmp_path / "test_builtins.py"
    good.write_text(BUILTINS_TEST)
    bad = tmp_path / "test_builtins_bad.py"  # the same with one failing test: the check can fail
    bad.write_text(BUILTINS_TEST + "\n\ndef test_fails(capsys):\n    print('x')\n    assert capsys.readouterr().out == 'y'\n")
    with Sandbox(base_sif, run_prefix="t-score", scratch=tmp_path) as sb:
        sb.shell().run("true")
        r = scoring.score(sb, good)
        r_bad = scoring.score(sb, bad)
    assert r.status == "ok" and r.reward == 1.0, r.output_tail
    outcomes = {t.name.rsplit("::", 1)[1]: t.outcome for t in r.tests}
    assert [n for n, o in outcomes.items() if o == "passed"] == BUILTIN_PASSES, outcomes
    assert outcomes["test_skipped"] == outcomes["test_xfail"] == "skipped"
    assert (r.passed, r.total) == (len(BUILTIN_PASSES), len(BUILTIN_PASSES))
    assert r_bad.status == "ok" and r_bad.reward == 0.0 and r_bad.passed == len(BUILTIN_PASSES)
    assert [t.name.rsplit("::", 1)[1] for t in r_bad.tests if t.outcome == "failed"] == ["test_fails"]
    # where the time went: every part of the path left its mark, in the order it runs
    # (the helper may have started and imported before scoring began: one is kept ready)
    assert r.stages["helper_start"] < r.stages["imported"] < r.stages["entered"], r.stages
    order = [
        "swept",
        "config",
        "helper_spawned",
        "entered",
        "private_mounts",
        "killed",
        "view",
        "tmpfs",
        "pytest_spawned",
        "py_start",
        "py_pytest_imported",
        "py_session_start",
        "py_collected",
        "py_tests_done",
        "py_fenced",
        "py_end",
        "pytest_eof",
        "report_read",
        "driver_done",
        "helper_done",
        "result",
    ]
    assert all(k in r.stages for k in order), sorted(r.stages)
    assert [r.stages[k] for k in order] == sorted(r.stages[k] for k in order), r.stages
    assert "stages" not in r.model_dump()  # never part of a record


@pytest.mark.apptainer
def test_image_without_python_is_error(tmp_path: Path, base_sif: Path) -> None:
    d = tmp_path / "img"
    d.mkdir()
    (d / "t.def").write_text(f"Bootstrap: localimage\nFrom: {base_sif}\n%post\n    rm -f /usr/bin/python3*\n")
    sif = d / "t.sif"
    cp = subprocess.run(["apptainer", "-s", "build", "--fakeroot", str(sif), str(d / "t.def")], capture_output=True, text=True, cwd=d)
    assert cp.returncode == 0, cp.stderr[-2000:]
    t = tmp_path / "test_x.py"
    t.write_text("def test_x():\n    pass\n")
    with Sandbox(sif, run_prefix="t-score", scratch=tmp_path) as sb:
        r = scoring.score(sb, t)
    assert r.status == "error" and r.reward is None and "python3" in (r.error or "")


# -- real fixtures --------------------------------------------------------------------------

FIXTURE_TASKS = ["task_000000_3bb4337a", "task_000000_c79e7c5d"]


@pytest.fixture(scope="session")
def fixture_sifs(fixtures_dir: Path, base_sif: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for task in FIXTURE_TASKS:
        d = tmp_path_factory.mktemp(task)
        src = d / "src"
        shutil.copytree(fixtures_dir / "native" / task, src)
        src.chmod(0o755)
        df = src / "container.def"
        df.chmod(0o644)
        lines = [f"From: {base_sif}" if ln.startswith("From:") else ln for ln in df.read_text().splitlines()]
        df.write_text("\n".join(lines) + "\n")
        sif = d / "task.sif"
        cp = subprocess.run(
            ["apptainer", "-s", "build", "--fakeroot", str(sif), str(df)], capture_output=True, text=True, cwd=src, timeout=900
        )
        assert cp.returncode == 0, f"{task}: {cp.stderr[-2000:]}"
        out[task] = sif
    return out


@pytest.mark.parametrize("task", FIXTURE_TASKS)
def test_fixture_initial_pass_final_fail(task: str, fixture_sifs: dict[str, Path], fixtures_dir: Path, tmp_path: Path) -> None:
    tdir = fixtures_dir / "native" / task
    with Sandbox(fixture_sifs[task], run_prefix="t-fix", scratch=tmp_path) as sb:
        init = scoring.run_initial_tests(sb, tdir / "test_initial_state.py")
        assert init.status == "ok" and init.reward == 1.0 and init.total > 0, init.output_tail
        final = scoring.score(sb, tdir / "test_final_state.py")
        assert final.status == "ok" and final.reward == 0.0, final.output_tail
        assert final.interpreter == "pristine"
        # the same verdicts, test by test, as pytest with every builtin plugin and its normal
        # teardown gives (the old apptainer-exec driver, kept for the red team's controls)
        for ours, path in ((init, "test_initial_state.py"), (final, "test_final_state.py")):
            plain = legacy_score(sb, tdir / path, timeout=60)  # its file is always test_final_state.py
            assert plain.status == "ok", plain.error
            assert [(_bare(t.name, path), t.outcome, _addr(t.message)) for t in ours.tests] == [
                (_bare(t.name, "test_final_state.py"), t.outcome, _addr(t.message)) for t in plain.tests
            ]
            assert (ours.reward, ours.passed, ours.total) == (plain.reward, plain.passed, plain.total)


def _addr(message: str | None) -> str | None:
    """A failure message without object addresses (``<function f at 0x7f...>`` differ per run)."""
    return re.sub(r"0x[0-9a-f]+", "0x?", message) if message else message


def _bare(name: str, path: str) -> str:
    """A test's name without its module (``test_x::test_y`` -> ``test_y``; classes kept)."""
    mod = path.removesuffix(".py") + "::"
    return name[len(mod) :] if name.startswith(mod) else name


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@pytest.mark.apptainer
def test_an_ended_warmup_leaves_no_zombie_in_the_instance(task_sif: Path, tmp_path: Path) -> None:
    """Ending the scoring warm-up mid-run reaps its python: an orphan would be a zombie of the
    instance's pid namespace that only the host's init reaps, and apptainer waits for that
    before it drops a stopped instance."""
    with Sandbox(task_sif, run_prefix="t-wup", scratch=tmp_path) as sb:
        sb.shell().run("true")  # the first shell starts the warm-up
        helper = sb._warmer
        assert helper is not None and helper.poll() is None
        pys = until("the warm-up's python", lambda: _children(helper.pid), 30, every_s=0.005)
        assert len(pys) == 1
        py = pys[0]
        assert Path(f"/proc/{py}").exists()
        sb.stop_warmup()
        assert helper.returncode == 0  # it ended on SIGTERM (a SIGKILLed helper would say -9)
        assert not Path(f"/proc/{py}").exists()  # killed and reaped, not a zombie
