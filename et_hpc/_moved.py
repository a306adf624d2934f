"""Old import paths of modules that moved: each leaves a two-line shim that forwards lookups.

The shim resolves names on first use (``from old.path import Name`` and pickles naming the old
path keep working) without importing the new module when the old package is imported, so a
shim never makes a lower layer load a higher one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def forward(new: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` that looks ``name`` up in the module ``new``."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(importlib.import_module(new), name)

    return __getattr__
