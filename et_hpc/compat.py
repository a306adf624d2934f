"""Old names that still resolve, what replaced them, and the release that removes them.

The one place a compat name is recorded: each is a module that forwards names (``_moved.forward``)
or a class alias kept for code, configs and submitit pickles of queued jobs that name it. The
README lists the same table; ``tests/test_compat.py`` checks that both and the code agree.
"""

from __future__ import annotations

REMOVE_IN = "0.3.0"  # the default: two releases after 0.1.0

# old dotted name -> (new dotted name, release that removes the old one)
COMPAT: dict[str, tuple[str, str]] = {
    # modules that forward names
    "et_hpc.store": ("et_hpc.runs.store", REMOVE_IN),
    "et_hpc.images.cli": ("et_hpc.images.slurm_build", REMOVE_IN),
    "et_hpc.rollouts.options": ("et_hpc.runner.config", REMOVE_IN),
    "et_hpc.scripted_server": ("et_hpc.testing.scripted_server", REMOVE_IN),
    "et_hpc.scripted_tokenizer": ("et_hpc.testing.scripted_tokenizer", REMOVE_IN),
    "et_hpc.tasks.bases": ("et_hpc.tasks.base_names", REMOVE_IN),
    "et_hpc.agent.protocols": ("et_hpc.agent.wire", REMOVE_IN),
    "et_hpc.sandbox.scoring": ("et_hpc.scoring.live", REMOVE_IN),
    "et_hpc.sandbox.sweep": ("et_hpc.scoring.sweep", REMOVE_IN),
    "et_hpc.sandbox.helper_pool": ("et_hpc.scoring.helper_pool", REMOVE_IN),
    "et_hpc.sandbox.enter": ("et_hpc.scoring.enter", REMOVE_IN),
    "et_hpc.sandbox.enter_sys": ("et_hpc.scoring.enter_sys", REMOVE_IN),
    "et_hpc.sandbox.enter_view": ("et_hpc.scoring.enter_view", REMOVE_IN),
    "et_hpc.sandbox.enter_pytest": ("et_hpc.scoring.enter_pytest", REMOVE_IN),
    # class aliases
    "et_hpc.images.store.StoreSettings": ("et_hpc.images.store.ImageStoreConfig", REMOVE_IN),
    "et_hpc.agent.loop.Budgets": ("et_hpc.agent.loop.BudgetConfig", REMOVE_IN),
    "et_hpc.tasks.loader.TaskSelection": ("et_hpc.tasks.loader.TaskSelectionConfig", REMOVE_IN),
    "et_hpc.sandbox.config.SandboxOptions": ("et_hpc.sandbox.config.SandboxConfig", REMOVE_IN),
    "et_hpc.runner.config.ContinuousOptions": ("et_hpc.runner.config.ContinuousConfig", REMOVE_IN),
    "et_hpc.host.slurm.SlurmOptions": ("et_hpc.host.slurm.SlurmConfig", REMOVE_IN),
}
