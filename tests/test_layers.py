"""The package's imports point one way: down the layer table below, and never in a cycle.

Stdlib only (``ast``): every ``import`` in ``et_hpc`` counts, function-level ones included;
imports under ``if TYPE_CHECKING:`` do not (they never run). A module that moved leaves a shim
at its old path that forwards names by string (``et_hpc._moved``), so shims add no edges.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "et_hpc"

# Module (or package prefix) -> layer. An import may point to its own layer or a lower one.
LAYERS: dict[str, int] = {
    # L0 contracts: errors, where things live, the episode record, small utilities
    "et_hpc": 0,
    "et_hpc._moved": 0,
    "et_hpc.compat": 0,
    "et_hpc.errors": 0,
    "et_hpc.paths": 0,
    "et_hpc.record": 0,
    "et_hpc.text": 0,
    "et_hpc.util": 0,
    # L1 thin wrappers over the host's tools; the run store and what reads it
    "et_hpc.host": 1,
    "et_hpc.runs": 1,
    "et_hpc.store": 1,  # store: a shim (runs/store.py)
    # L2 tasks: the model, the sources, recipes (def and Dockerfile) and base names
    "et_hpc.tasks": 2,
    # L3 images built from recipes; sandboxes started from images
    "et_hpc.images": 3,
    "et_hpc.sandbox": 3,
    # ... and scoring, which sandboxes start (the warm-up, the host sweep) and which imports nothing
    # of them at run time: live scoring, the entry helper, the helper pool, the start checks
    "et_hpc.scoring": 3,
    # L4 the agent (policies, loop, endpoints) and the scripted server that stands in for a model
    "et_hpc.agent": 4,
    "et_hpc.testing": 4,
    "et_hpc.scripted_server": 4,
    "et_hpc.scripted_tokenizer": 4,
    # ... and the CPU model server that serves a real one (its endpoint file is the agent's format)
    "et_hpc.model": 4,
    # L5 one episode: sandbox + agent + scoring; the task check built on it
    "et_hpc.episode": 5,
    # L6 many episodes: run config, plan, executors
    "et_hpc.runner": 6,
    # L7 what drives the runner: continuous rollouts, integrations with trainers
    "et_hpc.rollouts": 7,
    "et_hpc.integrations": 7,
    # L8 the command line
    "et_hpc.cli": 8,
}


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _layer(mod: str) -> int | None:
    while mod:
        if mod in LAYERS:
            return LAYERS[mod]
        mod = mod.rpartition(".")[0]
    return None


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}

    def resolve(m: str) -> str | None:
        while m and m not in mods:
            m = m.rpartition(".")[0]
        return m or None

    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        for t in targets:
            if t == "et_hpc" or t.startswith("et_hpc."):
                r = resolve(t)
                if r and r != name:
                    out.add(r)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, p, mods) for name, p in mods.items()}


def test_every_module_has_a_layer() -> None:
    missing = sorted(m for m in _modules() if _layer(m) is None)
    assert not missing, f"add these modules to LAYERS in {__file__}: {missing}"


def test_imports_point_down() -> None:
    up = [
        f"{a} (L{_layer(a)}) imports {b} (L{_layer(b)})"
        for a, bs in sorted(_graph().items())
        for b in sorted(bs)
        if _layer(a) is not None and _layer(b) is not None and _layer(b) > _layer(a)
    ]
    assert not up, "imports that point up the layer table:\n" + "\n".join(up)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_module_cycles() -> None:
    assert _cycles(_graph()) == []


def test_no_package_cycles() -> None:
    top = lambda m: ".".join(m.split(".")[:2])  # noqa: E731
    edges: dict[str, set[str]] = defaultdict(set)
    for a, bs in _graph().items():
        edges[top(a)] |= {top(b) for b in bs if top(b) != top(a)}
    assert _cycles(edges) == []


def test_the_checks_see_a_cycle_and_an_upward_import() -> None:
    """The graph checks can fail: a made-up cycle is found, and the table ranks cli above tasks."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _layer("et_hpc.tasks.loader") < _layer("et_hpc.cli.tasks")
    assert "et_hpc.tasks.recipe" in _graph()["et_hpc.tasks.loader"]  # function-level imports count
