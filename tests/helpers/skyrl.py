"""SkyRL 0.4.0's own ``GeneratorOutput`` and ``TrajectoryID``, loaded from its wheel.

``skyrl`` needs Python >= 3.12, so scripts/provision-debian unpacks its wheel beside the venv (as
for harbor). Only ``skyrl/train/generators/base.py`` is loaded, under a private name: its imports
of torch and of three SkyRL backend types are satisfied by placeholders for as long as it loads.
Those types annotate fields that et-hpc leaves None (images, expert routes, sampler support), so
the placeholders decide nothing; every other annotation is SkyRL's own, checked value by value.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any

SKYRL_VERSION = "0.4.0"
SKYRL = Path(os.environ.get("ET_HPC_SKYRL", Path(sys.prefix) / f"skyrl-{SKYRL_VERSION}"))
BASE = SKYRL / "skyrl" / "train" / "generators" / "base.py"

_PLACEHOLDERS = {
    "skyrl.backends.skyrl_train.inference_servers.base": "ConversationType",
    "skyrl.backends.skyrl_train.utils.routed_experts": "RoutedExpertIndices",
    "skyrl.backends.skyrl_train.utils.sample_support": "SampleSupport",
}


def _placeholder_modules() -> dict[str, types.ModuleType]:
    mods: dict[str, types.ModuleType] = {}
    if importlib.util.find_spec("torch") is None:
        torch = types.ModuleType("torch")
        torch.Tensor = type("Tensor", (), {})  # type: ignore[attr-defined]
        mods["torch"] = torch
    for name, attr in _PLACEHOLDERS.items():
        parts = name.split(".")
        for i in range(1, len(parts)):
            mods.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        m = types.ModuleType(name)
        setattr(m, attr, type(attr, (), {}))
        mods[name] = m
    return mods


@functools.cache
def load_base() -> types.ModuleType:
    """SkyRL's ``skyrl.train.generators.base`` from the unpacked wheel, loaded once (FileNotFoundError if absent)."""
    if not BASE.is_file():
        raise FileNotFoundError(f"SkyRL {SKYRL_VERSION} is not at {SKYRL} (run scripts/provision-debian)")
    placeholders = _placeholder_modules()
    saved = {k: sys.modules.get(k) for k in placeholders}
    sys.modules.update(placeholders)
    try:
        spec = importlib.util.spec_from_file_location("_skyrl_040_generators_base", BASE)
        assert spec and spec.loader
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def _conforms(value: Any, tp: Any, trajectory_id: type) -> bool:
    """Whether ``value`` is of the annotation ``tp`` (the typing forms GeneratorOutput uses)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    if origin is typing.Union:
        return any(_conforms(value, a, trajectory_id) for a in args)
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, args[0], trajectory_id) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            _conforms(k, args[0], trajectory_id) and _conforms(v, args[1], trajectory_id) for k, v in value.items()
        )
    if tp is trajectory_id:
        return isinstance(value, trajectory_id)
    if tp is float:
        return isinstance(value, float)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(tp, type):
        return isinstance(value, tp)
    raise TypeError(f"annotation not handled: {tp!r}")


def as_skyrl(go: dict[str, Any]) -> dict[str, Any]:
    """``go`` with each trajectory id rebuilt as SkyRL's own ``TrajectoryID`` from its fields
    (which must be exactly SkyRL's), checked against every annotation of SkyRL's ``GeneratorOutput``
    (raises AssertionError naming the first key that does not conform)."""
    base = load_base()
    gen, tid = base.GeneratorOutput, base.TrajectoryID
    assert set(go) == set(gen.__required_keys__) and not gen.__optional_keys__, set(go) ^ set(gen.__required_keys__)
    out = dict(go)
    if go["trajectory_ids"] is not None:
        names = [f.name for f in dataclasses.fields(tid)]
        ids = []
        for t in go["trajectory_ids"]:
            assert dataclasses.is_dataclass(t) and [f.name for f in dataclasses.fields(t)] == names, t
            skyrl_id = tid(**{n: getattr(t, n) for n in names})
            assert skyrl_id.to_string() == t.to_string()
            ids.append(skyrl_id)
        out["trajectory_ids"] = ids
    for key, tp in typing.get_type_hints(gen).items():
        assert _conforms(out[key], tp, tid), f"{key}: does not conform to SkyRL's {tp}"
    return out
