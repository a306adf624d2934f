"""Every field of the config models has a description: its attribute docstring
(``use_attribute_docstrings``), so a key's meaning lives beside the key."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict

from et_hpc.agent.loop import BudgetConfig
from et_hpc.agent.policies import PolicyConfig
from et_hpc.episode.config import EpisodeConfig
from et_hpc.host.slurm import SlurmConfig
from et_hpc.images.store import ImageStoreConfig
from et_hpc.runner.config import ContinuousConfig, RunConfig
from et_hpc.sandbox.config import SandboxConfig
from et_hpc.tasks.loader import TaskSelectionConfig

MODELS = [
    EpisodeConfig,
    RunConfig,
    ContinuousConfig,
    SandboxConfig,
    ImageStoreConfig,
    TaskSelectionConfig,
    SlurmConfig,
    BudgetConfig,
    PolicyConfig,
]


def undocumented(model: type[BaseModel]) -> list[str]:
    """The fields of ``model`` without a description."""
    return [name for name, f in model.model_fields.items() if not (f.description or "").strip()]


def test_the_check_flags_an_undocumented_field() -> None:
    class Documented(BaseModel):
        model_config = ConfigDict(use_attribute_docstrings=True)

        a: int = 1
        """What a is."""

    class Undocumented(BaseModel):
        model_config = ConfigDict(use_attribute_docstrings=True)

        a: int = 1
        """What a is."""
        b: int = 2  # a comment is not a description

    assert undocumented(Documented) == []
    assert Documented.model_fields["a"].description == "What a is."
    assert undocumented(Undocumented) == ["b"]


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_every_config_field_has_a_description(model: type[BaseModel]) -> None:
    assert model.model_config.get("use_attribute_docstrings") is True
    assert undocumented(model) == []


def test_a_description_is_the_fields_docstring() -> None:
    assert SandboxConfig.model_fields["binds"].description.startswith("Host directories the sandboxes see")
    assert RunConfig.model_fields["sandbox"].description == EpisodeConfig.model_fields["sandbox"].description
