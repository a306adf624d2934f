"""What the docs and docstrings point to exists: ``docs/X.md`` and other repository paths, markdown
links, and dotted ``et_hpc.`` names (a module, or a name defined in one)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATH_RE = re.compile(r"(?<![\w/.-])((?:docs|et_hpc|slurm|bench|defs|scripts)/[\w./-]*\w)")
DOTTED_RE = re.compile(r"(?<![\w.])(et_hpc(?:\.\w+)+)")
LINK_RE = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
NOT_NAMES = {"et_hpc.schema_version"}  # a parquet metadata key


def sources() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "SECURITY.md", *sorted((ROOT / "docs").glob("*.md"))]
    return files + sorted((ROOT / "et_hpc").rglob("*.py"))


def dotted_exists(dotted: str) -> bool:
    """A module path, or a module path and a name its source mentions (defined, imported or forwarded)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        src = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if src.is_file():
            rest = parts[i:]
            return not rest or re.search(rf"\b{re.escape(rest[0])}\b", src.read_text()) is not None
    return False


def dangling(path: Path, text: str) -> list[str]:
    out = []
    for m in PATH_RE.finditer(text):
        ref = m.group(1).rstrip(".")
        if not any(c in ref for c in "*<>{}$") and not (ROOT / ref).exists():
            out.append(ref)
    for m in DOTTED_RE.finditer(text):
        if m.group(1) not in NOT_NAMES and not dotted_exists(m.group(1)):
            out.append(m.group(1))
    if path.suffix == ".md":
        out += [t for t in LINK_RE.findall(text) if not t.startswith(("http:", "https:", "mailto:")) and not (path.parent / t).exists()]
    return out


def test_the_check_flags_dangling_pointers() -> None:
    text = "see docs/store.md, et_hpc.runs.store.RunStore and [x](docs/store.md); "
    assert dangling(ROOT / "README.md", text) == []
    bad = "docs/no-such.md et_hpc.agent.no_such_module et_hpc.runs.store.NoSuchName [x](docs/nope.md)"
    assert set(dangling(ROOT / "README.md", bad)) == {
        "docs/no-such.md",
        "et_hpc.agent.no_such_module",
        "et_hpc.runs.store.NoSuchName",
        "docs/nope.md",
    }


def test_every_pointer_resolves() -> None:
    found = [f"{p.relative_to(ROOT)}: {ref}" for p in sources() for ref in dangling(p, p.read_text())]
    assert not found, "pointers to nothing:\n" + "\n".join(found)
