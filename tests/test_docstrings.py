"""Every docstring in et_hpc (module, class, function) states its contract in 12 lines or fewer.

A docstring's lines are the source lines its string literal spans, quotes included. Longer
specifications belong in docs/ or SECURITY.md, which the docstring may point to.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 12
DEFS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def long_docstrings(source: str, where: str) -> list[str]:
    """``where:line name (N lines)`` for each docstring in ``source`` longer than ``MAX_LINES``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, DEFS) or not node.body:
            continue
        first = node.body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            n = (first.end_lineno or first.lineno) - first.lineno + 1
            if n > MAX_LINES:
                out.append(f"{where}:{first.lineno} {getattr(node, 'name', '<module>')} ({n} lines)")
    return out


def test_the_check_flags_a_long_docstring() -> None:
    body = "\n".join(f"line {i}" for i in range(11))
    twelve = f'"""{body}\n"""\n'  # 11 lines of text and the closing quotes: 12 lines
    thirteen = f'"""{body}\nline 11\n"""\n'
    assert long_docstrings(twelve, "m.py") == []
    assert long_docstrings(thirteen, "m.py") == ["m.py:1 <module> (13 lines)"]
    cls = f"class C:\n    {thirteen}\n    def f(self):\n        {thirteen}\n"
    assert [s.split(" ")[1] for s in long_docstrings(cls, "c.py")] == ["C", "f"]
    assert long_docstrings(f"async def g():\n    {thirteen}", "g.py") == ["g.py:2 g (13 lines)"]


def test_every_docstring_has_at_most_12_lines() -> None:
    files = sorted((ROOT / "et_hpc").rglob("*.py"))
    assert len(files) > 50
    found = [s for p in files for s in long_docstrings(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, "docstrings over 12 lines (move the specification to docs/):\n" + "\n".join(found)
