"""Every compat name resolves to what replaced it, has a removal release, and the README lists it;
every class alias and forwarding module in the code is in the table (et_hpc/compat.py)."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from et_hpc.compat import COMPAT

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "et_hpc"


def resolve(dotted: str) -> object:
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError:
        mod, _, attr = dotted.rpartition(".")
        return getattr(importlib.import_module(mod), attr)


@pytest.mark.parametrize("old", sorted(COMPAT))
def test_old_name_resolves_to_the_new(old: str) -> None:
    new, version = COMPAT[old]
    assert re.fullmatch(r"\d+\.\d+\.\d+", version)
    got, want = resolve(old), resolve(new)
    if isinstance(want, type):
        assert got is want
    else:  # a forwarding module: a public name of the new module is reachable through the old one
        name = next(
            n
            for n in sorted(vars(want))
            if not n.startswith("_") and callable(getattr(want, n)) and getattr(getattr(want, n), "__module__", "") == want.__name__
        )
        assert getattr(got, name) is getattr(want, name)


def test_the_code_has_no_compat_name_outside_the_table() -> None:
    aliases, shims = set(), set()
    for p in PKG.rglob("*.py"):
        mod = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        text = p.read_text()
        for m in re.finditer(r"^([A-Z]\w+) = ([A-Z]\w+)\s*(#.*)?$", text, re.M):
            if m.group(3) and "old name" in m.group(3):
                aliases.add(f"{mod}.{m.group(1)}")
        if "__getattr__ = forward(" in text or re.search(r'^"""Moved to ', text):
            shims.add(mod)
    assert "et_hpc.store" in shims and "et_hpc.host.slurm.SlurmOptions" in aliases  # the scan sees them
    assert not (aliases | shims) - set(COMPAT)


def test_readme_lists_every_compat_name() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [
        old
        for old, (new, version) in COMPAT.items()
        if not re.search(rf"`{re.escape(old)}`.*`{re.escape(new)}`.*{re.escape(version)}", readme)
    ]
    assert not missing


def test_old_module_path_still_runs_the_scripted_server() -> None:
    r = subprocess.run([sys.executable, "-m", "et_hpc.scripted_server", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--endpoint-file" in r.stdout, r.stderr
