"""Error types shared by every part of et-hpc.

``UserError`` is anything a user can cause and fix (bad task folder, bad config, missing image,
server down). The CLI prints its message as one line and exits with status 2; library callers
catch it like any exception. Infrastructure failures during an episode are *not* raised to the
user: they are recorded on the episode with an error status (never as reward 0).
"""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix. ``str(err)`` is one line naming the thing and the fix."""

    exit_code = 2


class TaskError(UserError):
    """A task folder or row that cannot be loaded; names the file. ``task_id``: the task it belongs
    to, when the loader knows it."""

    def __init__(self, message: str, task_id: str | None = None):
        super().__init__(message)
        self.task_id = task_id


class InfraError(RuntimeError):
    """Apptainer, Slurm, the filesystem or the policy server failed underneath us."""
