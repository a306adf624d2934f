"""The CLI wraps stdout and stderr in one ``VisibleStream``, also when a command runs another
in-process (the demo runs ``run``): a progress bar drawn on ``unescaped(sys.stderr)`` reaches the
terminal with its carriage returns, everything else is escaped."""

from __future__ import annotations

import io
import sys

import et_hpc.cli.app as app
from et_hpc.text import VisibleStream, unescaped


def test_a_command_run_from_another_is_wrapped_once(monkeypatch) -> None:
    raw = io.StringIO()
    seen = []

    def command(argv):
        seen.append(sys.stderr)
        if len(seen) == 1:
            app.main(["inner"])  # the nested command
        unescaped(sys.stderr).write("\rbar")  # a progress bar
        sys.stderr.write("\x1b[2J")  # anything else
        return 0

    monkeypatch.setattr(app, "_main", command)
    monkeypatch.setattr(sys, "stderr", raw)
    assert app.main(["outer"]) == 0
    assert sys.stderr is raw
    assert all(isinstance(s, VisibleStream) and s.raw is raw for s in seen), seen
    assert raw.getvalue() == "\rbar\\x1b[2J" * 2  # positive control: the escape is shown, the bar is not
