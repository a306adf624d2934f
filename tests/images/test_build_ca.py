"""Builds trust the host's CA bundle (sites whose TLS proxy re-signs PyPI and friends)."""

from __future__ import annotations

from pathlib import Path

import pytest

from et_hpc.images.store import BUILD_CA_PATH, ImageStoreConfig, with_build_ca
from helpers.images import make_store, make_task


def test_with_build_ca_exports_at_the_top_of_post_only() -> None:
    text = "Bootstrap: localimage\nFrom: x.sif\n\n%post -c /bin/bash\n    pip3 install pyyaml\n%environment\n    X=1\n"
    out = with_build_ca(text).splitlines()
    i = out.index("%post -c /bin/bash")
    assert out[i + 1].strip().startswith(f"if [ -r {BUILD_CA_PATH} ]; then export PIP_CERT={BUILD_CA_PATH}")
    assert out[i + 2] == "    pip3 install pyyaml"
    assert out.count(out[i + 1]) == 1
    assert with_build_ca("Bootstrap: localimage\nFrom: x.sif\n%files\n a b\n") == "Bootstrap: localimage\nFrom: x.sif\n%files\n a b\n"
    assert with_build_ca("%postscript\n") == "%postscript\n"


def test_ca_bundle_setting(tmp_path: Path, monkeypatch) -> None:
    assert ImageStoreConfig(ca_bundle="none").build_ca() is None
    assert ImageStoreConfig(ca_bundle=str(tmp_path / "missing.crt")).build_ca() is None
    f = tmp_path / "ca.crt"
    f.write_text("-----BEGIN CERTIFICATE-----\n")
    monkeypatch.setenv("ET_HPC_BUILD_CA_BUNDLE", str(f))
    assert ImageStoreConfig.from_env().build_ca() == f


@pytest.mark.apptainer
def test_post_reaches_pypi_over_tls_and_key_ignores_the_bundle(tmp_path: Path, base_sif: Path) -> None:
    body = (
        '%post -c /bin/bash\n    python3 -c "import urllib.request as u; '
        "print(u.urlopen('https://pypi.org/simple/pip/', timeout=60).status)\" > /opt/status\n"
    )
    task = make_task(tmp_path / "tasks", "tls_task", body)
    store = make_store(tmp_path / "cache", base_sif)
    r = store.ensure(task)
    assert r.status == "built", r.reason
    other = make_store(tmp_path / "cache", base_sif, ca_bundle="none")
    assert other.lookup(task).key == r.key and other.lookup(task).status == "cached"
