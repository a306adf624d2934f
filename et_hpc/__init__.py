"""et-hpc: Endless Terminals agent episodes on HPC clusters (rootless Apptainer, Slurm, parquet)."""

__version__ = "0.1.0"
