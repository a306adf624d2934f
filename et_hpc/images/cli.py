"""Moved to ``et_hpc.images.slurm_build``; this path is kept for build arrays queued before the move
(submitit pickled ``et_hpc.images.cli.BuildChunk``)."""

from et_hpc._moved import forward

__getattr__ = forward("et_hpc.images.slurm_build")
