"""One idle entry helper kept ready, so scoring does not wait for a host Python to start.

``take()`` returns a started ``et_hpc.scoring.enter`` helper (``Helper``: the process and the write
end of its config pipe) and starts the next one in the background. An idle helper is our own host
process, outside every instance (the same argv, empty environment and session of its own as one
started on demand): it has only imported its stdlib modules and waits for its config on stdin,
knowing no instance until then. ``Helper.feed`` sends the config with its length first, so the
helper never waits for an end of file. A helper is used once. When our process ends, its
config pipe closes and an idle helper exits without doing anything.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import threading
from dataclasses import dataclass

from et_hpc.scoring import enter


@dataclass
class Helper:
    proc: subprocess.Popen
    cfg_w: int

    def feed(self, payload: bytes) -> None:
        """Write the config (its byte count on a line, then the bytes) and close the pipe. A helper that
        died early is seen later: it prints no result."""
        try:
            view = memoryview(b"%d\n" % len(payload) + payload)
            while view:
                view = view[os.write(self.cfg_w, view) :]
        except OSError:
            pass
        finally:
            os.close(self.cfg_w)


def spawn(stdout: int = subprocess.PIPE) -> Helper:
    """Start a helper now (OSError when it cannot be started)."""
    cfg_r, cfg_w = os.pipe()  # the config goes through a pipe only we hold
    try:
        proc = subprocess.Popen(
            enter.helper_argv(), stdin=cfg_r, stdout=stdout, stderr=stdout, start_new_session=True, close_fds=True, env={}
        )
    except OSError:
        os.close(cfg_w)
        raise
    finally:
        os.close(cfg_r)
    return Helper(proc, cfg_w)


_lock = threading.Lock()
_idle: list[Helper] = []


def take() -> Helper:
    """An idle helper if one is ready (else a new one), and the next one started."""
    with _lock:
        ready = [h for h in _idle if h.proc.poll() is None]
        for h in _idle:
            if h not in ready:
                _discard(h)
        helper = ready.pop() if ready else None
        _idle[:] = ready
    helper = helper or spawn()
    threading.Thread(target=_refill, name="et-entry-helper", daemon=True).start()
    return helper


def _refill() -> None:
    try:
        h = spawn()
    except OSError:
        return
    with _lock:
        if _idle:
            _discard(h)
        else:
            _idle.append(h)


def _discard(h: Helper) -> None:
    """End an unused helper: its pipe closes, so it reads a short config and exits."""
    try:
        os.close(h.cfg_w)
    except OSError:
        pass
    try:
        h.proc.communicate(timeout=5)
    except (subprocess.TimeoutExpired, OSError, ValueError):
        h.proc.kill()


@atexit.register
def close_idle() -> None:
    """End the idle helpers (at exit, and for tests)."""
    with _lock:
        for h in _idle:
            _discard(h)
        _idle.clear()
