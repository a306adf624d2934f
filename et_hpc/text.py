"""The one sanitizer for text that leaves a sandbox: control characters shown as visible escapes.

``visible(s)`` is what every observation, note, event, score note, log line, CLI print and viewer
string goes through. C0 controls (newline and tab kept), DEL, C1 (U+0080-U+009F: 8-bit CSI, OSC,
...) become ``\\xHH``; lone surrogates (undecodable bytes under ``surrogateescape``) become
``\\udcHH``. An escape sequence starts with ESC or a C1 control, so it is shown whole as text
(``\\x1b[31m``) and never acts. The result is valid UTF-8, printable and idempotent. ``VisibleStream``
and ``VisibleFormatter`` apply it to a stream and to log lines. What it does not cover: SECURITY.md.
"""

from __future__ import annotations

import io
import logging
import re
import sys
from typing import Any, TextIO

# C0 but newline and tab, DEL, C1, lone surrogates; with ``newlines=False`` newline and tab too
_HIDDEN = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
_HIDDEN_ONE_LINE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _escape(m: re.Match[str]) -> str:
    o = ord(m.group())
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}"


def visible(text: str, *, newlines: bool = True) -> str:
    """``text`` with every control character and lone surrogate as a visible escape (``\\x1b``,
    ``\\x9b``, ``\\udcff``); newline and tab are kept unless ``newlines`` is False."""
    return (_HIDDEN if newlines else _HIDDEN_ONE_LINE).sub(_escape, text)


def hidden_count(text: str, *, newlines: bool = True) -> int:
    """How many characters ``visible(text, newlines=...)`` escapes."""
    return sum(1 for _ in (_HIDDEN if newlines else _HIDDEN_ONE_LINE).finditer(text))


def visible_all(value: Any) -> tuple[Any, int]:
    """``value`` (str, list, tuple, dict, scalar) with every string in it (dict keys too) through
    ``visible``; and how many characters were escaped."""
    if isinstance(value, str):
        n = hidden_count(value)
        return (visible(value) if n else value), n
    if isinstance(value, (list, tuple)):
        pairs = [visible_all(v) for v in value]
        return [v for v, _ in pairs], sum(n for _, n in pairs)
    if isinstance(value, dict):
        out, total = {}, 0
        for k, v in value.items():
            k2, n1 = visible_all(k)
            v2, n2 = visible_all(v)
            out[k2] = v2
            total += n1 + n2
        return out, total
    return value, 0


def storable(value: Any) -> tuple[Any, bool]:
    """``value`` with every string UTF-8 cannot encode (one holding a lone surrogate) written with
    ``\\udcHH`` escapes, other text unchanged (what the store and the exports write); and whether
    anything was escaped."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode("utf-8"), True
        return value, False
    if isinstance(value, (list, tuple)):
        pairs = [storable(v) for v in value]
        return [v for v, _ in pairs], any(e for _, e in pairs)
    if isinstance(value, dict):
        out, any_ = {}, False
        for k, v in value.items():
            k2, e1 = storable(k)
            v2, e2 = storable(v)
            out[k2] = v2
            any_ = any_ or e1 or e2
        return out, any_
    return value, False


class VisibleStream(io.TextIOBase):
    """A text stream that writes everything through ``visible`` to ``inner``. ``raw`` is ``inner``,
    for what must draw on a terminal itself (a progress bar of et-hpc's own text)."""

    def __init__(self, inner: TextIO) -> None:
        self.raw = inner

    def write(self, s: str) -> int:
        self.raw.write(visible(s))
        return len(s)

    def flush(self) -> None:
        self.raw.flush()

    def isatty(self) -> bool:
        return self.raw.isatty()

    def fileno(self) -> int:
        return self.raw.fileno()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.raw, "encoding", None) or "utf-8"


def unescaped(stream: TextIO) -> TextIO:
    """The stream under a ``VisibleStream`` (``stream`` itself otherwise)."""
    return stream.raw if isinstance(stream, VisibleStream) else stream


class VisibleFormatter(logging.Formatter):
    """A log formatter whose lines (message, arguments and traceback) go through ``visible``."""

    def format(self, record: logging.LogRecord) -> str:
        return visible(super().format(record))


def configure_logging(level: int) -> None:
    """Log to stderr at ``level`` through ``VisibleFormatter`` (the CLI, Slurm jobs, workers)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(VisibleFormatter(LOG_FORMAT))
    logging.basicConfig(level=level, handlers=[handler])
