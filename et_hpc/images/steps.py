"""Builds that reuse steps (CAS layout): a recipe is cut where that cannot change what it means,
each step is built once per (parent, normalised text) and stored as a root of its own.

``plan`` cuts a converted Dockerfile at each RUN/COPY/ADD up to the last install (each step
replays the ENV/ARG/WORKDIR state before it) and a native def after each leading plain install
line; anything else is built whole. ``step_keys`` names the steps; ``build`` runs
``apptainer build --fakeroot --sandbox`` for the missing ones on their parent, reads each root in
a fakeroot-mapped user namespace (owners kept), and gives the last root a whole build's
provenance. A failing step leaves the verdict to the whole build. Specified in docs/images.md,
"Step builds".
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import secrets
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from et_hpc.errors import InfraError
from et_hpc.images import cas
from et_hpc.images.build import USERNS, remove_tree
from et_hpc.images.keys import hash_files
from et_hpc.tasks.dockerfile import files_line
from et_hpc.util import atomic_write_text

if TYPE_CHECKING:
    from et_hpc.images.keys import DigestCache
    from et_hpc.tasks.model import NormalisedRecipe

FORMAT = "et-hpc step 1"
_SECTION = re.compile(r"^%([A-Za-z]+)(.*)$")
_TAIL_SECTIONS = {"environment", "runscript", "startscript", "test", "labels", "help"}
_MARKER = re.compile(r"^# \S+:\d+ (RUN|COPY|ADD)$")  # the converter's comment before each step
_EXPORT = re.compile(r"^export [A-Za-z_][A-Za-z0-9_]*=[^$`\\;&|<>(){}]*$")
_SET = re.compile(r"^set [-+][a-zA-Z]+( [-+][a-zA-Z]+)*$")
_INSTALLERS = {"apt-get", "apt", "pip", "pip3"}
_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=\S*$")


@dataclass
class Step:
    """One step: the %post lines it runs, the text its key hashes, the ``%files`` lines and
    entries it copies in and, for the last step, the sections after %post."""

    script: list[str]
    key_text: str
    own: list[str] = field(default_factory=list)  # the script's lines after the state it replays
    files_lines: list[str] = field(default_factory=list)
    files: list[tuple[Path, str]] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)


@dataclass
class Plan:
    header: list[str]  # the def's header with its From line as ``{FROM}``
    from_line: str  # the header's own From value (the base), which the final root names
    post_args: str
    steps: list[Step]


# -- where a recipe is cut ---------------------------------------------------------------------
def _sections(text: str) -> tuple[list[str], list[tuple[str, str, list[str]]]] | None:
    header: list[str] = []
    sections: list[tuple[str, str, list[str]]] = []
    for line in text.splitlines():
        m = _SECTION.match(line)
        if m:
            sections.append((m.group(1).lower(), m.group(2), []))
        elif sections:
            sections[-1][2].append(line)
        else:
            header.append(line)
    names = [n for n, _, _ in sections]
    if any(n not in _TAIL_SECTIONS | {"files", "post"} for n in names) or names.count("post") != 1 or names.count("files") > 1:
        return None
    return header, sections


def plan(recipe: NormalisedRecipe) -> Plan | None:
    """The steps of ``recipe``, or None when it is built whole (see the module docstring)."""
    if recipe.kind not in ("def", "dockerfile") or recipe.base is None:
        return None
    parsed = _sections(recipe.text)
    if parsed is None:
        return None
    header, sections = parsed
    heads = {ln.split(":", 1)[0].strip().lower(): i for i, ln in enumerate(header) if ":" in ln}
    if "from" not in heads or header[heads.get("bootstrap", 0)].split(":", 1)[-1].strip().lower() != "localimage":
        return None
    from_line = header[heads["from"]].split(":", 1)[1].strip()
    header = [*header]
    header[heads["from"]] = "From: {FROM}"
    post = next(s for s in sections if s[0] == "post")
    files = next((s for s in sections if s[0] == "files"), None)
    if files is not None and files[1].strip():
        return None  # %files from another stage
    tail: list[str] = []
    for name, args, body in sections:
        if name in _TAIL_SECTIONS:
            tail += [f"%{name}{args}", *body]
    post_args = post[1]
    if recipe.post_spans is not None:
        steps = _merge_after_installs(_dockerfile_steps(recipe))
    else:
        steps = _native_steps(post[2], files[2] if files else [], list(recipe.files))
    if not steps:
        return None
    steps[-1].tail = tail
    return Plan(header=header, from_line=from_line, post_args=post_args, steps=steps)


def _dockerfile_steps(recipe: NormalisedRecipe) -> list[Step]:
    ps = recipe.post_spans
    assert ps is not None
    key_preamble = [ln for ln in ps.preamble if not ln.startswith("# ")]  # not the Dockerfile's path
    steps: list[Step] = []
    replay: list[str] = []  # the shell state the steps so far left, as lines to run again
    own: list[str] = []  # state lines since the last step: run by the next step itself
    pending: list[str] = []  # ... and how the steps after it replay them
    for kind, lines, files in ps.spans:
        if kind == "env":
            own += lines
            pending += lines
        elif kind == "workdir":
            own += lines
            pending += [ln.split(" && ", 1)[1] for ln in lines]  # "mkdir -p D && cd D": later steps cd only
        else:
            body = [*own, *lines]
            steps.append(
                Step(
                    own=body,
                    script=[*ps.preamble, *replay, *body],
                    key_text="\n".join([*key_preamble, *replay, *[ln for ln in body if not _MARKER.match(ln)]]),
                    files_lines=[files_line(h, d) for h, d in files],
                    files=list(files),
                )
            )
            replay += pending
            own, pending = [], []
    last = [*own, *ps.epilogue]
    if steps:
        steps[-1].script += last
        steps[-1].own += last
        steps[-1].key_text += "\n" + "\n".join(last)
    else:
        steps.append(Step(script=[*ps.preamble, *last], key_text="\n".join([*key_preamble, *last]), own=last))
    return steps


_INSTALLS = re.compile(r"\b(apt-get|apt|pip3?|python3? -m pip|npm|conda|gem|cargo) +(-\S+ +)*(install|update)\b")


def _merge_after_installs(steps: list[Step]) -> list[Step]:
    """The steps after the last one that installs packages, as one step: the task's own part is
    rarely shared, and one build of it is cheaper than one per RUN. Merging changes no meaning (a
    merged step runs each part as the whole build does), only what later recipes can reuse."""
    last = max((i for i, s in enumerate(steps) if _INSTALLS.search("\n".join(s.own))), default=-1)
    if len(steps) - last <= 2:
        return steps
    rest = steps[last + 1 :]
    merged = Step(
        script=[*rest[0].script, *[ln for s in rest[1:] for ln in s.own]],
        key_text="\n".join(s.key_text for s in rest),
        own=[ln for s in rest for ln in s.own],
        files_lines=[ln for s in rest for ln in s.files_lines],
        files=[f for s in rest for f in s.files],
    )
    return [*steps[: last + 1], merged]


def _logical_lines(body: list[str]) -> list[tuple[str, list[str]]]:
    """(the line as the shell joins it, its raw lines) for each line of a %post body."""
    out: list[tuple[str, list[str]]] = []
    raw: list[str] = []
    for ln in body:
        raw.append(ln)
        if ln.endswith("\\") and not ln.rstrip().startswith("#"):
            continue
        joined = "".join(r[:-1] if r.endswith("\\") else r for r in raw)
        out.append((joined.strip(), raw))
        raw = []
    if raw:
        out.append(("".join(raw).strip(), raw))
    return out


def install_tokens(line: str) -> list[list[str]] | None:
    """The commands of ``line`` when it is a plain package install (see the module docstring)."""
    if any(c in line for c in "$`<>|;(){}#\n") or re.search(r"(^|[^&])&([^&]|$)", line):
        return None
    try:
        parts = [shlex.split(p) for p in line.split("&&")]
    except ValueError:
        return None
    for toks in parts:
        words = list(toks)
        while words and _ASSIGN.match(words[0]):
            words.pop(0)
        if not words or words[0] not in _INSTALLERS:
            return None
    return parts


def _native_steps(body: list[str], files_lines: list[str], files: list[tuple[Path, str]]) -> list[Step]:
    steps: list[Step] = []
    state: list[str] = []
    lines = _logical_lines(body)
    i = 0
    for i, (joined, _raw) in enumerate(lines):  # noqa: B007 - i is where the rest starts
        if not joined or joined.startswith("#"):
            continue
        if _EXPORT.match(joined) or _SET.match(joined):
            state.append(joined)
            continue
        toks = install_tokens(joined)
        if toks is None:
            break
        key = json.dumps({"state": state, "commands": toks})
        steps.append(Step(script=[*state, joined], key_text=key, own=[joined]))
    else:
        i = len(lines)
    rest = [r for _j, raw in lines[i:] for r in raw]
    if steps and not any(j.strip() and not j.strip().startswith("#") for j, _ in lines[i:]):
        last = steps[-1]  # nothing after the installs: the last install is the last step
    else:
        last = Step(script=[*state, *rest], key_text="\n".join([*state, *rest]), own=rest)
        steps.append(last)
    steps[0].files_lines, steps[0].files = list(files_lines), list(files)
    return steps


def step_keys(p: Plan, base_digest: str, digests: DigestCache) -> list[str]:
    """The key of each step: its parent's key and everything the step is made of."""
    keys: list[str] = []
    parent = f"base {base_digest}"
    for s in p.steps:
        h = hashlib.sha256()
        h.update(f"{FORMAT}\nparent {parent}\npost {p.post_args.strip()}\n".encode())
        h.update(f"text {len(s.key_text.encode())}\n".encode() + s.key_text.encode() + b"\n")
        hash_files(h, s.files, digests)
        tail = "\n".join(s.tail).encode()
        h.update(f"tail {len(tail)}\n".encode() + tail + b"\n")
        parent = h.hexdigest()
        keys.append(parent)
    return keys


def step_def(p: Plan, i: int, parent: str, preludes: Callable[[str], str]) -> str:
    """The def that builds step ``i`` on ``parent`` (a SIF or a root directory)."""
    s = p.steps[i]
    out = [ln.replace("{FROM}", parent) if ln == "From: {FROM}" else ln for ln in p.header]
    if s.files_lines:
        out += ["%files", *s.files_lines, ""]
    out += [f"%post{p.post_args}", *s.script, ""]
    out += s.tail
    return preludes("\n".join(out) + "\n")


# -- the step records ---------------------------------------------------------------------------
def record_path(cache_dir: Path, key: str) -> Path:
    return Path(cache_dir) / "steps" / key[:2] / f"{key}.json"


def _stored(cache_dir: Path, key: str) -> dict[str, Any] | None:
    """The record of a built step, if it and its manifest are there."""
    try:
        rec: dict[str, Any] = json.loads(record_path(cache_dir, key).read_text())
        ok = isinstance(rec.get("manifest"), str) and cas.manifest_path(cache_dir, rec["manifest"]).is_file()
    except (OSError, ValueError, AttributeError):
        return None
    return rec if ok else None


def stored_manifest(cache_dir: Path, key: str) -> str | None:
    """The manifest of a built step, if it and its manifest are there."""
    rec = _stored(cache_dir, key)
    return None if rec is None else str(rec["manifest"])


def step_manifests(cache_dir: Path) -> set[str]:
    """Every manifest a step record names (kept by ``et-hpc images gc``)."""
    out = set()
    for p in (Path(cache_dir) / "steps").glob("??/*.json"):
        try:
            out.add(json.loads(p.read_text())["manifest"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


# -- in the fakeroot user namespace --------------------------------------------------------------
def in_userns(*args: str) -> dict[str, Any]:
    """Run ``python -m et_hpc.images.steps ARGS`` as root of a user namespace mapped as
    Apptainer's fakeroot maps it; its one JSON line of output."""
    cmd = [*USERNS, sys.executable, "-m", "et_hpc.images.steps", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        err = (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
        raise InfraError(f"{args[0]} in a user namespace failed: {err}")
    out: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return out


def _ingest(cache_dir: Path, root: Path) -> dict[str, Any]:
    entries = cas.entries_from_tree(root)
    man, new = cas.ingest_entries(cache_dir, entries, root)
    return {"manifest": man, "new_bytes": new, "files": len(entries)}


def _materialise(cache_dir: Path, man: str, dest: Path) -> dict[str, Any]:
    entries = sorted(cas.read_manifest(cache_dir, man), key=lambda e: e["p"])
    if any(e["t"] in ("c", "b") for e in entries):
        raise InfraError(f"manifest {man[:12]} holds device nodes, which a user namespace cannot make")
    dest.mkdir()
    for e in entries:
        p = dest / e["p"] if e["p"] != "." else dest
        if e["t"] == "d" and p != dest:
            p.mkdir()
        elif e["t"] == "l":
            os.symlink(e["l"], p)
        elif e["t"] == "f":
            with open(p, "xb") as f:
                for b in cas.read_object(cache_dir, e["h"]):
                    f.write(b)
    for e in reversed(entries):  # children before their directory, so a read-only mode comes last
        p = dest / e["p"] if e["p"] != "." else dest
        os.lchown(p, e["u"], e["g"])
        if e["t"] != "l":
            os.chmod(p, e["m"])
        mt = e.get("mt")
        if mt is not None:
            os.utime(p, (mt, mt), follow_symlinks=False)
    return {"entries": len(entries)}


# -- one recipe ----------------------------------------------------------------------------------
@dataclass
class StepBuild:
    manifest: str | None  # the image's root, or None when a step failed
    built: int = 0  # steps built now
    reused: int = 0  # steps that were there
    reason: str | None = None  # why a step failed
    new_bytes: int = 0
    seconds: list[float] = field(default_factory=list)


def build(
    cache_dir: Path,
    p: Plan,
    keys: list[str],
    *,
    base: Path,
    work: Path,
    whole_def: str,
    run: Callable[[Path, Path], tuple[int | None, str | None]],
    preludes: Callable[[str], str],
    log: IO[str],
    scratch: Path,
) -> StepBuild:
    """Build the steps ``keys`` of plan ``p`` that are not there, each on its parent, in ``work``;
    ``run(def_path, out_dir)`` runs ``apptainer build --sandbox`` (exit status, failure reason).
    The last step's root gets the provenance of a whole build of ``whole_def`` before it is stored."""
    res = StepBuild(manifest=None)
    roots = Roots(scratch)
    have, last = len(keys), None  # the steps built already, and the last one's record
    while have > 0 and (last := _stored(cache_dir, keys[have - 1])) is None:
        have -= 1
    res.reused = have
    if have == len(keys):
        assert last is not None
        res.manifest = last["manifest"]
        log.write(f"# every step is built already ({len(keys)}): nothing to build\n")
        return res
    with contextlib.ExitStack() as held:
        if last is not None:
            parent = held.enter_context(roots.hold(keys[have - 1]))
            if not parent.is_dir():
                t = time.monotonic()
                tmp = roots.dir / f".tmp-{keys[have - 1][:12]}-{secrets.token_hex(4)}"
                try:
                    in_userns("materialise", str(cache_dir), last["manifest"], str(tmp))
                    roots.keep(tmp, parent)
                finally:
                    if tmp.exists():
                        remove_tree(tmp)
                log.write(f"# steps 1..{have} of {len(keys)} are built; step {have}'s root made here in {time.monotonic() - t:.1f} s\n")
            else:
                log.write(f"# steps 1..{have} of {len(keys)} are built; step {have}'s root is on this node\n")
        else:
            parent = base
        # how many bootstrap history files the base chain has (what a whole build keeps): counted
        # after the first step, then carried in every step's record
        history = last.get("base_history") if last is not None else None
        _run_steps(
            cache_dir, p, keys, have, parent, history, roots, held, res, work=work, whole_def=whole_def, run=run, preludes=preludes, log=log
        )
    roots.evict()
    return res


def _run_steps(
    cache_dir: Path,
    p: Plan,
    keys: list[str],
    have: int,
    parent: Path,
    history: int | None,
    roots: Roots,
    held: contextlib.ExitStack,
    res: StepBuild,
    *,
    work: Path,
    whole_def: str,
    run: Callable[[Path, Path], tuple[int | None, str | None]],
    preludes: Callable[[str], str],
    log: IO[str],
) -> None:
    for i in range(have, len(keys)):
        t = time.monotonic()
        d = work / f"step-{i}.def"
        out = work / f"step-{i}"
        d.write_text(step_def(p, i, str(parent), preludes))
        log.write(f"# step {i + 1} of {len(keys)}, key {keys[i][:12]}, on {parent.name}\n")
        log.flush()
        rc, reason = run(d, out)
        if reason is not None or rc != 0:
            res.reason = reason or f"step {i + 1} of {len(keys)} exited with status {rc}"
            res.manifest = None  # not the image: the root of the step before
            return
        if i == 0:
            history = _history(out)
        if i == len(keys) - 1:
            _whole_build_provenance(out, whole_def, p.from_line, history)
        rec = in_userns("ingest", str(cache_dir), str(out))
        res.new_bytes += int(rec["new_bytes"])
        atomic_write_text(
            record_path(cache_dir, keys[i]),
            json.dumps(
                {
                    "key": keys[i],
                    "parent": keys[i - 1] if i else None,
                    "manifest": rec["manifest"],
                    "base_history": history,
                    "host": socket.gethostname(),
                    "seconds": round(time.monotonic() - t, 2),
                }
            ),
        )
        res.built += 1
        res.seconds.append(round(time.monotonic() - t, 2))
        res.manifest = rec["manifest"]
        if i < len(keys) - 1:  # a parent, of the next step and of later recipes' steps on this node
            parent = held.enter_context(roots.hold(keys[i]))
            roots.keep(out, parent)


class Roots:
    """Roots of built steps kept in node-local scratch (``<scratch>/step-roots/<key>``), so that
    the next build on the node that starts from a step copies its root instead of making it from
    the store (9 s for a 300 MB root here). A build holds a shared ``flock`` on ``<key>.lock``
    while it uses a root; ``evict`` keeps the ``keep`` most recently used and removes only roots
    it can lock exclusively without waiting."""

    def __init__(self, scratch: Path, keep: int = 4):
        self.dir = Path(scratch) / "step-roots"
        self.keep_n = keep

    @contextlib.contextmanager
    def hold(self, key: str) -> Iterator[Path]:
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.utime(fd)  # used now: the last to be evicted
            yield self.dir / key
        finally:
            os.close(fd)

    def keep(self, src: Path, dest: Path) -> None:
        """Put the root ``src`` in place as ``dest`` (held), unless another build already did."""
        try:
            os.rename(src, dest)
        except OSError:
            if not dest.is_dir():
                raise
            remove_tree(src)

    def evict(self) -> None:
        def used(q: Path) -> float:
            try:
                return q.stat().st_mtime
            except OSError:
                return 0.0  # removed meanwhile

        locks = sorted(self.dir.glob("*.lock"), key=used, reverse=True)
        for lock in locks[self.keep_n :]:
            try:
                fd = os.open(lock, os.O_RDWR)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue  # in use by a build
            try:
                root = lock.with_suffix("")
                if root.is_dir():
                    trash = self.dir / f".gone-{root.name[:12]}-{secrets.token_hex(4)}"
                    os.rename(root, trash)
                    remove_tree(trash)
                lock.unlink(missing_ok=True)
            finally:
                os.close(fd)


def _history(root: Path) -> int:
    """How many bootstrap history files a root holds (a step's build adds its parent's def)."""
    d = root / ".singularity.d" / "bootstrap_history"
    return len(list(d.iterdir())) if d.is_dir() else 0


def _whole_build_provenance(root: Path, whole_def: str, from_line: str, history: int | None) -> None:
    """Make ``/.singularity.d`` say what a whole build of ``whole_def`` says: that def, the base's
    history only, and the base as ``deffile.from``. The build date stays that of this build."""
    sd = root / ".singularity.d"
    (sd / "Singularity").write_text(whole_def)
    hist = sd / "bootstrap_history"
    if history is not None and hist.is_dir():
        names = sorted(hist.iterdir(), key=lambda q: (len(q.name), q.name))
        for q in names[history:]:
            q.unlink()
    labels = sd / "labels.json"
    if labels.is_file():
        text = labels.read_text()
        text = re.sub(
            r'("org\.label-schema\.usage\.singularity\.deffile\.from": )"[^"]*"',
            lambda m: m.group(1) + json.dumps(from_line),
            text,
        )
        labels.write_text(text)


def main(argv: list[str]) -> int:
    """``ingest CACHE ROOT`` | ``materialise CACHE MANIFEST DEST``: run by ``in_userns``."""
    cmd, cache_dir = argv[0], Path(argv[1])
    if cmd == "ingest":
        out = _ingest(cache_dir, Path(argv[2]))
    elif cmd == "materialise":
        out = _materialise(cache_dir, argv[2], Path(argv[3]))
    else:
        print(f"unknown command {cmd!r}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
