"""Def parsing and normalisation: exactly the stated rewrites, nothing else changes."""

from __future__ import annotations

from pathlib import Path

import pytest

from et_hpc.errors import TaskError
from et_hpc.tasks.loader import load_tasks
from et_hpc.tasks.recipe import normalise, parse_def_text

BASE = Path("/cache/base/ubuntu_22.04.sif")
BASE_MAP = {"ubuntu_22.04.sif": BASE}


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "container.def"
    p.write_text(text)
    return p


def test_fixture_defs_rewrite_only_from_and_post(fixtures_dir: Path):
    tasks = load_tasks(fixtures_dir / "native").tasks
    assert len(tasks) == 6
    for t in tasks:
        n = normalise(t, base_map=BASE_MAP)
        orig = t.recipe.path.read_text().splitlines()
        new = n.text.splitlines()
        assert len(orig) == len(new)
        changed = [(a, b) for a, b in zip(orig, new) if a != b]
        assert changed == [("From: ./ubuntu_22.04.sif", f"From: {BASE}"), ("%post", "%post -c /bin/bash")], t.id
        assert n.rewrites == [f"From: ./ubuntu_22.04.sif -> {BASE}", "line 4: %post -> %post -c /bin/bash"]
        assert n.base == BASE and n.files == [] and n.kind == "def"


def test_post_with_shell_untouched_and_files_resolved(tmp_path: Path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("a")
    p = _write(
        tmp_path,
        (
            "Bootstrap: localimage\nFrom: ubuntu_22.04.sif\n\n"
            "%files\n    data/a.txt /opt/a.txt\n    # a comment\n    /etc/hostname /opt/h\n\n"
            "%post -c /bin/sh\n    echo hi\n"
        ),
    )
    n = normalise(p, base_map={"./ubuntu_22.04.sif": BASE})
    lines = n.text.splitlines()
    assert lines[1] == f"From: {BASE}"
    assert lines[4] == f"    {tmp_path / 'data' / 'a.txt'} /opt/a.txt"
    assert lines[6] == "    /etc/hostname /opt/h"  # absolute: unchanged
    assert lines[8] == "%post -c /bin/sh"
    assert n.files == [((tmp_path / "data" / "a.txt").resolve(), "/opt/a.txt"), (Path("/etc/hostname").resolve(), "/opt/h")]
    assert len(n.rewrites) == 2 and n.rewrites[1].startswith("line 5: %files data/a.txt -> ")


def test_missing_files_source(tmp_path: Path):
    p = _write(tmp_path, "Bootstrap: localimage\nFrom: ./ubuntu_22.04.sif\n%files\n    nothere.txt /x\n")
    with pytest.raises(TaskError, match=r"container.def:4: %files source 'nothere.txt' not found"):
        normalise(p, base_map=BASE_MAP)


def test_unknown_base_lists_known(tmp_path: Path):
    p = _write(tmp_path, "Bootstrap: localimage\nFrom: ./centos7.sif\n%post\n    true\n")
    with pytest.raises(TaskError) as ei:
        normalise(p, base_map=BASE_MAP)
    msg = str(ei.value)
    assert str(p) in msg and "centos7.sif" in msg and "ubuntu_22.04.sif" in msg


def test_docker_bootstrap_switched_to_cached_base(tmp_path: Path):
    p = _write(tmp_path, "Bootstrap: docker\nFrom: ubuntu:22.04\n%post\n    true\n")
    n = normalise(p, base_map=BASE_MAP)
    assert n.text.splitlines()[:2] == ["Bootstrap: localimage", f"From: {BASE}"]
    assert n.base == BASE and "cached base" in n.rewrites[0]
    other = _write(tmp_path, "Bootstrap: docker\nFrom: alpine:3\n%post -c /bin/sh\n    true\n")
    n2 = normalise(other, base_map=BASE_MAP)
    assert n2.text == other.read_text() and n2.rewrites == [] and n2.base is None


def test_absolute_from_kept(tmp_path: Path):
    p = _write(tmp_path, "Bootstrap: localimage\nFrom: /opt/img.sif\n%post -c /bin/bash\n    true\n")
    n = normalise(p, base_map=BASE_MAP)
    assert n.text == p.read_text() and n.base == Path("/opt/img.sif") and n.rewrites == []


@pytest.mark.parametrize(
    "text, match",
    [
        ("From: x\n%post\n  true\n", "no 'Bootstrap:' header"),
        ("Bootstrap: localimage\nFrom: x\n%build\n  true\n", r":3: unknown section '%build'"),
        ("Bootstrap: localimage\nFrom: x\n%post\n  cat <<EOF\n  %oops\nEOF\n", r":5: unknown section '%oops'"),
        ("Bootstrap: localimage\n./start.sh\n", r":2: header line './start.sh' is not 'Key: value'"),
        ("Bootstrap:\nFrom: x\n", "'Bootstrap:' has no value"),
    ],
)
def test_parse_errors(text: str, match: str):
    with pytest.raises(TaskError, match=match):
        parse_def_text(text, Path("/t/container.def"))


def test_sections_parsed():
    d = parse_def_text(
        "Bootstrap: localimage\nFrom: a.sif\n%labels\n  A b\n%appinstall foo\n  true\n%environment\n  export X=1\n",
        Path("x.def"),
    )
    assert [(s.name, s.args, s.line) for s in d.sections] == [("labels", "", 3), ("appinstall", "foo", 5), ("environment", "", 7)]
    assert d.bootstrap == "localimage" and d.from_ == "a.sif"


def test_non_utf8_def(tmp_path: Path):
    p = tmp_path / "container.def"
    p.write_bytes(b"Bootstrap: localimage\nFrom: ./ubuntu_22.04.sif\n%post\n  echo \xff\n")
    with pytest.raises(TaskError, match="not UTF-8"):
        normalise(p, base_map=BASE_MAP)


def test_sif_recipe(tmp_path: Path):
    sif = tmp_path / "container.sif"
    sif.write_bytes(b"not really a sif")
    n = normalise(sif, base_map=BASE_MAP)
    assert n.kind == "sif" and n.files == [(sif.resolve(), "")] and n.text == ""
