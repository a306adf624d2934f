"""Inverted final tests: a test file that passes exactly when the original test file fails."""

from __future__ import annotations

from pathlib import Path

TEMPLATE = """\
ORIGINAL = {source!r}


def test_the_original_tests_fail():
    ns = {{"__name__": "original"}}
    exec(compile(ORIGINAL, "original_test_final_state.py", "exec"), ns)
    tests = [f for n, f in sorted(ns.items()) if n.startswith("test_") and callable(f)]
    assert tests, "the original file holds no test"
    failed = 0
    for f in tests:
        try:
            f()
        except Exception:
            failed += 1
    assert failed, "every original test passed"
"""


def invert(original: Path) -> str:
    """The text of a final test file asserting the opposite of ``original`` (plain test functions)."""
    return TEMPLATE.format(source=original.read_text())


def inverted_dir(tasks_dir: Path, out: Path) -> Path:
    """``out/<task_id>/test_final_state.py`` inverting each task folder's final tests under ``tasks_dir``."""
    for t in sorted(Path(tasks_dir).glob("*/test_final_state.py")):
        d = out / t.parent.name
        d.mkdir(parents=True, exist_ok=True)
        (d / "test_final_state.py").write_text(invert(t))
    return out
