"""What only several nodes show, part 2: Apptainer's instance registry is per host under the shared
home, et-hpc's instance names never collide across nodes, and `et-hpc reap` on one node never
touches another node's sandboxes, even when their scratch is on a shared path."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from helpers import until
from helpers.rig import NODES, on_node, on_nodes, python

pytestmark = [pytest.mark.slurm, pytest.mark.apptainer]

HOLD = textwrap.dedent("""\
    # on one node: the same apptainer instance name as every other node, plus an et-hpc sandbox;
    # report what this node sees, then hold both until told to stop
    import json, socket, subprocess, sys, time
    from pathlib import Path
    from et_hpc.sandbox.sandbox import Sandbox
    sif, shared, fixed = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    host = socket.gethostname()
    subprocess.run(["apptainer", "-s", "instance", "start", "--containall", str(sif), fixed], check=True)
    with Sandbox(sif, run_prefix="t-rig", scratch=Path("/tmp/et-rig-reg")) as sb:
        sb.shell().run("echo hi")
        (shared / f"ready-{host}").touch()
        while len(list(shared.glob("ready-*"))) < int(sys.argv[4]):
            time.sleep(0.2)
        listed = json.loads(subprocess.run(["apptainer", "instance", "list", "--json"], capture_output=True, text=True, check=True).stdout)
        names = sorted(i["instance"] for i in listed["instances"])
        (shared / f"seen-{host}.json").write_text(json.dumps({"host": host, "sandbox": sb.name, "listed": names}))
        while not (shared / f"release-{host}").exists():
            time.sleep(0.2)
    subprocess.run(["apptainer", "-s", "instance", "stop", fixed], check=True)
    print("stopped", flush=True)
    """)


def _registry(name: str) -> dict[str, list[Path]]:
    """Apptainer's registry files for instance ``name``, by host (the shared home's per-host folders)."""
    app = Path.home() / ".apptainer" / "instances" / "app"
    return {h.name: sorted(h.glob(f"*/{name}/*.json")) for h in app.iterdir() if list(h.glob(f"*/{name}/*.json"))} if app.exists() else {}


def test_instance_names_and_registry_never_collide_across_nodes(demo_image, shared: Path) -> None:
    fixed = f"t-rig-same-{shared.name[-8:]}"
    procs = {n: on_node(n, python(HOLD, str(demo_image.path), str(shared), fixed, str(len(NODES))), shared / f"{n}.out") for n in NODES}
    try:
        until("every node to list its instances", lambda: len(list(shared.glob("seen-*.json"))) == len(NODES), 300)
        seen = {n: json.loads((shared / f"seen-{n}.json").read_text()) for n in NODES}
        sandboxes = {n: s["sandbox"] for n, s in seen.items()}
        assert len(set(sandboxes.values())) == len(NODES), sandboxes  # et-hpc's names differ across nodes
        for n, s in seen.items():
            assert f"-{n}-" in s["sandbox"], s  # ...because each carries its host
            assert fixed in s["listed"] and s["sandbox"] in s["listed"], s  # each node sees its own instances
            others = set(sandboxes.values()) - {s["sandbox"]}
            assert not others & set(s["listed"]), s  # and none of another node's
        # one name, started on three hosts at once: three registry entries, one per host folder
        reg = _registry(fixed)
        assert set(reg) == set(NODES), reg
        # stopping it on one node leaves the other nodes' instances of that name alone
        (shared / f"release-{NODES[0]}").touch()
        assert procs[NODES[0]].wait(timeout=300) == 0, (shared / f"{NODES[0]}.out").read_text()[-3000:]
        reg = _registry(fixed)
        assert set(reg) == set(NODES[1:]), reg
    finally:
        for n in NODES:
            (shared / f"release-{n}").touch()
        for p in procs.values():
            p.wait(timeout=300)
    for n in NODES:
        assert "stopped" in (shared / f"{n}.out").read_text(), (shared / f"{n}.out").read_text()[-3000:]
    assert _registry(fixed) == {}


LEAVE = textwrap.dedent("""\
    # on one node: a worker that dies (SIGKILL) holding a sandbox, and optionally one that lives on
    import json, os, signal, socket, subprocess, sys, time
    from pathlib import Path
    sif, scratch, shared, keep = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4] == "keep"
    host = socket.gethostname()
    worker = '''
    import sys, time
    from pathlib import Path
    from et_hpc.sandbox.sandbox import Sandbox
    with Sandbox(Path(sys.argv[1]), run_prefix="t-rigreap", scratch=Path(sys.argv[2])) as sb:
        sb.shell().run("echo hi > /home/user/f")
        print(sb.name, flush=True)
        while not Path(sys.argv[3]).exists():
            time.sleep(0.2)
    '''
    def start(release):
        p = subprocess.Popen([sys.executable, "-c", worker, sif, scratch, str(release)], stdout=subprocess.PIPE, text=True)
        return p, p.stdout.readline().strip()
    dead, dead_name = start(shared / "never")
    os.kill(dead.pid, signal.SIGKILL)
    dead.wait()
    out = {"host": host, "dead": dead_name}
    if keep:
        live, live_name = start(shared / f"release-{host}")
        out["live"] = live_name
    (shared / f"left-{host}.json").write_text(json.dumps(out))
    if keep:
        live.wait()  # until the test releases it
    """)

STATE = textwrap.dedent("""\
    # on one node: which of our instances run here, and (with 'reap') what `et-hpc reap` did
    import json, socket, subprocess, sys
    scratch, reap = sys.argv[1], sys.argv[2] == "reap"
    out = {"host": socket.gethostname()}
    if reap:
        cmd = [sys.executable, "-m", "et_hpc.cli", "reap", "--scratch", scratch, "--all", "--json"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        out["reap"] = json.loads(r.stdout)
    listed = json.loads(subprocess.run(["apptainer", "instance", "list", "--json"], capture_output=True, text=True, check=True).stdout)
    out["running"] = sorted(i["instance"] for i in listed["instances"])
    print(json.dumps(out))
    """)


def _state(node: str, scratch: Path, folder: Path, reap: bool = False) -> dict:
    folder.mkdir(exist_ok=True)
    text = on_nodes({node: python(STATE, str(scratch), "reap" if reap else "look")}, folder)[node]
    return json.loads(text.strip().splitlines()[-1])


def test_reap_on_one_node_never_touches_another_nodes_sandboxes(demo_image, shared: Path) -> None:
    scratch = shared / "scratch"  # shared on purpose: each node sees the others' registry files and overlays
    a, b = NODES[0], NODES[1]
    leave_a = on_node(a, python(LEAVE, str(demo_image.path), str(scratch), str(shared), "no"), shared / "leave-a.out")
    leave_b = on_node(b, python(LEAVE, str(demo_image.path), str(scratch), str(shared), "keep"), shared / "leave-b.out")
    try:
        assert leave_a.wait(timeout=300) == 0, (shared / "leave-a.out").read_text()[-3000:]
        until(f"{b}'s sandboxes", lambda: (shared / f"left-{b}.json").exists(), 300)
        left = {n: json.loads((shared / f"left-{n}.json").read_text()) for n in (a, b)}
        live_dir = scratch / "live"
        regs = {p.stem for p in live_dir.glob("*.json")}
        # positive control: the dead workers' sandboxes are there, instance and registry file, on both nodes
        assert {left[a]["dead"], left[b]["dead"], left[b]["live"]} <= regs, regs
        assert left[a]["dead"] in _state(a, scratch, shared / "s1")["running"]
        before_b = _state(b, scratch, shared / "s2")["running"]
        assert {left[b]["dead"], left[b]["live"]} <= set(before_b)

        rep = _state(a, scratch, shared / "s3", reap=True)
        assert left[a]["dead"] in rep["reap"]["stopped"], rep
        assert left[a]["dead"] not in rep["running"]
        assert not {left[b]["dead"], left[b]["live"]} & set(rep["reap"]["stopped"] + rep["reap"]["kept"]), rep
        assert not any(left[b]["dead"] in p or left[b]["live"] in p for p in rep["reap"]["deleted"]), rep
        regs = {p.stem for p in live_dir.glob("*.json")}
        assert left[a]["dead"] not in regs and {left[b]["dead"], left[b]["live"]} <= regs, regs
        assert {left[b]["dead"], left[b]["live"]} <= set(_state(b, scratch, shared / "s4")["running"])

        # on its own node the dead one goes and the live one stays
        rep = _state(b, scratch, shared / "s5", reap=True)
        assert left[b]["dead"] in rep["reap"]["stopped"] and left[b]["live"] in rep["reap"]["kept"], rep
        assert left[b]["live"] in rep["running"] and left[b]["dead"] not in rep["running"]
    finally:
        (shared / f"release-{b}").touch()
        leave_b.wait(timeout=300)
