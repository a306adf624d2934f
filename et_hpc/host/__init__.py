"""Thin wrappers over the host's tools: ``apptainer`` (the command line), ``slurm`` (queries of
squeue/sacct and the job's own state), ``doctor`` (checks of the host)."""
