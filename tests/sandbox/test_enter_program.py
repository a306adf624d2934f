"""The entry helper is one program made of its parts: stamped first, self-contained, stdlib only."""

from __future__ import annotations

import ast
import json
import subprocess

from et_hpc.scoring import enter


def _program() -> str:
    argv = enter.helper_argv()
    assert argv[1:5] == ["-I", "-S", "-B", "-c"]
    return argv[-1]


def test_the_program_stamps_its_start_before_any_other_import() -> None:
    tree = ast.parse(_program())
    body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    first_imports = [n for n in body[:3] if isinstance(n, ast.ImportFrom | ast.Import)]
    assert isinstance(body[0], ast.ImportFrom) and body[0].module == "__future__"
    assert [a.name for n in first_imports[1:] for a in n.names] == ["time"]
    assert isinstance(body[2], ast.Assign) and ast.unparse(body[2].targets[0]) == "T_START"


def test_the_program_imports_nothing_of_the_package_when_run() -> None:
    # the parts' imports of each other run only when they are imported as modules (``__spec__`` set)
    tree = ast.parse(_program())
    guards = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "__spec__ is not None"]
    guarded = {id(n) for g in guards for n in ast.walk(g)}
    ours = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("et_hpc")]
    assert ours  # positive control: the parts do import each other as modules
    assert all(id(n) in guarded for n in ours)


def test_the_program_answers_for_an_instance_that_is_gone() -> None:
    cfg = json.dumps({"marker": "MK", "pid": 2**22 + 1, "pristine": "/nonexistent", "timeout": 5}).encode()
    p = subprocess.run(enter.helper_argv(), input=str(len(cfg)).encode() + b"\n" + cfg, capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr
    line = next(ln for ln in p.stdout.decode().splitlines() if ln.startswith("MK"))
    res = json.loads(line[2:])
    assert res["kind"] == "infra" and res["stage"] == "enter" and "is gone" in res["error"]


def test_the_program_fits_in_one_argument() -> None:
    # Linux takes at most 32 pages (128 KiB) per argv string (MAX_ARG_STRLEN); a longer program
    # would make every scoring fail to start with E2BIG. Keep a margin for growth.
    size = len(_program().encode())
    assert 20_000 < size < 100 * 1024, size
