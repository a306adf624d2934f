"""Reading a task's files: every failure becomes one actionable ``TaskError`` line."""

from __future__ import annotations

from pathlib import Path

from et_hpc.errors import TaskError


def read_text(path: Path, what: str = "file") -> str:
    """Read a UTF-8 text file, turning every failure into a one-line ``TaskError``."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise TaskError(f"{path}: {what} not found; add it") from None
    except OSError as e:
        raise TaskError(f"{path}: cannot read {what}: {e.strerror or e}; check that it is a readable file") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TaskError(f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); re-save it as UTF-8") from None
