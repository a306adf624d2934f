"""Episode sandboxes: one Apptainer instance per episode, its persistent shell, and cleanup.

- ``shell.Shell``: one persistent bash (markers, real timeouts, bounded output)
- ``sandbox.Sandbox``: the instance with its per-episode overlay; always stopped
- ``reaper.reap``: stops what dead workers left behind
- ``config.SandboxConfig``: the ``sandbox`` block of a run config
(the wrapper around the ``apptainer`` command line is ``et_hpc.host.apptainer``)
"""

from __future__ import annotations

from et_hpc.sandbox.shell import CommandResult, Shell

__all__ = ["CommandResult", "Shell"]
