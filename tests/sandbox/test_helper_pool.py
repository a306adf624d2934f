"""The idle entry helper: ready before scoring, and gone without a trace when never used."""

from __future__ import annotations

import time

from et_hpc.scoring import helper_pool


def test_an_unused_helper_exits_when_its_pipe_closes() -> None:
    h = helper_pool.spawn()
    time.sleep(0.2)
    assert h.proc.poll() is None  # positive control: it waits for its config
    helper_pool._discard(h)
    assert h.proc.returncode == 3  # it read no config (exit 3, ET-ENTER-FAILED) and entered nothing


def test_take_leaves_one_ready_and_close_idle_ends_it() -> None:
    first = helper_pool.take()
    deadline = time.monotonic() + 30
    while not helper_pool._idle and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(helper_pool._idle) == 1
    ready = helper_pool._idle[0]
    assert ready.proc.poll() is None and ready is not first
    helper_pool._discard(first)
    helper_pool.close_idle()
    assert helper_pool._idle == [] and ready.proc.returncode == 3
