"""Continuous rollouts: a work queue on the shared filesystem, long-lived workers, a trainer stream.

- ``queue``: unit files claimed by rename, leases with a heartbeat, exactly-once commit, the stream slots;
- ``worker``: the long-lived worker (a submitit array task or a local thread);
- ``controller``: ``et-hpc run --continuous`` (epochs, stop conditions, workers);
- ``stream``: ``RolloutStream`` for trainers (persistent cursor, staleness bound);
- ``versions``: the trainer-owned policy version (``publish_version``);
- ``cli``: ``et-hpc rollouts tail|publish|stop``.

The walk-through of a training session is in ``slurm/README.md``; the store it reads in ``docs/store.md``.
"""

from et_hpc.rollouts.stream import RolloutGroup, RolloutStream
from et_hpc.rollouts.versions import PolicyVersion, publish_version, read_version

__all__ = ["PolicyVersion", "RolloutGroup", "RolloutStream", "publish_version", "read_version"]
