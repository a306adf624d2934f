"""Red team, grown: attacks on the way scoring enters the instance, and on who gets the blame.

Every attack runs as agent commands through the Shell on a small task whose final test fails on
the untouched state (it wants ``/home/user/answer.txt`` to hold ``42``), so reward 1.0 could only
be forged. Each test first scores the episode the real way (status ok, reward 0.0, never 1.0 and
never None), then shows the trick takes effect when scoring is not hardened (the positive
control): the same state scored through the old entry path (``apptainer exec instance://`` the
pristine python with the old driver, kept only here) forges 1.0 or loses the reward, or the
planted effect is observed directly.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from et_hpc.agent.loop import BudgetConfig, run_agent
from et_hpc.agent.policies import Action
from et_hpc.sandbox.sandbox import Sandbox
from et_hpc.scoring import live as scoring
from helpers import IN_CI
from helpers.legacy_scoring import legacy_score

FINAL_TEST = textwrap.dedent("""\
    import os, pwd, subprocess
    from pathlib import Path

    OWNER = pwd.getpwuid(os.getuid()).pw_name  # an NSS lookup, as ownership checks do

    def test_answer():
        assert Path("/home/user/answer.txt").read_text().strip() == "42"

    def test_notes_untouched():
        assert Path("/home/user/notes.txt").read_text() == "keep me\\n"
    """)

# A test that runs a program of the agent's (as many Endless Terminals tests do).
RUNS_PROGRAM_TEST = textwrap.dedent("""\
    import subprocess
    from pathlib import Path

    def test_program():
        out = subprocess.run(["/home/user/solve.sh"], capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == "42"
        assert Path("/home/user/answer.txt").read_text().strip() == "42"
    """)

FORGED_JUNIT = (
    '<testsuites><testsuite><testcase classname="t" name="test_answer"/>'
    '<testcase classname="t" name="test_notes_untouched"/></testsuite></testsuites>'
)
FORGED = json.dumps({"killed": 0, "rc": 0, "timed_out": False, "junit": FORGED_JUNIT, "out": "", "error": None}, separators=(",", ":"))
PLANT_FORGED = f"cat > /tmp/.forged.json <<'EOF'\n{FORGED}\nEOF"
# The forged-pass one-liner: whatever runs first in an exec reads the scoring config from stdin,
# finds the marker and prints a passing result.
FORGE = (
    "d=$(cat); m=$(printf %s \"$d\" | grep -o 'ET-SCORE-[0-9a-f]*:' | head -n 1); "
    'if [ -n "$m" ]; then printf \'\\n%s\' "$m"; cat /tmp/.forged.json; exit 0; fi'
)


@pytest.fixture(scope="session")
def evil_so(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A shared library whose constructor writes the answer (what a preloaded library could do)."""
    if not shutil_which("gcc"):
        if IN_CI:
            pytest.fail("gcc is needed to build the preload library")
        pytest.skip("gcc is not installed")
    d = tmp_path_factory.mktemp("evil-so")
    (d / "evil.c").write_text(
        textwrap.dedent("""\
        #include <fcntl.h>
        #include <unistd.h>
        __attribute__((constructor)) static void forge(void) {
            int fd = open("/home/user/answer.txt", O_WRONLY | O_CREAT | O_TRUNC, 0644);
            if (fd >= 0) { write(fd, "42\\n", 3); close(fd); }
        }
        """)
    )
    so = d / "evil.so"
    cp = subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(so), str(d / "evil.c")], capture_output=True, text=True)
    assert cp.returncode == 0, cp.stderr
    so.chmod(0o644)
    d.chmod(0o755)
    return so


def shutil_which(name: str) -> str | None:
    import shutil

    return shutil.which(name)


@pytest.fixture
def final_test(tmp_path: Path) -> Path:
    p = tmp_path / "test_final_state.py"
    p.write_text(FINAL_TEST)
    return p


def _put(sb: Sandbox, src: Path, dst: str) -> None:
    """Copy a host file into the instance as the agent could (through its shell's exec)."""
    cp = sb.exec(["sh", "-c", f"cat > {dst} && chmod 755 {dst}"], input=src.read_bytes())
    assert cp.returncode == 0, cp.stdout


def _agent(sb: Sandbox, commands: list[str], timeout: float = 30) -> list:
    sh = sb.shell()
    return [sh.run(c, timeout=timeout) for c in commands]


def _assert_zero(res: scoring.ScoreResult, what: str) -> None:
    assert res.status == "ok", f"{what}: {res.error}"
    assert res.reward == 0.0, f"{what}: {res.tests} {res.note} {res.output_tail[-600:]}"
    assert res.interpreter in ("pristine", "none")


# -- forged passes: the runtime's own files, loader and interpreter substitution ----------------

FORGE_SCRIPT = "#!/tmp/.dash\nif [ ! -t 0 ]; then " + FORGE + "; fi\n"
FORGERIES = {
    # 1. the one-liner: an env script apptainer sources before every exec
    "env_script": [PLANT_FORGED, "cat > /.singularity.d/env/99-zz-forge.sh <<'EOF'\n" + FORGE + "\nEOF"],
    # 2. apptainer's exec action replaced (it is what `apptainer exec` runs first)
    "actions_exec": [
        PLANT_FORGED,
        "cp /bin/dash /tmp/.dash && cp /.singularity.d/actions/exec /tmp/.exec && cat > /.singularity.d/actions/exec <<'EOF'\n"  # noqa: E501
        + FORGE_SCRIPT
        + 'exec /tmp/.dash /tmp/.exec "$@"\nEOF\nchmod 755 /.singularity.d/actions/exec',
    ],
    # 3. /bin/sh (which runs the action scripts) replaced by a forging wrapper
    "bin_sh": [
        PLANT_FORGED,
        "cp /bin/dash /tmp/.dash && cat > /tmp/.sh <<'EOF'\n"
        + FORGE_SCRIPT
        + 'exec /tmp/.dash "$@"\nEOF\nchmod 755 /tmp/.sh && ln -sf /tmp/.sh /bin/sh',
    ],
}


# Apptainer 1.4 runs its action logic in its own interpreter (measured: a replaced
# /.singularity.d/actions/exec is not run by `apptainer exec`), but it still sources the env
# scripts; older runtimes run the action script with /bin/sh. The controls show each planted
# program forges when it is run: the env script through the old entry path, the others directly.
CONTROLS = {
    "env_script": None,
    "actions_exec": ["/tmp/.dash", "/.singularity.d/actions/exec", "true"],
    "bin_sh": ["sh", "-c", "true"],
}


@pytest.fixture(params=["sif", "unpacked"])
def task_image(request: pytest.FixtureRequest, task_sif: Path) -> Path:
    """The red-team image as a SIF, and unpacked on the node (``sandbox.local_copy: unpack``)."""
    return task_sif if request.param == "sif" else request.getfixturevalue("task_tree")


@pytest.mark.parametrize("attack", sorted(FORGERIES))
def test_runtime_files_cannot_forge_a_pass(attack: str, task_image: Path, tmp_path: Path, final_test: Path) -> None:
    with Sandbox(task_image, run_prefix="t-rte", scratch=tmp_path) as sb:
        runs = _agent(sb, FORGERIES[attack])
        assert all(r.exit_code == 0 for r in runs), [r.output for r in runs]
        res = scoring.score(sb, final_test, timeout_s=30)
        _assert_zero(res, attack)
        assert res.interpreter == "pristine" and res.total == 2
        if CONTROLS[attack] is None:
            control = legacy_score(sb, final_test)
            assert control.status == "ok" and control.reward == 1.0, f"control: {control}"
        else:
            cp = sb.exec(CONTROLS[attack], input=b'{"marker": "ET-SCORE-0123abcd:"}')
            assert b'ET-SCORE-0123abcd:{"killed":0,"rc":0' in cp.stdout, cp.stdout


# 4-6. code loaded into the test process by the dynamic loader
def _preload_attack(
    task_sif: Path, tmp_path: Path, final_test: Path, evil_so: Path, dst: str, command: str, what: str
) -> scoring.ScoreResult:
    """Plant the answer-writing library at ``dst`` and run the agent's ``command``: scoring gives the
    agent's 0, while the old entry path (the positive control) is fooled into 1.0 by the same plant."""
    with Sandbox(task_sif, run_prefix="t-rte", scratch=tmp_path) as sb:
        _agent(sb, ["true"])
        _put(sb, evil_so, dst)
        _agent(sb, [command])
        res = scoring.score(sb, final_test, timeout_s=30)
        _assert_zero(res, what)
        control = legacy_score(sb, final_test)
        assert control.reward == 1.0, f"control: {control}"
    return res


def test_ld_so_preload_is_the_images(task_sif: Path, tmp_path: Path, final_test: Path, evil_so: Path) -> None:
    res = _preload_attack(
        task_sif, tmp_path, final_test, evil_so, "/home/user/.evil.so", "echo /home/user/.evil.so > /etc/ld.so.preload", "ld.so.preload"
    )
    assert res.total == 2, res


def test_ld_so_preload_symlink_is_not_followed(task_sif: Path, tmp_path: Path, final_test: Path, evil_so: Path) -> None:
    """A symlinked ld.so.preload: the tests' root shows the image's runtime files in its place,
    and the file it points to stays the agent's, as the tests would read it."""
    res = _preload_attack(
        task_sif,
        tmp_path,
        final_test,
        evil_so,
        "/home/user/.evil.so",
        "echo /home/user/.evil.so > /home/user/.pre && ln -s /home/user/.pre /etc/ld.so.preload",
        "ld.so.preload symlink",
    )
    assert res.total == 2, res


def test_ld_preload_exported_by_runtime_env(task_sif: Path, tmp_path: Path, final_test: Path, evil_so: Path) -> None:
    """LD_PRELOAD from the image's environment script (what /etc/environment or rc files would be
    for a login shell): apptainer exports it into every exec, even with --cleanenv."""
    res = _preload_attack(
        task_sif,
        tmp_path,
        final_test,
        evil_so,
        "/home/user/.evil.so",
        "echo 'export LD_PRELOAD=/home/user/.evil.so' >> /.singularity.d/env/90-environment.sh; "
        "echo 'LD_PRELOAD=/home/user/.evil.so' >> /etc/environment; "
        "echo 'export LD_PRELOAD=/home/user/.evil.so' "
        "| tee -a /etc/profile /etc/bash.bashrc ~/.bashrc ~/.profile >/dev/null",
        "LD_PRELOAD env",
    )
    assert res.total == 2


def test_nss_module_is_not_loaded(task_sif: Path, tmp_path: Path, final_test: Path, evil_so: Path) -> None:
    """nsswitch.conf naming a module the agent planted in a default library dir: the test's pwd
    lookup would dlopen it into the test process."""
    res = _preload_attack(
        task_sif,
        tmp_path,
        final_test,
        evil_so,
        "/usr/lib/x86_64-linux-gnu/libnss_evil.so.2",
        "sed -i 's/^passwd:.*/passwd: evil files/' /etc/nsswitch.conf && grep ^passwd /etc/nsswitch.conf",
        "nss",
    )
    assert res.total == 2, res


# 7-9. the interpreter, its packages, plugins and modules imported by name
PY_PAYLOAD = 'open(\\"/home/user/answer.txt\\", \\"w\\").write(\\"42\\\\n\\")'


def test_python_package_tricks_do_not_reach_the_tests(task_image: Path, tmp_path: Path, final_test: Path) -> None:
    """Shadow modules in /home/user and /tmp, a .pth file, a pytest11 entry-point plugin in the
    writable site-packages, a rewritten pytest package and python3 in the writable tree."""
    plugin = "import pytest\\n@pytest.hookimpl(tryfirst=True)\\ndef pytest_runtest_call(item):\\n    item.runtest = lambda: None\\n"
    cmds = [
        # shadow modules imported by name (pathlib, os helpers) where a cwd or script dir would put them
        f"for d in /home/user /tmp; do printf 'import sys\\n{PY_PAYLOAD}\\n"
        'exec(open("/usr/lib/python3.11/pathlib.py").read())\\n\' > $d/pathlib.py; '
        "printf 'raise SystemExit(0)\\n' > $d/pytest.py; done",
        # a .pth in the writable dist-packages
        f"printf 'import os; {PY_PAYLOAD}\\n' > /usr/lib/python3/dist-packages/zz-evil.pth",
        # an entry-point plugin
        "d=/usr/local/lib/python3.11/dist-packages; mkdir -p $d/evilplug-1.0.dist-info && "
        f"printf '{plugin}' > $d/evilplug.py && "
        "printf 'Metadata-Version: 2.1\\nName: evilplug\\nVersion: 1.0\\n' > $d/evilplug-1.0.dist-info/METADATA && "
        "printf '[pytest11]\\nevil = evilplug\\n' > $d/evilplug-1.0.dist-info/entry_points.txt",
    ]
    with Sandbox(task_image, run_prefix="t-rte", scratch=tmp_path) as sb:
        runs = _agent(sb, cmds)
        assert all(r.exit_code == 0 for r in runs), [r.output for r in runs]
        res = scoring.score(sb, final_test, timeout_s=30)
        _assert_zero(res, "python tricks")
        assert res.total == 2
        # positive controls: the instance's own python picks each of them up
        sb.exec(["sh", "-c", "mkdir -p /tmp/ctl"])
        sb.exec(["sh", "-c", "cat > /tmp/ctl/test_final_state.py"], input=final_test.read_bytes())
        plug = sb.exec(
            [
                "sh",
                "-c",
                "cd /tmp/ctl && rm -f /tmp/pytest.py /tmp/pathlib.py && "
                "python3 -c 'import importlib.metadata as m; print([e.name for e in m.entry_points(group=\"pytest11\")])'",
            ]
        )
        assert b"evil" in plug.stdout, plug.stdout
        ctl = sb.exec(["sh", "-c", "rm -f /home/user/answer.txt; cd /home/user && python3 -c 'import pathlib'; cat /home/user/answer.txt"])
        assert ctl.stdout.strip() == b"42", ctl.stdout
        ctl = sb.exec(["sh", "-c", "rm -f /home/user/answer.txt /home/user/pathlib.py; python3 -c pass; cat /home/user/answer.txt"])
        assert ctl.stdout.strip() == b"42", ctl.stdout  # the .pth ran


# -- dodged failures: states that used to turn a 0 into no data ---------------------------------


def test_fifo_where_the_test_reads_times_out_as_zero(task_sif: Path, tmp_path: Path, final_test: Path) -> None:
    with Sandbox(task_sif, run_prefix="t-rte", scratch=tmp_path) as sb:
        runs = _agent(sb, ["rm /home/user/notes.txt && mkfifo /home/user/notes.txt && stat -c %F /home/user/notes.txt"])
        assert runs[0].output.strip() == "fifo"  # the trick is in place
        res = scoring.score(sb, final_test, timeout_s=5)
        _assert_zero(res, "fifo")
        assert res.note == "tests exceeded the verifier timeout (5 s)"
        control = legacy_score(sb, final_test, timeout=5)
        assert control.status == "error" and control.reward is None  # the old blame: no data


def test_home_chmod_000_is_zero(task_sif: Path, tmp_path: Path, final_test: Path) -> None:
    with Sandbox(task_sif, run_prefix="t-rte", scratch=tmp_path) as sb:
        runs = _agent(sb, ["echo 41 > answer.txt; chmod 000 /home/user; ls /home/user >/dev/null 2>&1; echo $?"])
        assert runs[0].output.strip() != "0"  # the home is unusable now
        res = scoring.score(sb, final_test, timeout_s=30)
        _assert_zero(res, "chmod 000")
        assert res.total == 2 and "/home/user" in (res.note or ""), res.note


def test_every_writable_place_filled_still_scores(task_sif: Path, tmp_path: Path, final_test: Path) -> None:
    fill = (
        "for d in /home/user /tmp /var/tmp /dev/shm /; do dd if=/dev/zero of=$d/.fill bs=1M count=400 "
        "2>/dev/null; done; dd if=/dev/zero of=/tmp/probe bs=1M count=1 2>/dev/null || echo TMP-FULL; "
        "dd if=/dev/zero of=/home/user/probe bs=1M count=1 2>/dev/null || echo HOME-FULL"
    )
    # The last free blocks too (a full filesystem may still take a 4-byte file): Python's tempfile
    # then finds no usable directory at all in the instance.
    crumbs = (
        "for d in /home/user /tmp /var/tmp /dev/shm /; do i=0; while [ $i -lt 20000 ] && "
        "echo x > $d/.c$i 2>/dev/null; do i=$((i+1)); done; done; "
        "python3 -c 'import tempfile; tempfile.gettempdir()' 2>/dev/null || echo NO-TEMPDIR"
    )
    with Sandbox(task_sif, run_prefix="t-rte", scratch=tmp_path, overlay_mb=64) as sb:
        runs = _agent(sb, [fill, crumbs], timeout=120)
        assert "TMP-FULL" in runs[0].output and "HOME-FULL" in runs[0].output, runs[0].output
        assert "NO-TEMPDIR" in runs[1].output, runs[1].output  # the trick takes effect
        res = scoring.score(sb, final_test, timeout_s=30)
        _assert_zero(res, "filled")
        assert res.total == 2 and res.passed == 1, (res.note, res.output_tail[-1500:])  # the tests really ran
        control = legacy_score(sb, final_test)
        assert control.status == "error" and control.reward is None  # the old path had nowhere to write


@pytest.mark.parametrize("how", ["kill_pytest", "kill_everything", "rewrite_report", "fifo_report"])
def test_programs_the_tests_run_cannot_dodge_or_forge(how: str, task_sif: Path, tmp_path: Path) -> None:
    final = tmp_path / "test_final_state.py"
    final.write_text(RUNS_PROGRAM_TEST)
    body = {
        "kill_pytest": "kill -9 $PPID",
        "kill_everything": "kill -9 -1",
        # a background writer that waits for the report and replaces it with a pass
        "rewrite_report": (
            "touch /home/user/.bg-started; (for i in $(seq 600); do for f in /.et-pristine/*/junit.xml "
            "/tmp/et-score-*/junit.xml; do [ -f \"$f\" ] && printf '%s' '"
            + FORGED_JUNIT
            + '\' > "$f"; done; sleep 0.01; done) >/dev/null 2>&1 & echo 41'
        ),
        # FIFOs where pytest writes its report and the driver reads it: opening either would block
        "fifo_report": (
            'for d in /.et-pristine/*/; do [ -f "$d/test_final_state.py" ] && mkfifo "$d/junit.xml" '
            '"$d/stages.json" && touch /home/user/.fifo-made; done; echo 41'
        ),
    }[how]
    with Sandbox(task_sif, run_prefix="t-rte", scratch=tmp_path) as sb:
        _agent(sb, [f"cat > /home/user/solve.sh <<'EOF'\n#!/bin/bash\n{body}\nEOF\nchmod +x /home/user/solve.sh"])
        res = scoring.score(sb, final, timeout_s=30)
        _assert_zero(res, how)
        if how == "kill_pytest":
            assert "signal 9" in (res.note or ""), res
            control = legacy_score(sb, final)
            assert control.status == "error" and control.reward is None  # a dodged 0 in the old path
        elif how == "kill_everything":
            assert res.note and ("killed" in res.note or "signal" in res.note), res
        elif how == "rewrite_report":
            assert res.total == 1
            assert sb.exec(["test", "-e", "/home/user/.bg-started"]).returncode == 0  # the writer started
        else:
            assert res.total == 1 and res.passed == 0, res  # the real report was written and read
            assert sb.exec(["test", "-e", "/home/user/.fifo-made"]).returncode == 0  # the FIFOs were made


# -- the agent breaking its own shell or instance ------------------------------------------------


class _Script:
    mode = "text"

    def __init__(self, commands: list[str]):
        self.commands = list(commands)

    def act(self, messages):
        if not self.commands:
            return Action(kind="done", message={"role": "assistant", "content": "done"})
        c = self.commands.pop(0)
        return Action(kind="command", command=c, message={"role": "assistant", "content": c})


BREAKERS = {
    "chmod 000 /bin/bash": "chmod 000 /bin/bash; exit",
    # an env script that kills every new exec: no shell can start again
    "exec that kills every shell": "echo 'exit 3' > /.singularity.d/env/00-exit.sh; exit",
    # init exits about 0.1 s after the signal: the sleep keeps the agent's next command from
    # racing it, so the shell dies in this command and cannot be started again
    "kill -TERM 1": "kill -TERM 1; sleep 10",
}


@pytest.mark.parametrize("breaker", sorted(BREAKERS))
def test_agent_breaking_its_shell_is_scored(breaker: str, task_sif: Path, tmp_path: Path, final_test: Path) -> None:
    with Sandbox(task_sif, run_prefix="t-rte", scratch=tmp_path) as sb:
        sh = sb.shell()
        policy = _Script(["echo 41 > answer.txt", BREAKERS[breaker], "echo 42 > answer.txt", "echo more"])
        blamed: list[str] = []

        def blame(e: Exception) -> bool:
            blamed.append(sb.health())
            return blamed[-1] in ("alive", "gone")

        res = run_agent("solve it", sh, policy, BudgetConfig(max_turns=6, command_timeout_s=20), shell_blame=blame)
        # positive control: the shell really could not be started again (without the blame rule
        # this was an unscored shell_error)
        assert res.stop_reason == "shell_broken" and res.status == "ok", res
        assert blamed and "ShellDied" in (res.error or ""), res.error
        sc = scoring.score(sb, final_test, timeout_s=30)
        _assert_zero(sc, breaker)
        if breaker == "kill -TERM 1":
            assert sc.note == scoring.GONE_NOTE and blamed[-1] == "gone"
        else:
            assert sc.total == 2 and sc.passed == 1  # scored on the state it left (41)
            assert blamed[-1] == "alive"


def test_runtime_removed_from_inside_still_scores(task_sif: Path, tmp_path: Path, final_test: Path) -> None:
    with Sandbox(task_sif, run_prefix="t-rte", scratch=tmp_path) as sb:
        runs = _agent(
            sb,
            ["echo 42 > answer.txt; rm -rf /.singularity.d /bin/sh /usr/bin/dash; ls -d /.singularity.d /bin/sh 2>&1 | grep -c 'No such'"],
        )
        assert runs[0].output.strip() == "2"  # the runtime's files are gone
        res = scoring.score(sb, final_test, timeout_s=30)
        assert res.status == "ok" and res.reward == 1.0, res  # an honest solution still counts


# -- end to end: the records these make --------------------------------------------------------


def _run_demo(tmp: Path, name: str, script: dict, timeout: float = 600):
    """``et-hpc run`` on demo_hello_file with the scripted server; returns the run's one record."""
    import os
    import sys

    from et_hpc.images.store import ImageStore
    from et_hpc.runs.store import open_run
    from et_hpc.tasks.loader import load_tasks
    from et_hpc.testing.scripted_server import ScriptedServer
    from helpers import REPO

    demo = REPO / "defs" / "demo"
    task = next(t for t in load_tasks(str(demo)).tasks if t.id == "demo_hello_file")
    assert ImageStore().ensure(task).path is not None
    with ScriptedServer(script) as srv:
        cmd = [
            sys.executable,
            "-m",
            "et_hpc.cli",
            "run",
            str(demo),
            "--set",
            "tasks.ids=[demo_hello_file]",
            "--run-name",
            name,
            "--store",
            str(tmp / "store"),
            "--concurrency",
            "1",
            "--json",
            "--set",
            "policy.kind=openai",
            "--set",
            f"policy.base_url={srv.base_url}",
            "--set",
            "policy.mode=tools",
            "--set",
            "scoring_timeout_s=5",
        ]
        r = subprocess.run(cmd, env=os.environ.copy(), capture_output=True, text=True, timeout=timeout, cwd=tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    run = open_run(tmp / "store" / name)
    recs = run.records()
    assert len(recs) == 1, recs
    return recs[0], run.summary()


@pytest.mark.parametrize("case", ["shell_broken", "hanging_tests"])
def test_episode_records_the_agents_failure(case: str, base_sif: Path, tmp_path: Path) -> None:
    cmds = {
        "shell_broken": ["chmod 000 /bin/bash; exit", "echo hello > /home/user/greeting.txt"],
        # the file the final test reads becomes a FIFO: the tests hang until the verifier timeout
        "hanging_tests": ["mkfifo /home/user/greeting.txt && stat -c %F /home/user/greeting.txt"],
    }[case]
    rec, summary = _run_demo(tmp_path, case, {"greeting.txt": [{"command": c} for c in cmds] + ["done"]})
    assert rec.status == "ok" and rec.reward == 0.0, (rec.status, rec.error, rec.score_note)
    assert rec.interpreter == "pristine"
    if case == "shell_broken":
        assert rec.stop_reason == "shell_broken"
        assert any(e.startswith("shell_broken:") for e in rec.events), rec.events
        assert rec.score_note and "broke its shell" in rec.score_note
    else:
        assert "fifo" in json.dumps(rec.messages)  # the trick took effect
        assert rec.score_note == "tests exceeded the verifier timeout (5 s)"
    assert summary.ok == 1 and summary.pass_rate == 0.0  # in the denominator, not dropped
