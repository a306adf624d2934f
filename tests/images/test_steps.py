"""Step builds (et_hpc.images.steps): where recipes are cut, what a step's key depends on, and, on
real apptainer, that a stepped root is the whole build's root, that steps are reused, and that a
step that fails leaves the verdict to the whole build."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from et_hpc.images import build, cas, steps
from et_hpc.images.keys import DigestCache
from et_hpc.images.store import ImageStore
from et_hpc.images.store_gc import gc
from et_hpc.tasks.dockerfile import convert_dockerfile
from et_hpc.tasks.loader import load_tasks
from et_hpc.tasks.recipe import normalise_def as normalise_def_file
from helpers import FIXTURES
from helpers.demo import DEMO

BASE = Path("/cache/base/ubuntu_22.04.sif")
BASES = {"ubuntu:22.04": BASE, "./ubuntu_22.04.sif": BASE}
HARBOR_TASK = FIXTURES / "harbor" / "task_000000_0b20fa4e"


# -- planning, without apptainer -------------------------------------------------------------
WORD = st.text(alphabet="abcdefghij", min_size=1, max_size=6)
INSTR = st.one_of(
    st.tuples(st.just("RUN"), WORD),
    st.tuples(st.just("ENV"), WORD),
    st.tuples(st.just("WORKDIR"), WORD),
    st.tuples(st.just("LABEL"), WORD),
)


def _dockerfile(instrs: list[tuple[str, str]], blank_lines: int = 0, install: bool = True) -> str:
    out = ["FROM ubuntu:22.04", *[""] * blank_lines]
    for i, (cmd, w) in enumerate(instrs):
        if cmd == "RUN":
            out.append(f'RUN echo "{w} $V{i}" > /out-{i} && pwd >> /out-{i}' + (" && apt-get install -y jq" if install else ""))
        elif cmd == "ENV":
            out.append(f"ENV V{i}={w}")
        elif cmd == "WORKDIR":
            out.append(f"WORKDIR /w/{w}")
        else:
            out.append(f"LABEL k{i}={w}")
    return "\n".join(out) + "\n"


def _plan(tmp: Path, text: str) -> tuple[steps.Plan, list[str]]:
    df = tmp / "Dockerfile"
    df.write_text(text)
    p = steps.plan(convert_dockerfile(df, base_map=BASES))
    assert p is not None
    return p, steps.step_keys(p, "0" * 64, DigestCache())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(instrs=st.lists(INSTR, max_size=8))
def test_a_dockerfile_is_cut_at_each_run_with_the_state_before_it(tmp_path: Path, instrs: list[tuple[str, str]]) -> None:
    p, keys = _plan(tmp_path, _dockerfile(instrs))
    runs = [i for i, (c, _) in enumerate(instrs) if c == "RUN"]
    assert len(p.steps) == max(1, len(runs)) == len(keys) == len(set(keys))
    for s, i in zip(p.steps, runs):
        script = "\n".join(s.script)
        assert f"/out-{i}" in script and all(f"/out-{j}" not in script for j in runs if j != i)
        # the shell state every earlier instruction left: its exports, and the last WORKDIR as cwd
        for j, (c, w) in enumerate(instrs[:i]):
            if c == "ENV":
                assert f"export V{j}={w}" in script
        wd = [w for c, w in instrs[:i] if c == "WORKDIR"]
        if wd:
            runs_at = next(n for n, ln in enumerate(s.script) if ln.endswith("/.et-hpc-run.sh </dev/null"))
            last_cd = [ln for ln in s.script[:runs_at] if re.search(r"(^| )cd /w/", ln)][-1]
            assert last_cd.endswith(f"cd /w/{wd[-1]}")
        # a step's own WORKDIR is made by the step that follows it, later steps only cd into it
        made = [ln for ln in s.script if ln.startswith("mkdir -p /w/")]
        k = runs.index(i)
        mine = instrs[(runs[k - 1] + 1 if k else 0) : i] + (instrs[i + 1 :] if k == len(runs) - 1 else [])
        own = [w for c, w in mine if c == "WORKDIR"]  # the last step also runs what follows the last RUN
        assert [m.split()[2] for m in made] == [f"/w/{w}" for w in own]
    assert "rm -rf /.et-hpc-run.sh" in p.steps[-1].script[-1]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(instrs=st.lists(INSTR, max_size=8), installs=st.lists(st.booleans(), min_size=8, max_size=8))
def test_what_follows_the_last_install_is_one_step(tmp_path: Path, instrs: list[tuple[str, str]], installs: list[bool]) -> None:
    text = "\n".join(
        ln + (" && pip3 install x" if ln.startswith("RUN") and installs[n % 8] else "")
        for n, ln in enumerate(_dockerfile(instrs, install=False).splitlines())
    )
    p, _ = _plan(tmp_path, text + "\n")
    run_lines = [ln for ln in text.splitlines() if ln.startswith("RUN")]
    last = max((i for i, ln in enumerate(run_lines) if "pip3 install" in ln), default=-1)
    assert len(p.steps) == max(1, (last + 1) + (1 if len(run_lines) > last + 1 else 0))
    # the merged step runs every RUN after the last install, in order, each in its own shell
    body = "\n".join(p.steps[-1].script)
    outs = [int(m) for m in re.findall(r"/out-(\d+) &&", body)]
    assert outs == sorted(outs) and len(set(outs)) == (len(run_lines) - last - 1 if len(run_lines) - last - 1 > 1 else 1) or not run_lines
    assert body.count("/.et-hpc-run.sh </dev/null") == max(1, len(run_lines) - last - 1) if run_lines else True


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(a=st.lists(INSTR, max_size=6), b=st.lists(INSTR, max_size=6), c=st.lists(INSTR, max_size=6), blanks=st.integers(0, 3))
def test_a_steps_key_is_its_parent_and_its_text(tmp_path: Path, a: list, b: list, c: list, blanks: int) -> None:
    """Recipes that share their first instructions share the keys of the steps those make (line
    numbers and blank lines aside); from the first step that differs, every key differs."""
    a = [*a, ("RUN", "shared")]
    (tmp_path / "1").mkdir(exist_ok=True)
    (tmp_path / "2").mkdir(exist_ok=True)
    p1, k1 = _plan(tmp_path / "1", _dockerfile([*a, *b]))
    p2, k2 = _plan(tmp_path / "2", _dockerfile([*a, *c], blank_lines=blanks))
    shared = sum(1 for x, _ in a if x == "RUN")
    rest_b = [x for x in b if x[0] == "RUN"] or [None]
    rest_c = [x for x in c if x[0] == "RUN"] or [None]
    # the shared prefix's steps: equal, except the last one when nothing follows it in one of them
    # (the last step carries the clean-up and the sections after %post)
    same_until = shared if (rest_b != [None] and rest_c != [None]) else shared - 1
    assert k1[:same_until] == k2[:same_until]
    if _dockerfile(b) != _dockerfile(c):
        first = next((i for i in range(min(len(k1), len(k2))) if k1[i] != k2[i]), None)
        if first is not None:
            assert all(x != y for x, y in zip(k1[first:], k2[first:]))  # a changed parent changes every later key


CUTTABLE = st.lists(
    st.sampled_from(
        [
            "apt-get update",
            "apt-get install -y jq",
            "pip3 install pytest",
            "DEBIAN_FRONTEND=noninteractive apt-get install -y rsync",
            "apt install -y git",
        ]
    ),
    min_size=1,
    max_size=3,
).map(" && ".join)
NOT_CUTTABLE = st.sampled_from(
    [
        "cd /opt && apt-get install -y jq",
        "apt-get install -y $PKGS",
        "pip3 install -r /req.txt > /log",
        "apt-get install -y jq | tee /log",
        "apt-get install -y jq; rm -rf /x",
        "X=1",
        "mkdir -p /home/user",
        "cat <<EOF > /f",
        "(apt-get install -y jq)",
        "apt-get install -y `cat /p`",
        "apt-get install -y jq &",
        "useradd -m user",
    ]
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    installs=st.lists(CUTTABLE, max_size=3),
    stop=NOT_CUTTABLE,
    tail=st.lists(st.sampled_from(["echo a > /a", "pip3 install x", "cd /tmp"]), max_size=3),
    export=st.booleans(),
)
def test_a_native_post_is_cut_only_after_plain_installs(
    tmp_path: Path, installs: list[str], stop: str, tail: list[str], export: bool
) -> None:
    assert steps.install_tokens(stop) is None
    lines = (
        (["    export DEBIAN_FRONTEND=noninteractive"] if export else [])
        + [f"    {x}" for x in installs]
        + ["", "    # the task", f"    {stop}", *[f"    {t}" for t in tail]]
    )
    d = tmp_path / "container.def"
    d.write_text("Bootstrap: localimage\nFrom: ./ubuntu_22.04.sif\n\n%post\n" + "\n".join(lines) + "\n\n%runscript\n    exec bash\n")
    p = steps.plan(normalise_def(d))
    assert p is not None
    assert len(p.steps) == len(installs) + 1
    for s, x in zip(p.steps, installs):
        assert s.script[-1] == x and steps.install_tokens(x) is not None
        assert s.script[:-1] == (["export DEBIAN_FRONTEND=noninteractive"] if export else [])
    rest = p.steps[-1]
    # everything from the first line that is not a plain install runs as written, in one shell
    ran = [ln for ln in rest.script if ln.strip()]
    assert ran[-(len(tail) + 1) :] == [f"    {stop}", *[f"    {t}" for t in tail]]
    assert rest.tail[0] == "%runscript"


def normalise_def(d: Path):
    return normalise_def_file(d, None, BASES)


def test_a_def_that_cannot_be_cut_is_built_whole(tmp_path: Path) -> None:
    for extra in ("%setup\n    touch $APPTAINER_ROOTFS/x\n", "%appinstall foo\n    echo\n"):
        d = tmp_path / "container.def"
        d.write_text(f"Bootstrap: localimage\nFrom: ./ubuntu_22.04.sif\n\n{extra}\n%post\n    apt-get install -y jq\n")
        assert steps.plan(normalise_def(d)) is None
    d.write_text("Bootstrap: localimage\nFrom: ./ubuntu_22.04.sif\n\n%post\n    apt-get install -y jq\n")
    assert steps.plan(normalise_def(d)) is not None  # positive control


# -- on real apptainer ------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _remove_kept_roots(tmp_path: Path):
    """Kept step roots hold files of subordinate ids, which only a user namespace can remove."""
    yield
    build.remove_tree(tmp_path / "scratch")


# ':' ignores its arguments: a RUN that reads as a package install, so the recipe is cut there as
# docker would, without the network (steps after the last install are merged into one)
NOOP_INSTALL = ": apt-get install &&"


def _stores(base_sif: Path, tmp: Path) -> tuple[ImageStore, ImageStore]:
    """A CAS store with step builds and a SIF store, on the same base (so the defs are the same)."""
    bases = ImageStore().base_map
    return ImageStore(tmp / "cas", layout="cas", base_map=bases, scratch=tmp / "scratch"), ImageStore(tmp / "whole", base_map=bases)


def _harbor_task(root: Path, name: str, dockerfile: str, context: dict[str, str] | None = None):
    d = root / name
    shutil.copytree(HARBOR_TASK, d)
    (d / "environment" / "Dockerfile").write_text(dockerfile)
    for rel, text in (context or {}).items():
        (d / "environment" / rel).write_text(text)
    return next(t for t in load_tasks(str(root)).tasks if t.id == name)


def _roots(cas_store: ImageStore, stepped, sif: Path, tmp: Path) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """The stepped and the whole build's root, entry by entry, provenance named alike."""
    return cas.manifest_view(cas_store.cache_dir, stepped.digest), cas.sif_view(sif, scratch=tmp)


def _meta(store: ImageStore, key: str) -> dict:
    return json.loads(store.meta_path(key).read_text())


@pytest.mark.apptainer
def test_a_stepped_root_is_the_whole_builds_root(base_sif: Path, tmp_path: Path) -> None:
    """The demo tasks (native defs), and a Dockerfile that uses ENV, ARG, WORKDIR, USER, COPY and
    a heredoc RUN: built step by step and whole, the roots are the same file for file (contents,
    modes, owners, links), but for the build date in labels.json, which no two builds share."""
    cas_store, whole = _stores(base_sif, tmp_path)
    tasks = list(load_tasks(str(DEMO)).tasks)
    rich = _harbor_task(
        tmp_path / "tasks",
        "rich",
        "FROM ubuntu:22.04\n"
        "ARG GREETING=hello\n"
        "ENV APP_HOME=/srv/app MODE=test\n"
        f"RUN {NOOP_INSTALL} useradd -m -u 1234 runner && mkdir -p $APP_HOME\n"
        "WORKDIR /srv/app\n"
        "COPY notes.txt ./\n"
        f'RUN {NOOP_INSTALL} echo "$GREETING $MODE $(pwd)" > state.txt && chmod 640 state.txt\n'
        "USER runner\n"
        f"RUN {NOOP_INSTALL} touch /home/runner/mine && id -u > /home/runner/uid\n"
        "USER root\n"
        "WORKDIR sub\n"
        "RUN <<EOF\n"
        "pwd > /srv/app/where\n"
        "ln -s /srv/app/state.txt /srv/app/link\n"
        "EOF\n"
        'CMD ["/bin/bash"]\n',
        {"notes.txt": "copied in\n"},
    )
    default = ImageStore()  # the demo tasks' SIFs: built once per cache (other tests use them too)
    for t in [*tasks, rich]:
        stepped = cas_store.ensure(t)
        assert stepped.status == "built" and stepped.digest, stepped.reason
        meta = _meta(cas_store, stepped.key)
        assert meta["steps_built"] == meta["steps"] >= 1, meta  # built step by step, not whole
        sif = (whole if t is rich else default).ensure(t)
        assert sif.status in ("built", "cached") and sif.path, sif.reason
        a, b = _roots(cas_store, stepped, Path(sif.path), tmp_path)
        assert cas.differing(a, b) == [], t.id
    rich_meta = _meta(cas_store, cas_store.lookup(rich).key)
    assert rich_meta["steps"] == 5  # one per RUN and COPY
    ents = {e["p"]: e for e in cas.read_manifest(cas_store.cache_dir, cas_store.lookup(rich).digest)}
    assert ents["home/runner/mine"]["u"] == 1234 and ents["srv/app/state.txt"]["m"] == 0o640  # owners and modes kept
    assert b"".join(cas.read_object(cas_store.cache_dir, ents["srv/app/where"]["h"])) == b"/srv/app/sub\n"


# every fixture task in the long tier (scripts/test --long: three builds each, 1-5 min on 2 cores);
# in CI the first native fixture, whose first whole build other tests share
ALL_FIXTURES = [(k, p.name) for k in ("native", "harbor") for p in sorted((FIXTURES / k).iterdir()) if p.is_dir()]
FIXTURE_TASKS = ALL_FIXTURES if os.environ.get("ET_HPC_LONG") == "1" else ALL_FIXTURES[:1]


@pytest.mark.apptainer
@pytest.mark.parametrize(("kind", "tid"), FIXTURE_TASKS, ids=[t for _, t in FIXTURE_TASKS])
def test_a_stepped_fixture_root_differs_from_a_whole_build_only_where_two_whole_builds_do(
    kind: str, tid: str, base_sif: Path, tmp_path: Path
) -> None:
    """A real task's recipe installs packages, and some files come out different from every build
    (apt's caches and logs, ldconfig's cache, pip's .pyc files, random test data): the task built
    step by step differs from its whole build only at paths where a second whole build differs
    from the first too."""
    task = next(t for t in load_tasks(str(FIXTURES / kind)).tasks if t.id == tid)
    cas_store, whole = _stores(base_sif, tmp_path)
    stepped, first, second = cas_store.ensure(task), ImageStore().ensure(task), whole.ensure(task)
    if first.status == "failed":  # a recipe that needs a host this machine cannot reach: no root either way
        assert stepped.status == second.status == "failed", (stepped.reason, second.reason)
        return
    assert stepped.status == "built" and first.path and second.status == "built" and second.path, (stepped.reason, second.reason)
    meta = _meta(cas_store, stepped.key)
    assert meta["steps_built"] == meta["steps"], meta
    a = cas.manifest_view(cas_store.cache_dir, stepped.digest)
    b1, b2 = (cas.sif_view(Path(r.path), scratch=tmp_path) for r in (first, second))
    noise, diff = set(cas.differing(b1, b2)), set(cas.differing(a, b1))
    assert len(noise) * 5 < len(a) and diff <= noise, (sorted(noise)[:50], sorted(diff - noise))
    # positive control: one mode bit of a file the builds agree on is seen
    p = next(p for p, f in sorted(a.items()) if f[0] == "f" and p not in noise and p.startswith("usr/"))
    assert set(cas.differing({**a, p: (a[p][0], a[p][1] ^ 1, *a[p][2:])}, b1)) == diff | {p}


@pytest.mark.apptainer
def test_steps_are_reused_and_a_recipe_whose_steps_exist_builds_none(base_sif: Path, tmp_path: Path) -> None:
    cas_store, whole = _stores(base_sif, tmp_path)
    head = (
        f"FROM ubuntu:22.04\nRUN {NOOP_INSTALL} useradd -m user && mkdir -p /home/user/data && chown user /home/user/data\n"
        f"ENV LANG=C.UTF-8\nRUN {NOOP_INSTALL} echo shared > /home/user/data/common\n"
    )
    first = _harbor_task(tmp_path / "a", "first", head + "RUN echo one > /home/user/data/own\n")
    second = _harbor_task(tmp_path / "b", "second", head + "RUN echo two > /home/user/data/own\n")
    # the same steps, other line numbers (so another recipe text and image key)
    again = _harbor_task(tmp_path / "c", "again", head.replace("\nRUN", "\n\n# a comment\nRUN") + "RUN echo two > /home/user/data/own\n")
    r1, r2, r3 = (cas_store.ensure(t) for t in (first, second, again))
    assert len({r1.key, r2.key, r3.key}) == 3
    m1, m2, m3 = (_meta(cas_store, r.key) for r in (r1, r2, r3))
    assert (m1["steps_built"], m1["steps_reused"]) == (3, 0)
    assert (m2["steps_built"], m2["steps_reused"]) == (1, 2)  # only its own last step
    assert (m3["steps_built"], m3["steps_reused"]) == (0, 3) and r3.digest == r2.digest  # nothing to build
    assert "every step is built already" in Path(r3.log_path).read_text()
    assert "step 2's root is on this node" in Path(r2.log_path).read_text()  # kept by the first build
    # the reused steps' files are stored once: the second image added only its own files
    assert m2["new_bytes"] < 4096 and m1["new_bytes"] > 1_000_000
    # gc keeps what built steps name, so a later recipe still starts from them
    aside = tmp_path / "steps-aside"
    shutil.move(cas_store.cache_dir / "steps", aside)
    assert gc(cas_store, set(), min_age_s=0, dry_run=True).cas_files > 0  # positive control: without the step records, gc would sweep
    shutil.move(aside, cas_store.cache_dir / "steps")
    res = gc(cas_store, set(), min_age_s=0)
    assert len(res.removed) == 3 and res.cas_files == 0  # the images go; what the steps name stays
    fourth = _harbor_task(tmp_path / "d", "fourth", head + "RUN echo four > /home/user/data/own\n")
    build.remove_tree(tmp_path / "scratch" / "step-roots")  # a node that has not seen these steps
    r4 = cas_store.ensure(fourth)
    assert "step 2's root made here" in Path(r4.log_path).read_text()
    m4 = _meta(cas_store, r4.key)
    assert r4.status == "built" and (m4["steps_built"], m4["steps_reused"]) == (1, 2), m4
    # its parent's root was made again from the store, in a user namespace: the same root as a
    # whole build's, owners and all
    sif = whole.ensure(fourth)
    assert sif.status == "built" and sif.path, sif.reason
    a, b = _roots(cas_store, r4, Path(sif.path), tmp_path)
    assert cas.differing(a, b) == []
    ents = {e["p"]: e for e in cas.read_manifest(cas_store.cache_dir, r4.digest)}
    first_ents = {e["p"]: e for e in cas.read_manifest(cas_store.cache_dir, r1.digest)}
    assert first_ents["home/user/data"]["u"] == 1000 and ents["home/user/data"]["u"] == 1000 and ents["home/user/data/common"]["u"] == 0


@pytest.mark.apptainer
def test_a_step_that_fails_leaves_the_verdict_to_the_whole_build(base_sif: Path, tmp_path: Path) -> None:
    cas_store, _ = _stores(base_sif, tmp_path)
    # a WORKDIR a later RUN removes: docker and the whole build go on in the removed directory;
    # the step after it cannot cd there, so the whole build decides, and it succeeds
    odd = _harbor_task(
        tmp_path / "a",
        "odd",
        f"FROM ubuntu:22.04\nWORKDIR /gone\nRUN {NOOP_INSTALL} echo x > /kept\n"
        f"RUN {NOOP_INSTALL} rm -rf /gone\nRUN {NOOP_INSTALL} echo y > /after\n",
    )
    r = cas_store.ensure(odd)
    assert r.status == "built", r.reason
    log = Path(r.log_path).read_text()
    assert "step build failed" in log and "building the whole recipe" in log
    assert "steps" not in _meta(cas_store, r.key)  # the whole build's image
    ents = {e["p"] for e in cas.read_manifest(cas_store.cache_dir, r.digest)}
    assert {"kept", "after"} <= ents and "gone" not in ents
    # a recipe that fails: failed, with the whole build's reason, and its good first step kept
    bad = _harbor_task(
        tmp_path / "b", "bad", f"FROM ubuntu:22.04\nRUN {NOOP_INSTALL} echo ok > /ok\nRUN {NOOP_INSTALL} echo nope >&2 && false\n"
    )
    r = cas_store.ensure(bad)
    assert r.status == "failed" and r.reason, r
    assert "step build failed" in Path(r.log_path).read_text()
    p = steps.plan(cas_store.normalised(bad))
    assert p is not None
    k = steps.step_keys(p, cas_store.base_digest(Path(cas_store.normalised(bad).base)), DigestCache())
    assert steps.stored_manifest(cas_store.cache_dir, k[0]) is not None and steps.stored_manifest(cas_store.cache_dir, k[1]) is None
    assert json.loads(cas_store.failed_path(r.key).read_text())["reason"] == r.reason


def test_kept_roots_are_evicted_oldest_first_and_never_while_held(tmp_path: Path) -> None:
    import os
    import time

    roots = steps.Roots(tmp_path, keep=1)
    for n, k in enumerate(("a" * 64, "b" * 64, "c" * 64)):
        with roots.hold(k) as p:
            src = tmp_path / f"src-{k[0]}"
            (src / "etc").mkdir(parents=True)
            roots.keep(src, p)
        os.utime(roots.dir / f"{k}.lock", (time.time() - 100 + n, time.time() - 100 + n))
    with roots.hold("a" * 64) as held:  # the oldest, but in use
        os.utime(roots.dir / f"{'a' * 64}.lock", (time.time() - 200, time.time() - 200))
        roots.evict()
        assert held.is_dir()
    assert sorted(p.name[0] for p in roots.dir.iterdir() if p.is_dir()) == ["a", "c"]  # b went: unheld, older than c
    roots.evict()
    assert sorted(p.name[0] for p in roots.dir.iterdir() if p.is_dir()) == ["c"]
