"""No module imports another module's ``_private`` names, but a short listed few.

What two modules share gets a public home; a copy of a guarantee starts where one module reaches
into another's privates. Every ``from X import _name`` in ``et_hpc`` (function-level and
``TYPE_CHECKING`` ones included) where ``X`` is another ``et_hpc`` module counts; ``ALLOWED``
lists the ones kept, each with why. Stdlib only (``ast``).
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "et_hpc"

# (importing module, imported module, name) -> why it stays private
ALLOWED: dict[tuple[str, str, str], str] = {}


def private_imports(name: str, source: str, is_pkg: bool = False) -> set[tuple[str, str, str]]:
    """(``name``, module, private name) for every ``from module import _x`` in ``source``."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            pkg = name.split(".") if is_pkg else name.split(".")[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([base] if base else []))
        if not (base == "et_hpc" or base.startswith("et_hpc.")) or base == name:
            continue
        for a in node.names:
            if a.name.startswith("_") and not a.name.startswith("__"):
                out.add((name, base, a.name))
    return out


def _all() -> set[tuple[str, str, str]]:
    found = set()
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        is_pkg = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_pkg else parts)
        found |= private_imports(name, p.read_text(), is_pkg)
    return found


def test_no_private_names_cross_modules() -> None:
    extra = sorted(_all() - set(ALLOWED))
    assert not extra, "give these a public name (or list them in ALLOWED with why):\n" + "\n".join(
        f"{a} imports {b}.{n}" for a, b, n in extra
    )


def test_the_count_sees_a_private_import() -> None:
    """The positive control: a made-up module that reaches into another's privates is counted, in
    each form (absolute, relative, under ``if``/a function), and a public or dunder name is not."""
    src = (
        "from et_hpc.scoring.enter_sys import _secret, public\n"
        "from . import _sibling\n"
        "def f():\n"
        "    from et_hpc.runs.final_state import _hidden, __version__\n"
        "if __spec__ is not None:\n"
        "    from et_hpc.scoring.sweep import _x\n"
        "import et_hpc.host.procfs\n"
    )
    got = private_imports("et_hpc.scoring.live", src)
    assert got == {
        ("et_hpc.scoring.live", "et_hpc.scoring.enter_sys", "_secret"),
        ("et_hpc.scoring.live", "et_hpc.scoring", "_sibling"),
        ("et_hpc.scoring.live", "et_hpc.runs.final_state", "_hidden"),
        ("et_hpc.scoring.live", "et_hpc.scoring.sweep", "_x"),
    }
    assert len(_all() | got) > len(ALLOWED)  # it would fail the check above
