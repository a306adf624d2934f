"""Resource exhaustion without cgroups: limits, the memory watchdog, and a neighbour that is unharmed.

One small image is built on the base image per session. Each attack is a task whose "solution"
(run by the oracle policy, through the agent's real shell) is the attack; its final test reads
``/home/user/x.txt`` and wants ``ok``. Every attack episode runs through ``run_episode`` (real
apptainer instance, watchdog, scoring) with small ceilings, while a second, honest episode runs
beside it in another thread with the default limits and must score 1.0.

Each test first shows that its trick took effect (the event's measured size is past the ceiling,
the fork bomb's count is past the limit, the file really is 100 GB, /dev/shm really filled), then
that the episode is the agent's failure: status ok, reward 0.0, with a watchdog event.
"""

from __future__ import annotations

import re
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from et_hpc.episode.run import run_episode
from et_hpc.host import procfs
from et_hpc.record import EpisodeRecord
from et_hpc.runner.config import RunConfig
from et_hpc.sandbox.sandbox import Sandbox
from et_hpc.sandbox.watchdog import PHASE_AGENT, PHASE_SCORING, Watchdog, instance_init_pid
from et_hpc.tasks.loader import load_tasks
from helpers import build_user_sif

FINAL_TEST = textwrap.dedent("""\
    from pathlib import Path

    def test_x():
        assert Path("/home/user/x.txt").read_text().strip() == "ok"
    """)
# The sparse-file task's test reads lines: a file of zeros has no newline, so the line grows as
# it is read (Path.read_text would ask for the whole size at once and get MemoryError).
FINAL_TEST_LINES = textwrap.dedent("""\
    def test_x():
        with open("/home/user/x.txt") as f:
            assert [line.strip() for line in f.readlines()] == ["ok"]
    """)

ATTACKS = {
    "good": "echo ok > /home/user/x.txt",
    "devzero": "ln -s /dev/zero /home/user/x.txt",
    "sparse": "truncate -s 100G /home/user/x.txt; stat -c 'SIZE=%s BLOCKS=%b' /home/user/x.txt",
    "shm": "dd if=/dev/zero of=/dev/shm/fill bs=1M count=8000 2>&1 | tail -1; ls -l /dev/shm",
    "forkbomb": "bomb() { bomb | bomb & }; bomb; sleep 60",
    "hog": "python3 -c 'import time; x = b\"x\" * (6 << 30); time.sleep(60)'",
}
CEILING_MB = 1024
MAX_PIDS = 128


@pytest.fixture(scope="session")
def limits_sif(base_sif: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_user_sif(base_sif, tmp_path_factory.mktemp("limits-image"))


@pytest.fixture(scope="session")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("limits-tasks")
    for name, script in ATTACKS.items():
        t = root / f"limits_{name}"
        (t / "solution").mkdir(parents=True)
        (t / "task.json").write_text(f'{{"name": "limits_{name}", "description": "Write ok to /home/user/x.txt."}}')
        (t / "container.def").write_text("Bootstrap: localimage\nFrom: ./ubuntu_22.04.sif\n")
        (t / "solution" / "solve.sh").write_text(f"#!/bin/bash\n{script}\n")
        (t / "test_final_state.py").write_text(FINAL_TEST_LINES if name == "sparse" else FINAL_TEST)
    return {t.id.removeprefix("limits_"): t for t in load_tasks(str(root), progress=False).tasks}


def _cfg(name: str, **sandbox) -> RunConfig:
    return RunConfig(name=name, policy={"kind": "oracle"}, sandbox=sandbox, scoring_timeout_s=120)


def _side_by_side(tasks: dict, sif: Path, attack: str, **sandbox) -> tuple[EpisodeRecord, EpisodeRecord]:
    """The attack episode (small ceilings) and an honest one with the defaults, started together."""
    image = SimpleNamespace(path=sif, digest="sha256:limits")
    go = threading.Barrier(2)

    def one(task, cfg):
        go.wait()
        return run_episode(task, 0, cfg, image)

    with ThreadPoolExecutor(2) as ex:
        bad = ex.submit(one, tasks[attack], _cfg(f"lim-{attack}", memory_mb=CEILING_MB, max_pids=MAX_PIDS, **sandbox))
        good = ex.submit(one, tasks["good"], _cfg(f"lim-good-{attack}"))
        return bad.result(), good.result()


def _mb(event: str) -> int:
    m = re.search(r"reached \((\d+) (MB|processes)", event)
    assert m, event
    return int(m.group(1))


def _tool_output(rec: EpisodeRecord) -> str:
    return "\n".join(str(m.get("content")) for m in rec.messages if m["role"] in ("tool", "user"))


def _assert_neighbour_fine(good: EpisodeRecord) -> None:
    assert good.status == "ok" and good.reward == 1.0, (good.status, good.error, good.score_note)
    assert not good.events, good.events


def _assert_agent_failure(bad: EpisodeRecord) -> None:
    assert bad.status == "ok" and bad.reward == 0.0, (bad.status, bad.error, bad.score_note, bad.events)
    assert bad.error is None


def _stopped(tasks: dict, sif: Path, attack: str, what: str, phase: str, **sandbox) -> tuple[EpisodeRecord, str]:
    """``attack`` beside an honest episode: the neighbour is unharmed, the agent gets its 0, and the
    first event naming ``what`` came in ``phase``; returns the attack's record and that event."""
    bad, good = _side_by_side(tasks, sif, attack, **sandbox)
    _assert_neighbour_fine(good)
    _assert_agent_failure(bad)
    ev = [e for e in bad.events if what in e]
    assert ev and phase in ev[0], bad.events
    return bad, ev[0]


def test_final_test_reading_a_symlink_to_dev_zero(limits_sif: Path, tasks: dict) -> None:
    bad, ev = _stopped(tasks, limits_sif, "devzero", "memory ceiling", PHASE_SCORING, vmem_mb=65536)
    assert _mb(ev) > CEILING_MB  # the test's process really grew past the ceiling
    assert bad.score_note  # says why the tests did not finish


def test_a_100_gb_sparse_file_is_refused_by_the_file_size_limit(limits_sif: Path, tasks: dict) -> None:
    bad, good = _side_by_side(tasks, limits_sif, "sparse")  # default fsize_mb (4096)
    _assert_neighbour_fine(good)
    _assert_agent_failure(bad)
    assert "File size limit exceeded" in _tool_output(bad)  # SIGXFSZ
    assert "SIZE=107374182400" not in _tool_output(bad)


def test_a_100_gb_sparse_file_read_by_the_tests(limits_sif: Path, tasks: dict) -> None:
    # file size limit lifted so that the file can be made: the watchdog must stop the reading test
    bad, ev = _stopped(tasks, limits_sif, "sparse", "memory ceiling", PHASE_SCORING, fsize_mb=200_000, vmem_mb=65536)
    out = _tool_output(bad)
    assert "SIZE=107374182400" in out and "BLOCKS=0" in out  # positive control: it is 100 GB, sparse
    assert _mb(ev) > CEILING_MB, bad.events


def test_filling_dev_shm(limits_sif: Path, tasks: dict) -> None:
    bad, ev = _stopped(tasks, limits_sif, "shm", "memory ceiling", PHASE_AGENT)
    m = re.search(r"tmpfs (\d+) MB", ev)
    assert m and int(m.group(1)) > CEILING_MB * 0.9, ev  # /dev/shm itself really filled
    assert "emptied /dev/shm" in ev
    assert "Killed" in _tool_output(bad) and "memory ceiling" in _tool_output(bad)  # the agent is told


def test_fork_bomb(limits_sif: Path, tasks: dict) -> None:
    _, ev = _stopped(tasks, limits_sif, "forkbomb", "process limit", PHASE_AGENT)
    assert _mb(ev) >= MAX_PIDS  # the bomb really spawned that many processes
    assert int(re.search(r"killed (\d+) processes", ev).group(1)) >= MAX_PIDS


def test_memory_hog(limits_sif: Path, tasks: dict) -> None:
    bad, ev = _stopped(tasks, limits_sif, "hog", "memory ceiling", PHASE_AGENT, vmem_mb=65536)
    assert _mb(ev) > CEILING_MB, bad.events
    assert "Killed" in _tool_output(bad)


# -- the watchdog and the shell limits on their own -------------------------------------------


def test_watchdog_spares_the_shell_and_sees_only_its_instance(limits_sif: Path, tmp_path: Path) -> None:
    with (
        Sandbox(limits_sif, run_prefix="t-lim", scratch=tmp_path) as sb,
        Sandbox(limits_sif, run_prefix="t-lim", scratch=tmp_path) as other,
    ):
        sh, osh = sb.shell(), other.shell()
        assert sb.wait_warmup() and other.wait_warmup()  # the scoring warm-up is not counted below
        osh.run("sleep 120 &", timeout=10)
        assert instance_init_pid(sb.name) == sb.init_process()[0]
        with Watchdog(sb, memory_mb=CEILING_MB, max_pids=MAX_PIDS, protect=lambda: {sh.host_pid}, on_event=sh.add_note) as wd:
            r = sh.run("python3 -c 'import time; x = b\"x\" * (3 << 30); time.sleep(60)'", timeout=60)
            assert r.exit_code == 137 and "memory ceiling" in r.output, r
            assert wd.peak_kb > CEILING_MB * 1024  # positive control: it did grow past the ceiling
            assert sh.run("echo alive", timeout=10).output == "alive\n"  # the shell lived
        assert len(wd.events) == 1 and "killed 1 processes" in wd.events[0], wd.events
        ons = procfs.pid_ns(other.init_process()[0])
        assert len(procfs.ns_members(ons, {other.init_process()[0]})) == 2  # its shell and sleep live


def test_shell_limits(limits_sif: Path, tmp_path: Path) -> None:
    with Sandbox(limits_sif, run_prefix="t-lim", scratch=tmp_path, fsize_mb=None) as open_sb:
        r = open_sb.shell().run("truncate -s 100G big && stat -c %s big", timeout=20)
        assert r.output.strip() == "107374182400"  # positive control: without the limit it works
    with Sandbox(limits_sif, run_prefix="t-lim", scratch=tmp_path, fsize_mb=64) as sb:
        sh = sb.shell()
        assert sh.run("ulimit -f; ulimit -c", timeout=10).output.split() == [str(64 * 1024), "0"]
        r = sh.run("truncate -s 100G big; dd if=/dev/zero of=f bs=1M count=100 2>&1 | tail -1; stat -c %s f", timeout=30)
        assert "File size limit exceeded" in r.output and r.output.strip().endswith(str(64 << 20)), r.output


def test_watchdog_cost_is_measured(limits_sif: Path, tmp_path: Path) -> None:
    with Sandbox(limits_sif, run_prefix="t-lim", scratch=tmp_path) as sb:
        sh = sb.shell()
        sh.run("for i in $(seq 20); do sleep 300 & done", timeout=20)
        with Watchdog(sb, interval_s=0.05) as wd:
            t = time.monotonic()
            while wd.polls < 20 and time.monotonic() - t < 60:
                time.sleep(0.05)
        assert wd.polls >= 20 and wd.peak_pids >= 21 and not wd.events
        assert wd.tmpfs_ok and wd.poll_s > 0
