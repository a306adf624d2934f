"""Settings of a continuous run: ``ContinuousConfig`` lives in ``et_hpc.runner.config`` beside the
``RunConfig`` that composes it; its old name is kept here."""

from et_hpc.runner.config import ContinuousConfig, ContinuousOptions

__all__ = ["ContinuousConfig", "ContinuousOptions"]
