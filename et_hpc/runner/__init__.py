"""Running many episodes: run config, planning (resume), the local and Slurm executors, status.

A *unit* is one (task, sample) pair. Executors hand units to a *unit runner*, a callable
``runner(task, sample, cfg, image, stop) -> record`` that runs one episode and returns its record
(the default is :func:`et_hpc.runner.local.episode_runner`). Finished records go to the run's store
as they finish, so an interrupted run resumes where it stopped. ``base.Executor`` is what an
executor does; ``executors.get_executor(name)`` gives the local or the Slurm one, and its
``submit_array`` starts any array of tasks (continuous workers and image builds too: ``arrays``).
"""

from __future__ import annotations
