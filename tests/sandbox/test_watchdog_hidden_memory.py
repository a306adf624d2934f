"""The watchdog counts everything the instance holds, not only its processes' RSS.

Each attack holds more than the ceiling where the old watchdog looked away (it counted only
processes in the instance's own PID namespace, by their PSS, plus the instance's own tmpfs):

- ``pidns``: the allocation runs in a nested PID namespace (``unshare -rpf``);
- ``memfd``: an unmapped memfd filled with ``fallocate`` (no process's RSS shows it);
- ``tmpfs``: a tmpfs mounted in the agent's own mount namespace (``unshare -rm``), then filled;
- ``sysv``: SysV shared memory segments filled and detached one by one (no process maps them);
- ``pidns_procs``: processes in a nested PID namespace count against the process limit.

``plain`` is the positive control: the same allocation made plainly is killed at the ceiling. Every
attack is killed too, the shell lives, the peak is past the ceiling (the trick really held the
memory), and the instance is left with nothing held. Run on the SIF and on the unpacked tree.
The end-to-end case checks that an episode's record (``peak_mem_mb``, events) shows it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from et_hpc.sandbox.sandbox import Sandbox
from et_hpc.sandbox.watchdog import Watchdog

CEILING_MB = 400
HOLD = "600 << 20"  # what each attack holds, past the ceiling
MAX_PIDS = 32
PY = "python3 -c "

ATTACKS = {
    "plain": PY + f"'import time; x = b\"x\" * ({HOLD}); time.sleep(60)'",
    "pidns": "unshare -rpf " + PY + f"'import time; x = b\"x\" * ({HOLD}); time.sleep(60)'",
    "memfd": PY + f"'import os, time; fd = os.memfd_create(\"m\"); os.posix_fallocate(fd, 0, {HOLD}); time.sleep(60)'",
    "tmpfs": "unshare -rm sh -c 'mount -t tmpfs t /mnt && head -c 600M /dev/zero > /mnt/f && sleep 60'",
    "sysv": PY + "'import ctypes, time\n"
    "c = ctypes.CDLL(None, use_errno=True); c.shmat.restype = ctypes.c_void_p\n"
    "for _ in range(12):\n"
    "    i = c.shmget(0, 50 << 20, 0o1600); a = c.shmat(i, None, 0)\n"
    "    ctypes.memset(ctypes.c_void_p(a), 1, 50 << 20); c.shmdt(ctypes.c_void_p(a))\n"
    "time.sleep(60)'",
    "pidns_procs": "unshare -rpf sh -c 'for i in $(seq 60); do sleep 60 & done; wait'",
}
# What the event says the memory was, beyond the ceiling itself
SEEN_AS = {"memfd": "files held open", "tmpfs": "nested mount namespace", "sysv": "removed the unattached SysV"}


@pytest.fixture(scope="module", params=["sif", "unpacked"])
def sandbox(request: pytest.FixtureRequest, task_sif: Path, tmp_path_factory: pytest.TempPathFactory):
    image = task_sif if request.param == "sif" else request.getfixturevalue("task_tree")
    with Sandbox(image, run_prefix="t-wdh", scratch=tmp_path_factory.mktemp("wdh")) as sb:
        sh = sb.shell()
        assert sb.wait_warmup()
        r = sh.run("unshare -rm sh -c 'mount -t tmpfs t /mnt && echo nested-ok'", timeout=20)
        assert "nested-ok" in r.output, r.output  # the kernel lets the agent nest namespaces here
        yield sb, sh


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_memory_held_anywhere_is_counted_and_killed(attack: str, sandbox) -> None:
    sb, sh = sandbox
    limit = {"max_pids": MAX_PIDS, "memory_mb": None} if attack == "pidns_procs" else {"memory_mb": CEILING_MB}
    with Watchdog(sb, protect=lambda: {sh.host_pid}, on_event=sh.add_note, **limit) as wd:
        r = sh.run(ATTACKS[attack], timeout=60)
        assert r.exit_code is not None and not r.timed_out, r  # killed, not left to run out its minute
        assert "the sandbox's processes were killed" in r.output, r.output
        assert sh.run("echo alive", timeout=10).output == "alive\n"  # the shell lived
    assert len(wd.events) == 1, wd.events
    if attack == "pidns_procs":
        assert "process limit" in wd.events[0] and wd.peak_pids >= MAX_PIDS, wd.events
    else:
        assert "memory ceiling" in wd.events[0], wd.events
        assert wd.peak_kb > CEILING_MB * 1024  # positive control: the trick really held that much
        if attack in SEEN_AS:
            assert SEEN_AS[attack] in wd.events[0], wd.events
    # nothing is left held: a new watchdog measures the instance back near empty
    with Watchdog(sb, memory_mb=CEILING_MB, interval_s=0.05) as after:
        s = after.sample()
    assert s.total_kb < 100 * 1024 and s.held == 0 and s.sysv == 0, s
    assert after.events == []


@pytest.mark.apptainer
def test_episode_record_shows_the_hidden_memory(demo_image, tmp_path: Path) -> None:
    """Through ``et-hpc run``: the memfd held by a replayed command ends the episode as the agent's
    failure (ok, 0.0) with the watchdog's event, and ``peak_mem_mb`` is past the ceiling."""
    from et_hpc.runs.store import open_run
    from helpers.demo import DEMO, TASK

    replay = tmp_path / "replay_summary.json"
    replay.write_text(
        json.dumps(
            {"results": [{"success": False, "messages": [{"role": "assistant", "content": f"<command>{ATTACKS['memfd']}</command>"}]}]}
        )
    )
    (tmp_path / "cwd").mkdir()
    cmd = [
        sys.executable,
        "-m",
        "et_hpc.cli",
        "run",
        str(DEMO),
        "--set",
        f"tasks.ids=[{TASK}]",
        "--run-name",
        "memfd",
        "--store",
        str(tmp_path / "store"),
        "--concurrency",
        "1",
        "--json",
        "--policy",
        "replay",
        "--set",
        f"policy.replay_file={replay}",
        "--set",
        f"sandbox.memory_mb={CEILING_MB}",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path / "cwd", env=os.environ.copy())
    assert r.returncode == 0, r.stderr[-3000:]
    (rec,) = open_run(tmp_path / "store" / "memfd").records()
    assert (rec.status, rec.reward) == ("ok", 0.0), (rec.status, rec.error)
    assert any("memory ceiling" in e and "files held open" in e for e in rec.events), rec.events
    assert rec.peak_mem_mb is not None and rec.peak_mem_mb > CEILING_MB, rec.peak_mem_mb
