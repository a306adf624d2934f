"""Apptainer def files: parse them, and normalise a task's recipe into the def that gets built.

Normalising makes an Endless Terminals def buildable offline and reproducibly, and changes
nothing else:
- ``Bootstrap: localimage`` with a relative ``From:`` (``./ubuntu_22.04.sif``) is resolved
  through a *base map* (name as written -> cached base SIF). ``Bootstrap: docker`` naming an
  image that the base map knows (``ubuntu:22.04``) is switched to that local image too.
- ``%post`` gets ``-c /bin/bash`` unless it already names a shell (generated defs use bash).
- relative ``%files`` sources are made absolute against the context dir, and must exist.
Every change is one human line in ``NormalisedRecipe.rewrites``. Harbor Dockerfiles are turned
into the same ``NormalisedRecipe`` by :mod:`et_hpc.tasks.dockerfile`.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from et_hpc.errors import TaskError
from et_hpc.tasks.base_names import known_bases, lookup_base  # noqa: F401  (re-exported)
from et_hpc.tasks.files import read_text  # noqa: F401  (re-exported)
from et_hpc.tasks.model import NormalisedRecipe  # noqa: F401  (re-exported)

if TYPE_CHECKING:  # pragma: no cover
    from et_hpc.tasks.model import Recipe, Task

# Section names Apptainer 1.4 accepts (``%appX`` sections take an app name argument).
SECTIONS = frozenset(
    {
        "setup",
        "files",
        "environment",
        "post",
        "runscript",
        "test",
        "labels",
        "help",
        "startscript",
        "arguments",
        "appinstall",
        "apphelp",
        "apprun",
        "applabels",
        "appenv",
        "appfiles",
        "appstart",
        "apptest",
    }
)
_SECTION_RE = re.compile(r"^\s*%(\S*)(.*)$")
_HEADER_RE = re.compile(r"^([A-Za-z][A-Za-z0-9_-]*)\s*:\s*(.*)$")


@dataclass
class Section:
    name: str  # without the '%'
    args: str  # the rest of the header line, e.g. "-c /bin/bash" or an app name
    line: int  # 1-based line number of the '%name' line
    body: list[str] = field(default_factory=list)


@dataclass
class DefFile:
    """A parsed def: header lines (in order) and sections; ``lines`` is the original text split."""

    path: Path
    lines: list[str]
    header: dict[str, tuple[int, str]]  # lower-cased key -> (line number, value)
    sections: list[Section]

    @property
    def bootstrap(self) -> str:
        return self.header["bootstrap"][1].strip()

    @property
    def from_(self) -> str | None:
        v = self.header.get("from")
        return v[1].strip() if v else None

    def section(self, name: str) -> Section | None:
        return next((s for s in self.sections if s.name == name), None)


def parse_def_text(text: str, path: Path) -> DefFile:
    """Parse def text; raise ``TaskError`` naming ``path`` and the line for anything Apptainer rejects."""
    lines = text.splitlines()
    header: dict[str, tuple[int, str]] = {}
    sections: list[Section] = []
    for i, line in enumerate(lines, 1):
        m = _SECTION_RE.match(line)
        if m:  # Apptainer treats any line starting with '%' (after blanks) as a section header
            name, args = m.group(1), m.group(2).strip()
            if name not in SECTIONS:
                raise TaskError(f"{path}:{i}: unknown section '%{name}'; Apptainer knows " + ", ".join("%" + s for s in sorted(SECTIONS)))
            sections.append(Section(name, args, i))
            continue
        if sections:
            sections[-1].body.append(line)
            continue
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        hm = _HEADER_RE.match(s)
        if not hm:
            raise TaskError(f"{path}:{i}: header line {s[:60]!r} is not 'Key: value'; fix or remove it")
        key = hm.group(1).lower()
        if key not in header:  # a later stage's header is left alone
            header[key] = (i, hm.group(2))
    if "bootstrap" not in header:
        raise TaskError(f"{path}: no 'Bootstrap:' header; start the def with e.g. 'Bootstrap: localimage'")
    if not header["bootstrap"][1].strip():
        raise TaskError(f"{path}:{header['bootstrap'][0]}: 'Bootstrap:' has no value; name an agent such as localimage")
    return DefFile(path=Path(path), lines=lines, header=header, sections=sections)


def parse_def(path: Path) -> DefFile:
    return parse_def_text(read_text(path, "def file"), Path(path))


def _post_has_shell(args: str) -> bool:
    try:
        toks = shlex.split(args)
    except ValueError:
        toks = args.split()
    return "-c" in toks


def normalise_def(def_path: Path, context_dir: Path | None, base_map: dict[str, Path]) -> NormalisedRecipe:
    """Normalise one def file (see the module docstring for the rules)."""
    def_path = Path(def_path).resolve()
    context = Path(context_dir).resolve() if context_dir else def_path.parent
    d = parse_def(def_path)
    out = list(d.lines)
    rewrites: list[str] = []
    files: list[tuple[Path, str]] = []
    base = _rewrite_bootstrap(def_path, d, base_map, out, rewrites)
    for sec in d.sections:
        if sec.name == "post" and not _post_has_shell(sec.args):
            new = ("%post " + sec.args).rstrip() + " -c /bin/bash"
            out[sec.line - 1] = new
            rewrites.append(f"line {sec.line}: %post{(' ' + sec.args) if sec.args else ''} -> {new.strip()}")
        if sec.name in ("files", "appfiles") and not sec.args.startswith("from "):  # from: another build stage
            _rewrite_files(def_path, sec, context, out, rewrites, files)
    text = "\n".join(out) + "\n"
    return NormalisedRecipe(text=text, files=files, base=base, rewrites=rewrites, kind="def", source=def_path)


def _rewrite_bootstrap(def_path: Path, d: DefFile, base_map: dict[str, Path], out: list[str], rewrites: list[str]) -> Path | None:
    """The base image the header names through ``base_map`` (``localimage``: required; ``docker``:
    when the map knows it, switched to ``localimage``), rewritten in ``out``; None for another base."""
    boot_line, boot = d.header["bootstrap"]
    boot = boot.strip()
    frm = d.header.get("from")
    if boot.lower() == "localimage":
        if not frm or not frm[1].strip():
            raise TaskError(f"{def_path}: 'Bootstrap: localimage' without 'From:'; name the base SIF")
        ln, value = frm[0], frm[1].strip()
        if Path(value).is_absolute():
            return Path(value)
        found = lookup_base(value, base_map)
        if found is None:
            raise TaskError(f"{def_path}:{ln}: unknown base image {value!r}; known names: {known_bases(base_map)}")
        out[ln - 1] = f"From: {found}"
        rewrites.append(f"From: {value} -> {found}")
        return found
    if boot.lower() in ("docker", "docker-daemon") and frm and frm[1].strip():
        ln, value = frm[0], frm[1].strip()
        found = lookup_base(value, base_map)
        if found is not None:
            out[boot_line - 1] = "Bootstrap: localimage"
            out[ln - 1] = f"From: {found}"
            rewrites.append(f"Bootstrap: {boot} / From: {value} -> Bootstrap: localimage / From: {found} (cached base)")
        return found
    return None


def _rewrite_files(def_path: Path, sec: Section, context: Path, out: list[str], rewrites: list[str], files: list[tuple[Path, str]]) -> None:
    """A ``%files`` section's sources (relative ones from ``context``, which must exist) appended to
    ``files``; relative sources rewritten in ``out`` as absolute paths."""
    for j, raw in enumerate(sec.body):
        lineno = sec.line + 1 + j
        s = raw.strip()
        if not s or s.startswith("#"):
            continue
        try:
            toks = shlex.split(s)
        except ValueError as e:
            raise TaskError(f"{def_path}:{lineno}: cannot parse %files line ({e}); quote it properly") from None
        src = toks[0]
        dest = toks[1] if len(toks) > 1 else src
        host = Path(src) if Path(src).is_absolute() else (context / src)
        if not host.exists():
            raise TaskError(f"{def_path}:{lineno}: %files source {src!r} not found (looked in {context}); add it to the task folder")
        host = host.resolve()
        files.append((host, dest))
        if not Path(src).is_absolute():
            indent = raw[: len(raw) - len(raw.lstrip())]
            out[lineno - 1] = f"{indent}{shlex.quote(str(host))} {shlex.quote(dest)}"
            rewrites.append(f"line {lineno}: %files {src} -> {host} {dest}")


def normalise(task_or_recipe_path: Task | Recipe | Path | str, *, base_map: dict[str, Path]) -> NormalisedRecipe:
    """Normalise a task's recipe, a ``Recipe``, or a recipe file (``*.def`` / ``Dockerfile`` / ``*.sif``).

    Raises ``TaskError`` (naming the file and line) for anything that cannot be built as written.
    """
    from et_hpc.tasks.model import Recipe, Task

    if isinstance(task_or_recipe_path, Task):
        recipe = task_or_recipe_path.recipe
    elif isinstance(task_or_recipe_path, Recipe):
        recipe = task_or_recipe_path
    else:
        p = Path(task_or_recipe_path)
        if p.is_dir():
            from et_hpc.tasks.folder import load_task_folder

            recipe = load_task_folder(p).recipe
        else:
            kind: Literal["def", "dockerfile", "sif"] = (
                "sif" if p.suffix == ".sif" else ("dockerfile" if "dockerfile" in p.name.lower() else "def")
            )
            recipe = Recipe(kind=kind, path=p, context_dir=p.parent)
    if recipe.kind == "sif":
        sif = Path(recipe.path).resolve()
        if not sif.is_file():
            raise TaskError(f"{sif}: prebuilt SIF not found; rebuild it or remove the reference")
        return NormalisedRecipe(text="", files=[(sif, "")], base=None, rewrites=[f"prebuilt {sif.name} used as is"], kind="sif", source=sif)
    if recipe.kind == "dockerfile":
        from et_hpc.tasks.dockerfile import convert_dockerfile

        return convert_dockerfile(recipe.path, context_dir=recipe.context_dir, base_map=base_map)
    return normalise_def(recipe.path, recipe.context_dir, base_map)
