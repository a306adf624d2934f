"""The image key after the store's split: the same bytes hashed the same way, and the lookup index's
code signature names every module whose code runs while a key is computed. No apptainer needed."""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from pathlib import Path

import et_hpc
from et_hpc.images import keys
from et_hpc.images.store import ImageStore
from et_hpc.tasks.base_names import default_base_map
from et_hpc.tasks.loader import load_tasks
from et_hpc.tasks.recipe import normalise

DEMO = Path(__file__).resolve().parents[2] / "defs" / "demo"
PKG = Path(et_hpc.__file__).resolve().parent
# Modules that run during key computation but only move bytes around (errors, hashing a file, the
# default cache path): a change there does not change what a recipe means.
PLUMBING = {"errors.py", "util.py", "paths.py", "__init__.py", "tasks/__init__.py", "images/__init__.py"}


def fake_bases(tmp_path: Path) -> dict[str, Path]:
    sif = tmp_path / "base.sif"
    sif.write_bytes(b"not a real base, only its bytes are hashed\n")
    return {name: sif for name in default_base_map(tmp_path)}


def recompute(recipe, base_map: dict[str, Path]) -> str:
    """The key as the store's format defines it, written out again independently of the store."""
    h = hashlib.sha256()
    h.update(b"et-hpc image store format 1\n")
    text = recipe.text.encode()
    h.update(f"def {len(text)}\n".encode() + text + b"\n")
    base = getattr(recipe, "base", None)
    h.update(f"base {hashlib.sha256(Path(base).read_bytes()).hexdigest() if base else '-'}\n".encode())
    for dest, src in sorted((str(n), Path(s)) for s, n in recipe.files):
        assert src.is_file(), f"the demo tasks copy in files only, not {src}"
        h.update(f"file {dest}\0{hashlib.sha256(src.read_bytes()).hexdigest()}\n".encode())
    return h.hexdigest()


def test_demo_keys_match_the_format(tmp_path: Path) -> None:
    bases = fake_bases(tmp_path)
    store = ImageStore(tmp_path / "cache", base_map=bases)
    tasks = load_tasks(DEMO).tasks
    assert len(tasks) >= 4
    for t in tasks:
        recipe = normalise(t, base_map=bases)
        assert store.key_for(recipe) == recompute(recipe, bases), t.id
    changed = dataclasses.replace(recipe, text=recipe.text + "# one more line\n")
    assert store.key_for(changed) != store.key_for(recipe)  # positive control: another def, another key
    assert recompute(changed, bases) != recompute(recipe, bases)


def test_key_code_names_every_module_that_runs(tmp_path: Path) -> None:
    bases = fake_bases(tmp_path)
    tasks = load_tasks(DEMO).tasks
    ran: set[str] = set()

    def tracer(frame, event, arg):  # noqa: ANN001, ANN202
        f = frame.f_code.co_filename
        if f.startswith(str(PKG)):
            ran.add(Path(f).resolve().relative_to(PKG).as_posix())

    store = ImageStore(tmp_path / "cache", base_map=bases)
    sys.setprofile(tracer)
    try:
        for t in tasks:
            store.key_for(store.normalised(t))
    finally:
        sys.setprofile(None)
    assert "images/keys.py" in ran and "tasks/recipe.py" in ran  # the trace sees the key's code
    missing = sorted(ran - set(keys.KEY_CODE) - PLUMBING)
    assert not missing, f"code that decides image keys but is not in images/keys.py KEY_CODE: {missing}"
    for name in keys.KEY_CODE:
        assert (PKG / name).is_file(), f"KEY_CODE names {name}, which does not exist"
