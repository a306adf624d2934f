"""Endpoint discovery: a late endpoint file, a server that never comes, and what the error says."""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest

from et_hpc.agent.endpoint import endpoint_record, resolve_endpoint
from et_hpc.errors import UserError
from et_hpc.testing.scripted_server import ScriptedServer


def test_waits_for_file_written_late(tmp_path):
    ep = tmp_path / "shared" / "vllm.json"
    with ScriptedServer({"": ["hi"]}, model="late-model") as srv:

        def write_later() -> None:
            time.sleep(1.0)
            ep.parent.mkdir()
            ep.write_text('{"host": ')  # a torn write first: must be waited out, not fail
            time.sleep(0.5)
            srv.write_endpoint_file(ep, job_id="77")

        t = threading.Thread(target=write_later)
        t.start()
        e = resolve_endpoint(None, ep, wait_s=30, poll_s=0.2)
        t.join()
        assert e.base_url == srv.base_url
        assert e.model == "late-model" and e.job_id == "77"
        assert srv.requests.get("GET /v1/models", 0) >= 1


def test_base_url_learns_model_from_server():
    with ScriptedServer({"": ["hi"]}, model="m7") as srv:
        e = resolve_endpoint(srv.base_url + "/", None, wait_s=5, poll_s=0.1)
        assert e.base_url == srv.base_url and e.model == "m7" and e.job_id is None


def test_never_written_file_is_clear_user_error(tmp_path):
    ep = tmp_path / "never.json"
    with pytest.raises(UserError) as e:
        resolve_endpoint(None, ep, wait_s=0.6, poll_s=0.2)
    msg = str(e.value)
    assert str(ep) in msg and "did not appear" in msg and "sbatch slurm/vllm.sbatch" in msg
    assert "\n" not in msg


def test_dead_server_names_file_and_job(tmp_path):
    with ScriptedServer({"": ["x"]}) as srv:
        port = srv.port  # a port that was ours and is now closed
    ep = tmp_path / "ep.json"
    ep.write_text(json.dumps(endpoint_record("127.0.0.1", port, "m", "987654321")))
    with pytest.raises(UserError) as e:
        resolve_endpoint(None, ep, wait_s=0.5, poll_s=0.2)
    msg = str(e.value)
    assert str(ep) in msg and f"127.0.0.1:{port}" in msg and "987654321" in msg and "not reachable" in msg
    if shutil.which("squeue"):
        assert "no longer queued or running" in msg and "sacct -j 987654321" in msg


def test_needs_something():
    with pytest.raises(UserError, match="--base-url"):
        resolve_endpoint(None, None)


def test_key_and_version_from_file_and_a_file_others_can_read_is_refused(tmp_path):
    from et_hpc.agent.endpoint import read_endpoint_file

    ep = tmp_path / "private" / "ep.json"
    with ScriptedServer({"": ["hi"]}, api_key="k-123456") as srv:
        srv.write_endpoint_file(ep, job_id="5", model_version="ckpt@step-3")
        assert ep.stat().st_mode & 0o777 == 0o600 and ep.parent.stat().st_mode & 0o777 == 0o700
        e = resolve_endpoint(None, ep, wait_s=10, poll_s=0.1, api_key="ignored", api_key_env="NOPE_NOT_SET")
        assert e.api_key == "k-123456" and e.model_version == "ckpt@step-3" and srv.requests.get("401", 0) == 0
        assert "k-123456" not in repr(e) and "api_key" not in e.model_dump()
        ep.chmod(0o644)  # readable by others: the key may be known
        with pytest.raises(UserError) as err:
            read_endpoint_file(ep)
        assert "readable by others" in str(err.value) and f"chmod 600 {ep}" in str(err.value)
        assert "\n" not in str(err.value)
        # without the key the server says so, and the give-up message names the 401
        ep.chmod(0o600)
        rec = json.loads(ep.read_text())
        rec.pop("api_key")
        ep.write_text(json.dumps(rec))
        ep.chmod(0o644)  # no key in it: nothing to protect, read fine
        with pytest.raises(UserError, match="401"):
            resolve_endpoint(None, ep, wait_s=0.3, poll_s=0.1, api_key_env="NOPE_NOT_SET")


def test_watch_rereads_only_on_change(tmp_path):
    import os

    from et_hpc.agent.endpoint import EndpointWatch, write_endpoint_file

    ep = tmp_path / "ep.json"
    write_endpoint_file(ep, endpoint_record("127.0.0.1", 1, "m", model_version="v1"))
    w = EndpointWatch(ep)
    assert w.version() == "v1"
    st = ep.stat()
    ep.write_text(ep.read_text().replace("v1", "v9"))  # same size; put the old mtime back
    os.utime(ep, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert w.version() == "v1"  # same inode, size and mtime: not re-read (one stat per turn)
    write_endpoint_file(ep, endpoint_record("127.0.0.1", 1, "m", model_version="v2"))  # rename: new inode
    assert w.version() == "v2"
    ep.unlink()
    assert w.version() == "v2"  # between jobs: the last one known
