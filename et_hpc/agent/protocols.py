"""Moved to ``et_hpc.agent.wire``; this path is kept for code that names it."""

from et_hpc._moved import forward

__getattr__ = forward("et_hpc.agent.wire")
