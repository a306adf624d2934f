"""The long tier (``scripts/test --long``): real-model episodes through ``et-hpc run`` against
llama-cpp-python's server (``python -m llama_cpp.server``), the third OpenAI-compatible server et-hpc
speaks to. It is built from its sdist (minutes to tens of minutes on 2 cores), so CI does not run it.

The server takes the history et-hpc sends (an assistant message beside tool calls carries content "",
not null, which it refuses with HTTP 500), in tools mode and in text mode: every episode ends ``ok``.
It returns no token ids and has no ``/tokenize`` (its route is ``/extras/tokenize``): tokens are absent,
and the record says why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from helpers import REPO, need

pytestmark = [pytest.mark.slow_model, pytest.mark.apptainer]

ET_HPC = [sys.executable, "-m", "et_hpc.cli"]
DEMO = REPO / "defs" / "demo"
TASKS = ["demo_hello_file", "demo_csv_sum"]


# On a CPU that lists AMX under a hypervisor that does not enable its tile state, llama.cpp's AMX weight
# repacking dies with SIGILL at the first matmul (llama-server runs with --no-repack there). The Python
# server has no such flag: this launcher sets the same model parameter (use_extra_bufts) before it starts.
NO_REPACK = """
import runpy, llama_cpp.llama_cpp as c
default = c.llama_model_default_params
def no_repack():
    p = default()
    p.use_extra_bufts = False
    return p
c.llama_model_default_params = no_repack
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
"""


def _need_llama_cpp_python() -> None:
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError:  # the tier promises it: provisioning with ET_HPC_LONG=1 installs it
        pytest.fail("llama-cpp-python[server] is not installed (scripts/test --long provisions it)")


@pytest.fixture(scope="module")
def llama_py_endpoint(tmp_path_factory):
    need("model")
    _need_llama_cpp_python()
    import secrets

    from et_hpc.agent.endpoint import endpoint_record, write_endpoint_file
    from et_hpc.host.llama import cpu_has_amx
    from et_hpc.model.server import default_model, free_port, model_name

    d = tmp_path_factory.mktemp("llama-cpp-python")
    gguf = default_model()
    port, key = free_port("127.0.0.1"), secrets.token_urlsafe(24)
    log = open(d / "server.log", "wb")
    launch = ["-c", NO_REPACK] if cpu_has_amx() else ["-m", "llama_cpp.server"]
    p = subprocess.Popen(
        [
            sys.executable,
            *launch,
            "--model",
            str(gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--chat_format",
            "chatml-function-calling",
            "--n_ctx",
            "4096",
            "--model_alias",
            model_name(gguf),
        ],
        env={**os.environ, "API_KEY": key},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            assert p.poll() is None, (d / "server.log").read_text()[-3000:]
            try:
                if (
                    httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5).status_code
                    == 200
                ):
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "llama_cpp.server did not start"
            time.sleep(0.5)
        ep = d / "ep" / "endpoint.json"
        write_endpoint_file(
            ep, endpoint_record("127.0.0.1", port, model_name(gguf), None, api_key=key, model_version=model_name(gguf), started_at=None)
        )
        yield ep
    finally:
        p.terminate()
        p.wait(timeout=60)
        log.close()


@pytest.mark.parametrize("mode", ["tools", "text"])
def test_episodes_against_llama_cpp_python(llama_py_endpoint, base_sif, tmp_path, mode):
    from et_hpc.images.store import ImageStore
    from et_hpc.runs.store import open_run
    from et_hpc.tasks.loader import load_tasks

    for t in load_tasks(str(DEMO)).tasks:
        if t.id in TASKS:
            ImageStore().ensure(t)
    cmd = [
        *ET_HPC,
        "run",
        str(DEMO),
        "--set",
        f"tasks.ids=[{','.join(TASKS)}]",
        "--run-name",
        mode,
        "--store",
        str(tmp_path / "store"),
        "--concurrency",
        "2",
        "--json",
        "--policy",
        "openai",
        "--set",
        f"policy.endpoint_file={llama_py_endpoint}",
        "--set",
        f"policy.mode={mode}",
        "--set",
        "policy.max_retries=2",
        "--set",
        "budgets.max_turns=3",
        "--set",
        "budgets.max_tokens_per_turn=96",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=tmp_path)
    assert r.returncode in (0, 1), r.stderr[-3000:]
    json.loads(r.stdout)
    recs = open_run(tmp_path / "store" / mode).records()
    assert len(recs) == len(TASKS)
    for rec in recs:
        assert rec.status == "ok", (rec.status, rec.error)  # the server took every history we sent
        assert rec.turns >= 1 and rec.reward is not None and rec.timings.model_s > 0
        assert rec.tokens_source == "absent" and rec.token_drift  # no ids from this server, and why
