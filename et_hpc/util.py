"""Small helpers used across et-hpc: atomic file writes, hashing, human formatting, output tails."""

from __future__ import annotations

import hashlib
import os
import secrets
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO


@contextmanager
def atomic_open(path: Path, *, tmp_name: str | None = None, mode: int = 0o666, dir_mode: int = 0o777) -> Iterator[BinaryIO]:
    """Open a hidden temp file beside ``path`` for writing; on success fsync it and rename it over
    ``path``, so readers see the old file or the whole new one, never part. On error it is removed.
    ``mode``: the file's permissions, ``dir_mode`` those of a directory made for it (umask applies)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=dir_mode)
    tmp = path.parent / (tmp_name or f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see ``atomic_open``)."""
    with atomic_open(path) as f:
        f.write(data)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def pct(x: float | None) -> str:
    """A fraction as a percentage with one decimal, ``-`` for None."""
    return "-" if x is None else f"{100 * x:.1f}%"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table with aligned columns (no dependency, pipes well)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def num(x: float | None, fmt: str = "{:.1f}") -> str:
    """``x`` formatted, ``-`` for None."""
    return "-" if x is None else fmt.format(x)


def one_line(s: str, width: int) -> str:
    """``s`` with its whitespace collapsed, cut to ``width`` characters with ``...``."""
    s = " ".join(s.split())
    return s if len(s) <= width else s[: width - 3] + "..."


def as_text(data: str | bytes | None) -> str:
    """Command output as text: bytes decoded as UTF-8 (bad bytes replaced), None as ``""``."""
    if data is None:
        return ""
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else data


def tail_lines(
    text: str | bytes | None,
    n: int | None = None,
    *,
    raw: bool = False,
    width: int | None = None,
    drop: Callable[[str], bool] | None = None,
) -> list[str]:
    """The last ``n`` lines of ``text`` (all when None). Blank lines are left out and trailing spaces
    cut unless ``raw``; lines for which ``drop`` is true are left out; each is cut to ``width``."""
    lines = as_text(text).splitlines()
    if not raw:
        lines = [ln.rstrip() for ln in lines if ln.strip()]
    if drop is not None:
        lines = [ln for ln in lines if not drop(ln)]
    if n is not None:
        lines = lines[-n:]
    return [ln[:width] for ln in lines] if width else lines


def file_tail(path: Path | None, n: int | None = None, **kw: object) -> list[str]:
    """``tail_lines`` of a file's text; ``[]`` when there is no path or it cannot be read."""
    if path is None:
        return []
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return []
    return tail_lines(text, n, **kw)  # type: ignore[arg-type]


def progress_bar(items: Any = None, *, desc: str, unit: str, show: bool | None = None, **kw: Any) -> Any:
    """A tqdm progress bar on stderr (tqdm is imported on first use). ``show``: True always, False
    never, None only when stderr is a terminal. Other keywords go to tqdm."""
    from tqdm import tqdm

    from et_hpc.text import unescaped

    # the bar is our own text and redraws with carriage returns: it writes to the stream itself
    return tqdm(items, desc=desc, unit=unit, file=unescaped(sys.stderr), disable=None if show is None else not show, **kw)
