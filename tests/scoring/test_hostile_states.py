"""States an agent can leave that once broke scoring, live and rescored, on the SIF and the unpacked tree.

Each case runs agent commands in a sandbox whose overlay is kept (as ``sandbox.keep_final_state``
does), scores it live (``score``), then rescores the kept state (``score_kept_state``, what every
``et-hpc rescore`` unit runs). Invariant: status ok both times, the same reward, never an error.
Each case first shows its trick took effect (the positive control): the state's bash runs when a
plain ``apptainer exec`` starts it; the kept image holds the FIFO, the non-UTF-8 bytes, the 1 GB
sparse file; the tests' root shows the surrogate-escaped name. The memory bound is measured on a
rescore in a fresh Python (its peak RSS above a baseline), with a control that the measure sees
an allocation of that size. ``test_hostile_bytes_property`` generates hostile names and contents.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from et_hpc.runner.config import RunConfig
from et_hpc.runner.rescore import score_kept_state
from et_hpc.runs import final_state as fs
from et_hpc.sandbox.sandbox import Sandbox
from et_hpc.scoring import start_check
from et_hpc.scoring.live import score
from et_hpc.tasks.model import Limits

pytestmark = [pytest.mark.apptainer]

FINAL_TEST = textwrap.dedent("""\
    import os, pwd
    from pathlib import Path

    OWNER = pwd.getpwuid(os.getuid()).pw_name  # an NSS lookup, as ownership checks do

    def test_answer():
        assert Path("/home/user/answer.txt").read_text().strip() == "42"

    def test_notes_untouched():
        assert Path("/home/user/notes.txt").read_text() == "keep me\\n"
    """)
ANSWER = "echo 42 > /home/user/answer.txt"
# a bash earlier on the container's PATH that writes the answer, then runs the real one
BASH_FORGE = (
    "mkdir -p /usr/local/bin && printf '#!/bin/sh\\necho 42 > /home/user/answer.txt\\nexec /bin/bash \"$@\"\\n' "
    "> /usr/local/bin/bash && chmod 755 /usr/local/bin/bash"
)
MB = 1 << 20
MEMORY_BOUND_MB = 256


@pytest.fixture(params=["sif", "tree", "cas"])
def image(request: pytest.FixtureRequest, task_sif: Path) -> Path:
    """The task image as a SIF, unpacked as ``sandbox.local_copy: unpack`` does, and as a CAS tree."""
    if request.param == "sif":
        return task_sif
    return request.getfixturevalue("task_tree" if request.param == "tree" else "task_cas_tree")


def _final(tmp: Path, planted: str | None = None) -> Path:
    p = tmp / "test_final_state.py"
    extra = f"\n\ndef test_planted():\n    import glob, os, stat\n    assert {planted}\n" if planted else ""
    p.write_text(FINAL_TEST + extra)
    return p


def _live(image: Path, tmp: Path, commands: list[str], final: Path):
    """Run ``commands`` as the agent, score the state live, and keep it; (live result, run dir, kept value)."""
    run_dir = tmp / "run"
    out: dict[str, str] = {}
    with Sandbox(image, run_prefix="t-hst", scratch=tmp) as sb:
        sb.before_overlay_delete = lambda p: out.setdefault("v", fs.keep(p, run_dir, 64))
        sh = sb.shell()
        runs = [sh.run(c, timeout=120) for c in commands]
        assert all(r.exit_code == 0 for r in runs), [(r.exit_code, r.output[-300:]) for r in runs]
        sc = score(sb, final, timeout_s=60)
    assert fs.digest_of(out.get("v")), out
    return sc, run_dir, out["v"]


def _rescore(image: Path, run_dir: Path, value: str, final: Path):
    task = SimpleNamespace(final_tests=final, limits=Limits())
    return score_kept_state(run_dir, value, task, RunConfig(scoring_timeout_s=60), SimpleNamespace(path=image, digest=None))


def _same(live, re, events, reward: float) -> None:
    """Status ok live and rescored, both with ``reward``."""
    assert live.status == "ok" and live.reward == reward, (live.error, live.note, live.output_tail[-800:])
    assert re.status == "ok" and re.reward == reward, (re.error, re.note, events, re.output_tail[-800:])


def _kept_image(tmp: Path, run_dir: Path, value: str) -> Path:
    img = tmp / "look.img"
    fs.extract(fs.archive_path(run_dir, value), value, img)
    return img


def _dfs_bytes(img: Path, cmd: str, limit: int = MB) -> bytes:
    out, _, _ = start_check.bounded_run([start_check.debugfs(), "-R", cmd, str(img)], limit, 60)
    return out


# -- the forge: a rescore must not run the state's bash -------------------------------------------


def test_state_bash_cannot_forge_a_rescore(image: Path, tmp_path: Path) -> None:
    named = 'pwd.getpwuid(os.getuid()).pw_name == "user"'  # the account is named without a shell too
    final = _final(tmp_path, named.replace("pwd.", "__import__('pwd')."))
    live, run_dir, value = _live(image, tmp_path, [BASH_FORGE], final)
    # positive control: a plain exec of `bash` in the kept state runs the agent's, which writes the answer
    img = _kept_image(tmp_path, run_dir, value)
    with Sandbox(image, run_prefix="t-hst", scratch=tmp_path, overlay_image=img, overlay_readonly=True, warm_scoring=False) as sb:
        assert sb.exec(["bash", "-c", "true"]).returncode == 0
        assert sb.exec(["/bin/cat", "/home/user/answer.txt"]).stdout.strip() == b"42"
    re, events = _rescore(image, run_dir, value, final)
    _same(live, re, events, 0.0)
    for sc in (live, re):
        outcomes = {t.name.split("::")[-1]: t.outcome for t in sc.tests}
        assert outcomes["test_answer"] == "failed" and outcomes["test_planted"] == "passed", (outcomes, sc.output_tail[-800:])


# -- a FIFO, non-UTF-8 bytes, a 1 GB sparse file where the start checks read ----------------------


def test_fifo_nsswitch_scores_live_and_rescored(image: Path, tmp_path: Path) -> None:
    cmds = [ANSWER, "rm -f /etc/nsswitch.conf && mkfifo /etc/nsswitch.conf"]
    live, run_dir, value = _live(image, tmp_path, cmds, _final(tmp_path))
    assert b"Type: FIFO" in _dfs_bytes(_kept_image(tmp_path, run_dir, value), "stat /upper/etc/nsswitch.conf")  # the control
    re, events = _rescore(image, run_dir, value, _final(tmp_path))
    _same(live, re, events, 1.0)
    assert any("/etc/nsswitch.conf was left out" in e for e in events), events


def test_non_utf8_nsswitch_and_preload_target(image: Path, tmp_path: Path) -> None:
    cmds = [
        ANSWER,
        "printf 'passwd: files\\ngroup: files\\nhosts: files\\n# \\377\\376\\n' > /etc/nsswitch.conf",
        "ln -sf $'/tmp/\\xff\\x9b' /etc/ld.so.preload",
    ]
    live, run_dir, value = _live(image, tmp_path, cmds, _final(tmp_path))
    img = _kept_image(tmp_path, run_dir, value)  # the control: bytes text=True cannot decode
    assert b"\xff\xfe" in _dfs_bytes(img, "cat /upper/etc/nsswitch.conf")
    assert b"/tmp/\xff" in _dfs_bytes(img, "stat /upper/etc/ld.so.preload")
    re, events = _rescore(image, run_dir, value, _final(tmp_path))
    _same(live, re, events, 1.0)
    assert any("/etc/ld.so.preload was left out" in e for e in events), events


RSS_PROBE = textwrap.dedent("""\
    import json, resource, sys
    from pathlib import Path
    from types import SimpleNamespace
    from et_hpc.runner.config import RunConfig
    from et_hpc.runner.rescore import score_kept_state
    from et_hpc.tasks.model import Limits
    run_dir, value, final, image, grow = sys.argv[1:6]
    def kb(key):  # this process's own (ru_maxrss keeps the forking parent's peak across exec)
        return int(next(ln for ln in open("/proc/self/status") if ln.startswith(key)).split()[1])
    base = kb("VmRSS:")
    junk = b"x" * (int(grow) << 20)  # the control: an allocation this measure must see, every page written
    task = SimpleNamespace(final_tests=Path(final), limits=Limits())
    sc, ev = score_kept_state(Path(run_dir), value, task, RunConfig(scoring_timeout_s=60), SimpleNamespace(path=Path(image), digest=None))
    peak = kb("VmHWM:")
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(json.dumps({"status": sc.status, "reward": sc.reward, "self_kb": peak - base, "child_kb": kids, "events": ev}))
    """)


def _rss_probe(run_dir: Path, value: str, final: Path, image: Path, grow_mb: int) -> dict:
    cp = subprocess.run(
        [sys.executable, "-c", RSS_PROBE, str(run_dir), value, str(final), str(image), str(grow_mb)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert cp.returncode == 0, cp.stderr[-2000:]
    return json.loads(cp.stdout.strip().splitlines()[-1])


def test_sparse_1gb_nsswitch_rescore_memory_is_bounded(image: Path, tmp_path: Path) -> None:
    cmds = [ANSWER, "truncate -s 1G /etc/nsswitch.conf"]
    live, run_dir, value = _live(image, tmp_path, cmds, _final(tmp_path))
    assert b"Size: 1073741824" in _dfs_bytes(_kept_image(tmp_path, run_dir, value), "stat /upper/etc/nsswitch.conf")  # the control
    got = _rss_probe(run_dir, value, _final(tmp_path), image, 0)
    assert got["status"] == "ok" and got["reward"] == live.reward == 1.0, (got, live.note)
    assert any("/etc/nsswitch.conf was left out" in e for e in got["events"]), got["events"]
    assert got["self_kb"] < MEMORY_BOUND_MB * 1024 and got["child_kb"] < MEMORY_BOUND_MB * 1024, got
    # the measure can fail: the same rescore holding 300 MB more is seen above the bound
    ctl = _rss_probe(run_dir, value, _final(tmp_path), image, 300)
    assert ctl["self_kb"] >= MEMORY_BOUND_MB * 1024, ctl


# -- live scoring: a name that is not UTF-8 in /etc ------------------------------------------------


def test_surrogate_name_in_etc_is_mirrored(image: Path, tmp_path: Path) -> None:
    cmds = [ANSWER, "touch $'/etc/x\\xff' $'/etc/\\x1b[31m\\x9b\\a'"]
    planted = 'os.path.exists(b"/etc/x\\xff") and os.path.exists(b"/etc/\\x1b[31m\\x9b\\x07")'
    live, run_dir, value = _live(image, tmp_path, cmds, _final(tmp_path, planted))
    outcomes = {t.name.split("::")[-1]: t.outcome for t in live.tests}
    assert outcomes.get("test_planted") == "passed", (live.error, live.note, outcomes)  # the control: the tests saw them
    re, events = _rescore(image, run_dir, value, _final(tmp_path, planted))
    _same(live, re, events, 1.0)


# -- the property: any names and contents an agent can make -----------------------------------------

_NAME = st.binary(min_size=1, max_size=12).filter(lambda b: b"/" not in b and b"\0" not in b and b not in (b".", b".."))
_KIND = st.sampled_from(["file", "fifo", "loop", "sparse", "dir", "dangling"])
_DIR = st.sampled_from(["/etc", "/home/user", "/usr/local/bin", "/tmp", "/"])
_ENTRY = st.tuples(_DIR, _NAME, _KIND, st.binary(max_size=40).filter(lambda b: b"\0" not in b))


def _q(b: bytes) -> str:
    return "$'" + "".join(f"\\x{c:02x}" for c in b) + "'"


def _plant(d: str, name: bytes, kind: str, content: bytes) -> str:
    p = _q(d.rstrip("/").encode() + b"/" + name)
    text = _q(content) if content else "''"
    make = {
        "file": f"printf %s {text} > {p}",
        "fifo": f"mkfifo {p}",
        "loop": f"ln -s {p} {p}",
        "sparse": f"truncate -s 64M {p}",
        "dir": f"mkdir {p}",
        "dangling": f"ln -s {_q(b'/nonexistent/' + name)} {p}",
    }[kind]
    return f"{{ rm -rf {p}; {make}; }} 2>/dev/null; true"


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(entries=st.lists(_ENTRY, min_size=1, max_size=4))
def test_hostile_bytes_property(task_sif: Path, tmp_path_factory: pytest.TempPathFactory, entries: list) -> None:
    """Any names and contents placed in a state: live and rescored, status ok, reward 0.0 or 1.0, the same."""
    tmp = tmp_path_factory.mktemp("hostile")
    cmds = [ANSWER, *(_plant(*e) for e in entries)]
    live, run_dir, value = _live(task_sif, tmp, cmds, _final(tmp))
    re, events = _rescore(task_sif, run_dir, value, _final(tmp))
    assert live.status == "ok" and live.reward in (0.0, 1.0), (entries, live.error)
    assert re.status == "ok" and re.reward in (0.0, 1.0), (entries, re.error, events)
    assert live.reward == re.reward, (entries, live.note, re.note, events)
