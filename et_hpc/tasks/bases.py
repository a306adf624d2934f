"""Moved to ``et_hpc.tasks.base_names`` (beside ``et_hpc.images.base``, which builds the base);
this path forwards names until the release that ``et_hpc.compat.COMPAT`` gives."""

from et_hpc._moved import forward

__getattr__ = forward("et_hpc.tasks.base_names")
