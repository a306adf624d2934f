"""The long tier: tests marked ``slow_model`` (llama-cpp-python's server, built from its sdist) run only
under ``scripts/test --long`` (``ET_HPC_LONG=1``); otherwise they are deselected, in CI too."""

from __future__ import annotations

import os

import pytest

LONG = os.environ.get("ET_HPC_LONG") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if LONG:
        return
    slow = [i for i in items if i.get_closest_marker("slow_model") is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [i for i in items if i.get_closest_marker("slow_model") is None]
