"""Tasks: the model (``model.py``) and the sources that load it (native, Harbor, SkyRL parquet)."""

from et_hpc.tasks.model import Limits, Recipe, Task

__all__ = ["Limits", "Recipe", "Task"]
