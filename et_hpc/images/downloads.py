"""Shared downloads for builds: the .debs apt fetches and pip's cache, kept on the shared filesystem.

With ``download_cache`` set (``ImageStoreConfig``, ``$ET_HPC_DOWNLOAD_CACHE``), each build binds
the cache directory at ``DOWNLOADS_PATH`` and ``%post`` starts with ``EXPORTS``: ``APT_CONFIG``
points apt's archive directory (``Dir::Cache::archives``) there and keeps what it downloaded, and
``PIP_CACHE_DIR`` points pip's cache there. The recipe's commands are unchanged and the image key
too; the cache is a bind mount during the build only, so it never lands in the image (nor do the
.debs and pip cache that ``%post`` would otherwise leave in /var/cache/apt and /root/.cache/pip).
docs/images.md ("Shared downloads") has the measurements.
"""

from __future__ import annotations

from pathlib import Path

from et_hpc.util import atomic_write_text

DOWNLOADS_PATH = "/tmp/.et-hpc-downloads"
EXPORTS = f"if [ -r {DOWNLOADS_PATH}/apt.conf ]; then export APT_CONFIG={DOWNLOADS_PATH}/apt.conf PIP_CACHE_DIR={DOWNLOADS_PATH}/pip; fi"
APT_CONF = f"""\
Dir::Cache::archives "{DOWNLOADS_PATH}/apt/archives/";
APT::Keep-Downloaded-Packages "true";
Binary::apt::APT::Keep-Downloaded-Packages "true";
APT::Sandbox::User "root";
"""


def prepare(d: Path) -> Path:
    """Make the cache layout under ``d`` (idempotent; safe with concurrent builders)."""
    (d / "apt" / "archives" / "partial").mkdir(parents=True, exist_ok=True)
    (d / "pip").mkdir(parents=True, exist_ok=True)
    conf = d / "apt.conf"
    if not conf.is_file() or conf.read_text() != APT_CONF:
        atomic_write_text(conf, APT_CONF)
    return d


def bind_args(d: Path) -> list[str]:
    return ["--bind", f"{d}:{DOWNLOADS_PATH}"]
