"""Moved to ``et_hpc.testing.scripted_tokenizer``; this path forwards names until the release that
``et_hpc.compat.COMPAT`` gives."""

from et_hpc._moved import forward

__getattr__ = forward("et_hpc.testing.scripted_tokenizer")
