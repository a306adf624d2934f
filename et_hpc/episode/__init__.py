"""One episode end to end (``run``: sandbox, agent, scoring, record) and the task check built on it
(``check``). Names of ``run`` are also reachable here, their old home (``et_hpc.episode``)."""

from et_hpc._moved import forward

__getattr__ = forward("et_hpc.episode.run")
