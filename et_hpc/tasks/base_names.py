"""Base images as recipes name them: the names a ``From:`` line may use, where the cached SIF for
each lives, and the lookup that resolves a recipe's name (``./``, ``docker://`` and ``name:tag``
spellings tolerated). Building the base is ``et_hpc.images.base``.
"""

from __future__ import annotations

from pathlib import Path

from et_hpc import paths

DEFAULT_NAME = "ubuntu_22.04"

# Names under which task recipes refer to the base image.
ALIASES = {
    DEFAULT_NAME: ["ubuntu_22.04.sif", "./ubuntu_22.04.sif", "ubuntu:22.04", "docker://ubuntu:22.04"],
}


def base_dir(cache: Path | None = None) -> Path:
    return Path(cache or paths.cache_dir()) / "base"


def base_path(name: str = DEFAULT_NAME, cache: Path | None = None) -> Path:
    return base_dir(cache) / f"{name}.sif"


def default_base_map(cache: Path | None = None) -> dict[str, Path]:
    """Map every name a recipe may use for a base image to its cached SIF."""
    out: dict[str, Path] = {}
    for name, aliases in ALIASES.items():
        p = base_path(name, cache)
        out[f"{name}.sif"] = p
        for a in aliases:
            out[a] = p
    return out


def lookup_base(name: str, base_map: dict[str, Path]) -> Path | None:
    """Find ``name`` (as written in a recipe) in the base map, tolerating ``./`` and ``docker://``."""
    candidates = [name]
    stripped = name[2:] if name.startswith("./") else name
    candidates += [stripped, "./" + stripped]
    bare = stripped[len("docker://") :] if stripped.startswith("docker://") else stripped
    candidates += [bare, "docker://" + bare]
    if ":" in bare and "/" not in bare:  # ubuntu:22.04 -> ubuntu_22.04.sif
        candidates += [bare.replace(":", "_") + ".sif", "./" + bare.replace(":", "_") + ".sif"]
    for c in candidates:
        if c in base_map:
            return Path(base_map[c])
    return None


def known_bases(base_map: dict[str, Path]) -> str:
    return ", ".join(sorted(base_map)) or "(none: build the base with 'et-hpc base build')"
