"""The Atropos environment end to end with the embedded CPU model: atroposlib's real ``run-api``, a trainer
that registers and pulls ``/batch``, the env's ``serve`` subcommand, llama-server in token-in mode, the
model's own tokenizer written from its GGUF, real apptainer sandboxes. Groups arrive with tokens and masks.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO, need

pytest.importorskip("atroposlib")

DEMO = REPO / "defs" / "demo"
TASKS = ["demo_hello_file", "demo_csv_sum"]
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.apptainer
def test_atropos_env_with_the_embedded_model(base_sif, tmp_path):
    need("model")
    import httpx

    from et_hpc.images.store import ImageStore
    from et_hpc.model.server import ServerConfig, default_model, serving
    from et_hpc.model.tokenizer import write_tokenizer
    from et_hpc.runs.export import validate_atropos_group
    from et_hpc.runs.store import open_run
    from et_hpc.tasks.loader import load_tasks

    for t in load_tasks(str(DEMO)).tasks:
        if t.id in TASKS:
            ImageStore().ensure(t)
    tok_dir = write_tokenizer(default_model(), tmp_path / "tok")
    port = _free_port()
    api = f"http://127.0.0.1:{port}"
    run_api = Path(sys.executable).with_name("run-api")
    api_log = open(tmp_path / "run-api.log", "w")
    api_proc = subprocess.Popen(
        [str(run_api), "--host", "127.0.0.1", "--port", str(port)], stdout=api_log, stderr=subprocess.STDOUT, env={**os.environ, **OFFLINE}
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(api + "/", timeout=2)
                break
            except httpx.HTTPError:
                assert api_proc.poll() is None and time.monotonic() < deadline, (tmp_path / "run-api.log").read_text()
                time.sleep(0.3)
        reg = httpx.post(
            api + "/register",
            json={
                "wandb_group": "t",
                "wandb_project": "t",
                "batch_size": 2,
                "max_token_len": 8192,
                "checkpoint_dir": str(tmp_path / "ckpt"),
                "save_checkpoint_interval": -1,
                "starting_step": 0,
                "num_steps": 10,
            },
            timeout=10,
        )
        reg.raise_for_status()
        assert httpx.get(api + "/batch", timeout=10).json()["batch"] is None
        store = tmp_path / "store"
        with serving(ServerConfig(endpoint_file=tmp_path / "ep" / "endpoint.json", log_file=tmp_path / "srv.log")) as srv:
            flags = {
                "env.dataset_name": str(DEMO),
                "env.task_ids": ",".join(TASKS),
                "env.tokenizer_name": str(tok_dir),
                "env.group_size": 2,
                "env.use_wandb": "false",
                "env.max_agent_turns": 2,
                "env.mode": "text",
                "env.token_in": "true",
                "env.agent_temperature": 1.0,
                "env.store": str(store),
                "env.run_name": "model-atropos",
                "env.max_concurrent_episodes": 2,
                "env.test_timeout_s": 60,
                "env.max_token_length": 8192,
                "env.max_tokens_per_turn": 64,
                "env.rollout_server_url": api,
                "env.ensure_scores_are_not_same": "false",
                "env.max_num_workers": 2,
                "env.max_batches_offpolicy": 1,
                "env.total_steps": 10,
                "openai.base_url": srv.base_url,
                "openai.model_name": srv.alias,
                "openai.api_key": srv.api_key,
                "openai.health_check": "false",
            }
            cmd = [sys.executable, "-m", "et_hpc.integrations.atropos", "serve"]
            for k, v in flags.items():
                cmd += [f"--{k}", str(v)]
            log_path = tmp_path / "serve.log"
            with open(log_path, "w") as log:
                env_proc = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, env={**os.environ, **OFFLINE}, start_new_session=True
                )
                batch = None
                try:
                    deadline = time.monotonic() + 600
                    while batch is None:
                        assert env_proc.poll() is None, log_path.read_text()[-4000:]
                        assert time.monotonic() < deadline, log_path.read_text()[-4000:]
                        time.sleep(2)
                        batch = httpx.get(api + "/batch", timeout=10).json()["batch"]
                finally:
                    env_proc.send_signal(signal.SIGTERM)
                    try:
                        env_proc.wait(timeout=300)
                    except subprocess.TimeoutExpired:
                        os.killpg(env_proc.pid, signal.SIGKILL)
                        env_proc.wait()
    finally:
        api_proc.terminate()
        api_proc.wait(timeout=30)
        api_log.close()
    assert batch, "no batch"
    records = {tuple(r.token_sequence()[0]): r for r in open_run(store / "model-atropos").records() if r.has_tokens}
    for g in batch:
        validate_atropos_group(g)
        for toks, masks in zip(g["tokens"], g["masks"]):
            assert toks and len(masks) == len(toks) and any(m == -100 for m in masks) and any(m != -100 for m in masks)
            rec = records.get(tuple(toks))
            assert rec is not None and rec.tokens_source == "server-exact" and rec.token_drift is None
            assert rec.model == srv.alias
