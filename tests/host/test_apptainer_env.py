"""The caller's ``APPTAINER_*``/``SINGULARITY_*`` variables never reshape an et-hpc sandbox.

Each case sets variables that apptainer reads in place of a flag (binds, home, overlay, network,
writable, no-mount/contain, env-file, ...), in both spellings. Positive control: a bare
``apptainer instance start`` + ``exec`` given the same variables sees a different container (its
mounts, root, interfaces, environment or writability change) and, where the case names a host
directory, writes into it. Through et-hpc (a ``Sandbox`` started with the variables in
``os.environ``) the container looks exactly as it does without them, and the host directory stays
empty. (For writable-tmpfs, contain and containall et-hpc passes that flag itself: those cases
show that the variable changes nothing, not that it would loosen anything.)
"""

from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path

import pytest

from et_hpc.host import apptainer
from et_hpc.sandbox.sandbox import Sandbox

pytestmark = pytest.mark.apptainer

# What the container looks like, written to stdout; then try to write into every place a host
# directory may have been bound.
PROBE = r"""
if [ "$(readlink /proc/self/ns/net)" = "HOST_NET_NS" ]; then echo "net: the host's"; else echo "net: its own"; fi
echo "root: $(ls -A / | tr '\n' ' ')"
awk '{for (i = 7; i <= NF; i++) if ($i == "-") { split($6, o, ","); print "mount:", $5, $(i + 1), o[1]; break }}' \
    /proc/self/mountinfo | sort
awk 'NR > 2 {print "if:", $1}' /proc/net/dev | sort
env | cut -d= -f1 | grep -v '^_$' | sort | sed 's/^/env: /'
echo "home: $HOME $(ls -A "$HOME" 2>&1 | tr '\n' ' ')"
if touch /opt/.et-w 2>/dev/null; then echo "root-writable"; rm -f /opt/.et-w; else echo "root-read-only"; fi
for d in /srv/leak "$HOME" /tmp /var/tmp /scratch-leak; do touch "$d/pwned-$$" 2>/dev/null; done
true
"""
PROBE = PROBE.replace("HOST_NET_NS", os.readlink("/proc/self/ns/net"))
CONTAINED = ("--containall", "--cleanenv")


def _case(tag: str, host: Path, ov: Path, envf: Path) -> dict[str, str]:
    """The variables of case ``tag`` (APPTAINER_ spelling; SINGULARITY_ is derived)."""
    return {
        "bind": {"APPTAINER_BIND": f"{host}:/srv/leak:rw"},
        "bindpath": {"APPTAINER_BINDPATH": f"{host}:/srv/leak"},
        "mount": {"APPTAINER_MOUNT": f"type=bind,source={host},destination=/srv/leak"},
        "home": {"APPTAINER_HOME": f"{host}:/home/leak"},
        "overlay": {"APPTAINER_OVERLAY": f"{ov}:ro"},
        "network": {"APPTAINER_NET": "1", "APPTAINER_NETWORK": "none"},
        "writable": {"APPTAINER_WRITABLE": "1"},
        "writable-tmpfs": {"APPTAINER_WRITABLE_TMPFS": "1"},
        "no-mount": {"APPTAINER_NO_MOUNT": "tmp,devpts"},
        "contain": {"APPTAINER_CONTAIN": "1"},
        "containall": {"APPTAINER_CONTAINALL": "1"},
        "workdir": {"APPTAINER_WORKDIR": str(host)},
        "scratch": {"APPTAINER_SCRATCH": "/scratch-leak"},
        "env-file": {"APPTAINER_ENV_FILE": str(envf)},
        "env-prefix": {"APPTAINERENV_ET_LEAK": "1"},
    }[tag]


# The bare control's flags: the contain-style cases need a container that is not contained yet
BARE_FLAGS = {"contain": ("--cleanenv",), "containall": ("--cleanenv",), "workdir": ("--contain", "--cleanenv")}
# How et-hpc's sandbox is started for the case: the network case on the host network (with its
# default '--net --network none' no variable could isolate it more); the overlay case without an
# overlay of its own (apptainer lets a flag on the command line win over its variable)
SANDBOX_KW = {"network": {"network_none": False}, "overlay": {"overlay_mb": None}, "writable-tmpfs": {"overlay_mb": None}}
CASES = [
    (t, s)
    for t in (
        "bind",
        "bindpath",
        "mount",
        "home",
        "overlay",
        "network",
        "writable",
        "writable-tmpfs",
        "no-mount",
        "contain",
        "containall",
        "workdir",
        "scratch",
        "env-file",
        "env-prefix",
    )
    for s in ("APPTAINER", "SINGULARITY")
]


def _spelled(env: dict[str, str], spelling: str) -> dict[str, str]:
    return {k.replace("APPTAINER", spelling, 1): v for k, v in env.items()}


def _normal(out: str) -> list[str]:
    return sorted(ln for ln in out.splitlines() if ln.strip())


def _bare(sif: Path, flags: tuple[str, ...], extra: dict[str, str]) -> tuple[int, list[str]]:
    """(exit status of the start, probe output lines) of a bare instance started with ``extra``."""
    env = {**apptainer.clean_env(), **extra}
    name = f"t-envctl-{os.getpid()}-{secrets.token_hex(4)}"
    app = apptainer.binary()
    st = subprocess.run([app, "-s", "instance", "start", *flags, str(sif), name], env=env, capture_output=True, text=True, timeout=120)
    if st.returncode != 0:
        return st.returncode, [st.stderr.strip()[-300:]]
    try:
        cp = subprocess.run(
            [app, "-s", "exec", "--cleanenv", f"instance://{name}", "sh", "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
        )
        return 0, _normal(cp.stdout)
    finally:
        subprocess.run([app, "-s", "instance", "stop", "-t", "0", name], env=env, capture_output=True, timeout=60)


def _sandboxed(sif: Path, scratch: Path, kw: dict) -> list[str]:
    with Sandbox(sif, run_prefix="t-env", scratch=scratch, warm_scoring=False, **kw) as sb:
        cp = sb.exec(["sh", "-c", PROBE], timeout=120)
        assert cp.returncode == 0, cp.stdout
        return _normal(cp.stdout.decode())


@pytest.fixture(scope="module")
def baselines(base_sif: Path, tmp_path_factory: pytest.TempPathFactory):
    """Probe outputs without any variable: bare (per flag set) and through et-hpc (per sandbox kwargs)."""
    scratch = tmp_path_factory.mktemp("env-scratch")
    cache: dict = {}

    def get(kind: str, key: tuple) -> list[str]:
        if (kind, key) not in cache:
            if kind == "bare":
                rc, out = _bare(base_sif, key, {})
                assert rc == 0, out
            else:
                out = _sandboxed(base_sif, scratch, dict(key))
            cache[(kind, key)] = out
        return cache[(kind, key)]

    return get, scratch


@pytest.fixture(scope="module")
def overlay_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A read-only directory overlay that adds /et-overlay-marker to the container's root."""
    d = tmp_path_factory.mktemp("overlay")
    (d / "et-overlay-marker").write_text("from the host\n")
    return d


@pytest.mark.parametrize(("tag", "spelling"), CASES, ids=[f"{s}-{t}" for t, s in CASES])
def test_apptainer_variables_do_not_reshape_the_sandbox(
    tag: str,
    spelling: str,
    base_sif: Path,
    tmp_path: Path,
    baselines,
    overlay_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    get, scratch = baselines
    host = tmp_path / "host-dir"
    host.mkdir()
    host.chmod(0o777)
    envf = tmp_path / "env-file"
    envf.write_text("ET_FROM_ENV_FILE=1\n")
    case = _spelled(_case(tag, host, overlay_dir, envf), spelling)

    # positive control: a bare apptainer honours the variables
    flags = BARE_FLAGS.get(tag, CONTAINED)
    before = get("bare", flags)
    rc, out = _bare(base_sif, flags, case)
    assert rc != 0 or out != before, f"{case} changed nothing of a bare apptainer: the case proves nothing"
    if tag in ("bind", "mount", "workdir"):
        assert list(host.rglob("pwned-*")), f"{case}: the bare control did not write into {host}"
    for p in host.rglob("*"):  # start the et-hpc half from an empty host directory
        if p.is_file():
            p.unlink()

    # through et-hpc: the same variables in our environment change nothing
    kw = SANDBOX_KW.get(tag, {})
    expected = get("et-hpc", tuple(sorted(kw.items())))  # without them
    for k, v in case.items():
        monkeypatch.setenv(k, v)
    assert sorted(case) == [k for k in apptainer.ignored_vars() if k in case]
    assert _sandboxed(base_sif, scratch, kw) == expected
    assert not [p for p in host.rglob("*") if p.is_file()], f"{case}: the sandbox wrote into {host}"


def test_clean_env_keeps_only_the_allowlist() -> None:
    env = {
        "PATH": "/usr/bin",
        "APPTAINER_BINDPATH": "/x",
        "SINGULARITY_BIND": "/y",
        "APPTAINERENV_A": "1",
        "SINGULARITYENV_B": "1",
        "APPTAINER_TMPDIR": "/t",
        "APPTAINER_CACHEDIR": "/c",
        "APPTAINER_CONFIGDIR": "/g",
        "SINGULARITY_CACHEDIR": "/c2",
        "apptainer_bind": "/z",
    }
    out = apptainer.clean_env(env)
    assert out == {"PATH": "/usr/bin", "APPTAINER_TMPDIR": "/t", "APPTAINER_CACHEDIR": "/c", "APPTAINER_CONFIGDIR": "/g"}
    assert apptainer.ignored_vars(env) == sorted(set(env) - set(out))
    assert apptainer.clean_env(env, APPTAINER_TMPDIR="/mine")["APPTAINER_TMPDIR"] == "/mine"
    with pytest.raises(ValueError):
        apptainer.clean_env(env, APPTAINER_BIND="/x")


def test_doctor_names_the_variables_it_ignores(tmp_path: Path) -> None:
    import json
    import sys

    env = {**apptainer.clean_env(), "APPTAINER_BINDPATH": str(tmp_path), "SINGULARITYENV_X": "1"}
    r = subprocess.run([sys.executable, "-m", "et_hpc.cli", "doctor", "--json"], env=env, capture_output=True, text=True, timeout=300)
    check = {c["name"]: c for c in json.loads(r.stdout)}["apptainer environment"]
    assert check["status"] == "WARN" and "APPTAINER_BINDPATH, SINGULARITYENV_X" in check["detail"]
    assert "ignored" in check["detail"] and "sandbox.binds" in check["fix"]
    r = subprocess.run(
        [sys.executable, "-m", "et_hpc.cli", "doctor", "--json"], env=apptainer.clean_env(), capture_output=True, text=True, timeout=300
    )
    assert {c["name"]: c for c in json.loads(r.stdout)}["apptainer environment"]["status"] == "OK"


def test_every_apptainer_call_gets_the_clean_environment(base_sif: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An apptainer wrapper logs the APPTAINER*/SINGULARITY* variables of every call it gets (then
    runs the real one; builds it fails at once): sandbox start, shells, exec, stop, an image build,
    doctor's probe."""
    import shutil

    from et_hpc.host import doctor
    from et_hpc.images import base
    from helpers.images import make_store, make_task

    log = tmp_path / "env.log"
    w = tmp_path / "apptainer"
    w.write_text(
        "#!/bin/sh\n"
        f"{{ echo \"CALL $*\" | cut -c1-60; env | grep -E '^(APPTAINER|SINGULARITY)' | sort; }} >> {log}\n"
        "case \" $* \" in *' build '*) exit 1 ;; esac\n"
        f'exec {shutil.which("apptainer")} "$@"\n'
    )
    w.chmod(0o755)
    monkeypatch.setenv("ET_HPC_APPTAINER", str(w))
    leaked = {"APPTAINER_BINDPATH": str(tmp_path), "SINGULARITY_HOME": "/x", "APPTAINERENV_K": "1", "APPTAINER_NO_MOUNT": "tmp"}
    for k, v in leaked.items():
        monkeypatch.setenv(k, v)
    with Sandbox(base_sif, run_prefix="t-envlog", scratch=tmp_path / "scratch", warm_scoring=False) as sb:
        assert sb.shell().run("true").exit_code == 0
        assert sb.exec(["true"]).returncode == 0
    store = make_store(tmp_path / "cache", base_sif)
    assert store.ensure(make_task(tmp_path / "tasks", "t-env", "%post\n    true\n")).status == "failed"
    assert doctor.apptainer_version() is not None
    assert base._build_env()["APPTAINER_TMPDIR"] and not set(leaked) & set(base._build_env())
    text = log.read_text()
    calls = [ln for ln in text.splitlines() if ln.startswith("CALL")]
    for what in ("instance start", "exec", "build", "--version"):
        assert any(what in c for c in calls), (what, calls)
    assert not [k for k in leaked if k in text], text
    assert "APPTAINER_TMPDIR=" in text  # what et-hpc sets itself for a build
