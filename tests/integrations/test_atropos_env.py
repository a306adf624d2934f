"""The Endless Terminals environment on et-hpc, through Atropos' own machinery, end to end on 127.0.0.1.

Real parts: atroposlib's API server (``run-api``), a trainer-side client that registers and pulls
``GET /batch``, the environment run with atropos' ``serve`` and ``process`` subcommands as
subprocesses, the scripted chat server as the model (exact token ids, logprobs), real apptainer
sandboxes on the demo tasks' images, the real parquet store. The tokenizer is a local
``tokenizer.json`` (``et_hpc.scripted_tokenizer.write_hf_tokenizer``); nothing reaches a hub
(HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE, WANDB_MODE=disabled).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO

pytest.importorskip("atroposlib")

DEMO = REPO / "defs" / "demo"
SOLVED = "demo_hello_file"  # oracle-like answers: reward 1.0
WRONG = "demo_csv_sum"  # a wrong total: 1 of its 2 final tests passes (reward 0.5 as a fraction)
SOLVE = "printf 'Hello, et-hpc!\\n' > /home/user/greeting.txt"
SCRIPT = {
    "greeting.txt": [{"command": SOLVE}, {"command": "cat /home/user/greeting.txt"}, "Done."],
    "sales.csv": [{"command": "head -n 2 /home/user/data/sales.csv"}, {"command": "echo 41 > /home/user/data/total.txt"}, "Done."],
}
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}
ENV_MODULE = [sys.executable, "-m", "et_hpc.integrations.atropos"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 10.0):
    import httpx as requests  # declared (the policy's /tokenize client); same calls as requests

    r = requests.get(url, timeout=timeout)
    r.raise_for_status()
    return r.json()


@pytest.fixture(scope="module")
def demo_images(base_sif: Path):
    from et_hpc.images.store import ImageStore
    from et_hpc.tasks.loader import load_tasks

    tasks = [t for t in load_tasks(str(DEMO)).tasks if t.id in (SOLVED, WRONG)]
    imgs = [ImageStore().ensure(t) for t in tasks]
    assert all(i.path is not None and Path(i.path).exists() for i in imgs), imgs
    return imgs


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from et_hpc.testing.scripted_tokenizer import write_hf_tokenizer

    return write_hf_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture()
def model_server():
    from et_hpc.testing.scripted_server import ScriptedServer

    with ScriptedServer(SCRIPT) as srv:
        yield srv


@pytest.fixture()
def api_server(tmp_path):
    """atroposlib's own API server (the ``run-api`` console script) on a free 127.0.0.1 port."""
    port = _free_port()
    run_api = Path(sys.executable).with_name("run-api")
    assert run_api.exists(), "atroposlib's run-api script is not installed next to this python"
    log = open(tmp_path / "run-api.log", "w")
    p = subprocess.Popen(
        [str(run_api), "--host", "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **OFFLINE}
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            _get(url + "/", timeout=2)
            break
        except Exception:
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"run-api did not start: {(tmp_path / 'run-api.log').read_text()[-2000:]}") from None
            time.sleep(0.2)
    yield url
    p.terminate()
    p.wait(timeout=30)
    log.close()


def _env_flags(tokenizer_dir: Path, srv, store: Path, run_name: str, ids: list[str], **extra: object) -> list[str]:
    flags = {
        "env.dataset_name": str(DEMO),
        "env.task_ids": ",".join(ids),
        "env.tokenizer_name": str(tokenizer_dir),
        "env.group_size": 2,
        "env.use_wandb": "false",
        "env.max_agent_turns": 4,
        "env.mode": "tools",
        "env.agent_temperature": 0.0,
        "env.store": str(store),
        "env.run_name": run_name,
        "env.max_concurrent_episodes": 2,
        "env.test_timeout_s": 60,
        "env.max_token_length": 65536,
        "openai.base_url": srv.base_url,
        "openai.model_name": "scripted",
        "openai.api_key": "EMPTY",
        "openai.health_check": "false",
    }
    flags.update({k.replace("__", "."): v for k, v in extra.items()})
    out: list[str] = []
    for k, v in flags.items():
        out += [f"--{k}", str(v)]
    return out


def _stored(store: Path, run_name: str) -> list:
    from et_hpc.runs.store import open_run

    return open_run(store / run_name).records()


def _check_group_against_episodes(group: dict, records: list, tokenizer) -> None:
    """Tokens, masks, logprobs and scores of one group are those of its stored episodes."""
    from et_hpc.runs.export import validate_atropos_group

    validate_atropos_group(group)
    by_tokens = {tuple(r.token_sequence()[0]): r for r in records if r.has_tokens}
    assert len(group["tokens"]) == 2
    for i, toks in enumerate(group["tokens"]):
        rec = by_tokens.get(tuple(toks))
        assert rec is not None, "a batch sequence is not the token sequence of any stored episode"
        assert rec.status == "ok" and rec.tokens_source == "server-exact" and rec.token_drift is None
        assert group["scores"][i] == rec.reward
        masks = group["masks"][i]
        assert len(masks) == len(toks) == len(group["inference_logprobs"][i])
        # prompt (system, task, tool output, template) positions are -100; completions are trained on
        pos = 0
        for prompt, completion in zip(rec.prompt_token_ids, rec.token_ids):
            assert masks[pos : pos + len(prompt)] == [-100] * len(prompt)
            pos += len(prompt)
            assert masks[pos : pos + len(completion)] == completion
            pos += len(completion)
        assert pos == len(toks)
        # what the trainer's tokenizer reads: the task prompt and tool output in the masked part,
        # the model's own replies in the trained part
        trained = tokenizer.decode([t for t, m in zip(toks, masks) if m != -100])
        masked = tokenizer.decode([t for t, m in zip(toks, masks) if m == -100])
        assert "/home/user" in masked
        for m in rec.messages:
            if m["role"] == "tool" and m["content"].strip():
                assert m["content"].strip().splitlines()[0] in masked
                assert m["content"].strip().splitlines()[0] not in trained or m["content"].strip() in SOLVE
        assert "<tool_call>" in trained and "Done." in trained


@pytest.mark.apptainer
@pytest.mark.slow
def test_serve_to_atropos_api_server_batch(demo_images, tokenizer_dir, model_server, api_server, tmp_path):
    import httpx as requests  # declared (the policy's /tokenize client); same calls as requests
    from transformers import AutoTokenizer

    # the trainer side: register, then pull /batch (the first pull also lets environments register)
    reg = requests.post(
        api_server + "/register",
        json={
            "wandb_group": "et-hpc-test",
            "wandb_project": "et-hpc-test",
            "batch_size": 4,
            "max_token_len": 65536,
            "checkpoint_dir": str(tmp_path / "ckpt"),
            "save_checkpoint_interval": -1,
            "starting_step": 0,
            "num_steps": 10,
        },
        timeout=10,
    )
    reg.raise_for_status()
    assert "uuid" in reg.json()
    assert _get(api_server + "/batch")["batch"] is None

    store = tmp_path / "store"
    log_path = tmp_path / "serve.log"
    cmd = (
        ENV_MODULE
        + ["serve"]
        + _env_flags(
            tokenizer_dir,
            model_server,
            store,
            "e2e-serve",
            [SOLVED, WRONG],
            env__rollout_server_url=api_server,
            env__ensure_scores_are_not_same="false",
            env__max_num_workers=2,
            env__max_batches_offpolicy=1,
            env__total_steps=10,
            env__reward="fraction",
        )
    )
    with open(log_path, "w") as log:
        env_proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, env={**os.environ, **OFFLINE}, start_new_session=True
        )
        batch = None
        try:
            deadline = time.monotonic() + 600
            while batch is None:
                assert env_proc.poll() is None, f"serve exited: {log_path.read_text()[-4000:]}"
                assert time.monotonic() < deadline, f"no batch in 600 s: {log_path.read_text()[-4000:]}"
                time.sleep(2)
                batch = _get(api_server + "/batch")["batch"]
        finally:
            env_proc.send_signal(signal.SIGTERM)  # stops the loop; running episodes end, instances stop
            try:
                rc = env_proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                os.killpg(env_proc.pid, signal.SIGKILL)
                env_proc.wait()
                raise
    assert rc == 0, log_path.read_text()[-4000:]

    assert sum(len(g["tokens"]) for g in batch) == 4 and len(batch) == 2
    records = _stored(store, "e2e-serve")
    # the batch's members are ok (checked below); an episode still running at the SIGTERM ends at
    # its next turn and is stored masked, as the env documents: never anything else
    statuses = [(r.status, r.error) for r in records]
    assert sum(s == "ok" for s, _ in statuses) >= 4, statuses
    assert all(s == "ok" or (s == "infra_error" and e.startswith("interrupted by the run")) for s, e in statuses), statuses
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    by_task = {}
    for g in batch:
        _check_group_against_episodes(g, records, tokenizer)
        task = next(r.task_id for r in records if tuple(r.token_sequence()[0]) == tuple(g["tokens"][0]))
        by_task[task] = g["scores"]
    assert by_task == {SOLVED: [1.0, 1.0], WRONG: [0.5, 0.5]}  # reward: fraction (1 of its 2 final tests passes)
    assert requests.get(api_server + "/status", timeout=10).json()["current_step"] >= 1
    log = log_path.read_text()
    # atropos logs an exception in an environment's own code with these lines
    assert "Error in collect_trajectories" not in log and "Error in handle_send_to_api" not in log, log[-4000:]
    assert "SIGTERM: stopping" in log


def assert_export_is_what_was_sent(sent: list[dict], run_dir: Path) -> None:
    """The store's Atropos export holds exactly the groups that were sent: same count, sizes, members."""
    from et_hpc.runs.export import export_atropos
    from et_hpc.runs.store import RunStore

    out = run_dir.parent / f"{run_dir.name}-export.jsonl"
    res = export_atropos(RunStore(run_dir), out, drop_zero_variance=False)
    exported = [json.loads(line) for line in out.read_text().splitlines()]

    def members(groups: list[dict]) -> list[tuple[str, tuple[str, ...], tuple[float, ...]]]:
        return sorted((g["et_hpc"]["group_id"], tuple(g["et_hpc"]["episode_ids"]), tuple(g["scores"])) for g in groups)

    assert res.groups == len(exported) == len(sent)
    assert members(exported) == members(sent)
    assert sorted(len(g["tokens"]) for g in exported) == sorted(len(g["tokens"]) for g in sent)
    assert [g["tokens"] for g in sorted(exported, key=lambda g: g["et_hpc"]["group_id"])] == [
        g["tokens"] for g in sorted(sent, key=lambda g: g["et_hpc"]["group_id"])
    ]


@pytest.mark.apptainer
@pytest.mark.slow
def test_process_writes_jsonl_groups(demo_images, tokenizer_dir, model_server, tmp_path):
    from transformers import AutoTokenizer

    store = tmp_path / "store"
    out = tmp_path / "groups.jsonl"
    # the model server through its endpoint file (et-hpc's client, the file's model_version);
    # --openai.base_url names a port nothing listens on, so only the file can have served it
    ep_dir = tmp_path / "private"
    ep_dir.mkdir(mode=0o700)
    version = "/ckpts/step-3@step-3"
    model_server.write_endpoint_file(ep_dir / "endpoint.json", model_version=version)
    cmd = (
        ENV_MODULE
        + ["process"]
        + _env_flags(
            tokenizer_dir,
            model_server,
            store,
            "e2e-process",
            [SOLVED],
            env__data_path_to_save_groups=str(out),
            env__total_steps=3,
            env__ensure_scores_are_not_same="false",
            env__endpoint_file=str(ep_dir / "endpoint.json"),
            openai__base_url="http://127.0.0.1:9/v1",
        )
    )
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env={**os.environ, **OFFLINE}, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    lines = out.read_text().splitlines()
    assert len(lines) == 3
    sent = [json.loads(line) for line in lines]
    records = _stored(store, "e2e-process")
    assert len(records) == 6
    assert {r.policy_version for r in records} == {version} and not any(r.crossed_version for r in records)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    for group in sent:
        _check_group_against_episodes(group, records, tok)
        assert group["scores"] == [1.0, 1.0]
    # three calls of one task: three groups of two in the store (not one of six), as sent
    import re

    ids = sorted(g["et_hpc"]["group_id"] for g in sent)
    assert [re.sub(r"@w[0-9a-f]{8}-", "@", i) for i in ids] == [f"{SOLVED}@s0", f"{SOLVED}@s2", f"{SOLVED}@s4"]
    assert len({i.split("@")[1].split("-")[0] for i in ids}) == 1  # one env process: one writer id
    assert_export_is_what_was_sent(sent, store / "e2e-process")
    group = sent[0]
    assert group["messages"] and group["messages"][0][1]["content"].startswith("Create the file")  # process mode
    assert (tmp_path / "groups.html").exists()  # atropos' own viewer
    assert json.loads((store / "e2e-process" / "run.json").read_text())["reward"] == "binary"  # every run's default
    assert {r.reward_rule for r in records} == {"binary"}


class _CountingServer:
    """The scripted server, counting the episodes it saw: first turns (no assistant message yet)."""

    def __new__(cls, script: dict):
        import threading

        from et_hpc.testing.scripted_server import ScriptedServer

        class Counting(ScriptedServer):
            first_turns = 0
            _lock = threading.Lock()

            def _chat(self, h, req):
                if not any(m.get("role") == "assistant" for m in req.get("messages") or []):
                    with self._lock:
                        type(self).first_turns += 1
                return super()._chat(h, req)

        return Counting(script)


def _register_trainer(api_server: str, tmp_path: Path) -> None:
    import httpx as requests  # declared (the policy's /tokenize client); same calls as requests

    reg = requests.post(
        api_server + "/register",
        json={
            "wandb_group": "et-hpc-test",
            "wandb_project": "et-hpc-test",
            "batch_size": 4,
            "max_token_len": 65536,
            "checkpoint_dir": str(tmp_path / "ckpt"),
            "save_checkpoint_interval": -1,
            "starting_step": 0,
            "num_steps": 10,
        },
        timeout=10,
    )
    reg.raise_for_status()
    assert _get(api_server + "/batch")["batch"] is None


@pytest.mark.apptainer
@pytest.mark.slow
def test_worker_timeout_cancels_lose_no_episode(demo_images, tokenizer_dir, api_server, tmp_path):
    """atropos cancels every group (worker_timeout 2 s, episodes take longer): every episode the
    environment started is stored all the same; SIGTERM then interrupts the running ones, which are
    stored as infra_error with one log line each (no traceback)."""
    slow = {"greeting.txt": [{"command": "sleep 3; " + SOLVE}, "Done."]}
    srv = _CountingServer(slow).start()
    try:
        _register_trainer(api_server, tmp_path)
        store = tmp_path / "store"
        log_path = tmp_path / "serve.log"
        cmd = (
            ENV_MODULE
            + ["serve"]
            + _env_flags(
                tokenizer_dir,
                srv,
                store,
                "cancelled",
                [SOLVED],
                env__rollout_server_url=api_server,
                env__worker_timeout=2,
                env__max_num_workers=2,
                env__max_batches_offpolicy=1,
                env__total_steps=10,
            )
        )
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, env={**os.environ, **OFFLINE}, start_new_session=True
            )
            try:
                deadline = time.monotonic() + 300
                # run until atropos has timed out workers and at least two groups have been stored
                while not (log_path.read_text().count("has timed out") >= 2 and len(_shards(store / "cancelled")) >= 2):
                    assert proc.poll() is None, log_path.read_text()[-4000:]
                    assert time.monotonic() < deadline, log_path.read_text()[-4000:]
                    time.sleep(1)
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    rc = proc.wait(timeout=300)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    raise
    finally:
        srv.stop()
    text = log_path.read_text()
    assert rc == 0, text[-4000:]
    records = _stored(store, "cancelled")
    started = [r for r in records if r.error != "interrupted by the run before it started"]
    import re

    m = re.search(r"episodes started (\d+), stored (\d+) \((\d+) interrupted\), groups cancelled (\d+)", text)
    assert m, text[-4000:]
    n_started, n_stored, n_interrupted, n_cancelled = map(int, m.groups())
    print(
        f"model server saw {srv.first_turns} episodes; env started {n_started}, stored {n_stored} "
        f"({n_interrupted} interrupted), {n_cancelled} groups cancelled; store holds {len(records)} records"
    )
    assert n_stored == len(records) and n_started == len(started)
    assert srv.first_turns >= 4 and srv.first_turns <= len(started)  # every episode the server saw is stored
    cancelled = [r for r in records if "collect cancelled: not sent" in r.events]
    assert n_cancelled >= 2 and len(cancelled) >= 4
    assert all(r.status == "ok" and r.reward == 1.0 for r in cancelled if r.error is None)
    # groups are whole: every group_id has group_size members
    from collections import Counter

    assert set(Counter(r.group_id for r in records).values()) == {2}
    assert not [r for r in records if r.turns == 0 and r.error != "interrupted by the run before it started" and r.status == "ok"]
    interrupted = [r for r in records if r.status != "ok"]
    assert all(r.status == "infra_error" and r.reward is None for r in interrupted)
    assert text.count("interrupted: ") == len(interrupted) == n_interrupted
    assert "Traceback" not in text, text[-4000:]


def _shards(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("part-*.parquet"))


def _offline_env(tokenizer_dir: Path, tmp_path: Path, **cfg):
    """The environment object itself, without a running server (for the group decisions)."""
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig

    from et_hpc.integrations.atropos import EndlessTerminalsEnv, EndlessTerminalsEnvConfig

    config = EndlessTerminalsEnvConfig(
        tokenizer_name=str(tokenizer_dir), group_size=3, use_wandb=False, store=str(tmp_path / "store"), include_messages=True, **cfg
    )
    server = APIServerConfig(
        model_name="scripted", base_url="http://127.0.0.1:9/v1", api_key="EMPTY", server_type="openai", health_check=False
    )
    return EndlessTerminalsEnv(config, [server])


def _rec(sample: int, reward: float | None, status: str = "ok", tokens: bool = True):
    from et_hpc.record import EpisodeRecord

    kw = (
        dict(
            prompt_token_ids=[[1, 2, 3], [4]],
            token_ids=[[5 + sample, 6], [7]],
            logprobs=[[-0.1, -0.2], [-0.3]],
            tokens_source="server-exact",
        )
        if tokens
        else {}
    )
    return EpisodeRecord(
        run_name="x",
        task_id="t",
        sample=sample,
        status=status,
        reward=reward if status == "ok" else None,
        messages=[{"role": "user", "content": "do it"}],
        **kw,
    )


def test_group_with_one_infra_error_is_not_sent(tokenizer_dir, tmp_path, monkeypatch):
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    env = _offline_env(tokenizer_dir, tmp_path)
    try:
        full = [_rec(0, 1.0), _rec(1, 0.0), _rec(2, 1.0)]
        group = env.group_from_records(full)  # positive control: a complete group is sent
        assert group is not None and group["scores"] == [1.0, 0.0, 1.0]
        assert group["masks"][1] == [-100, -100, -100, 6, 6, -100, 7]
        assert env.group_from_records([_rec(0, 1.0), _rec(1, None, "infra_error"), _rec(2, 0.0)]) is None
        assert env.counts["groups_masked"] == 1
        assert env.group_from_records([_rec(0, 1.0), _rec(1, 0.0, tokens=False)]) is None  # no token ids
        assert env.counts["groups_without_tokens"] == 1
        assert env.group_from_records([]) is None  # a stop dropped every interrupted episode
    finally:
        env.close()
    keep = _offline_env(tokenizer_dir, tmp_path, on_error="keep-ok")
    try:
        g = keep.group_from_records([_rec(0, 1.0), _rec(1, None, "policy_error"), _rec(2, 0.0)])
        assert g is not None and g["scores"] == [1.0, 0.0] and g["group_overrides"] == {"group_size": 2}
        assert keep.group_from_records([_rec(0, None, "timeout")]) is None  # nothing ok: nothing to keep
    finally:
        keep.close()


def test_env_settings_epochs_rewards_and_runs(tokenizer_dir, tmp_path, monkeypatch):
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    env = _offline_env(tokenizer_dir, tmp_path, endpoint_dir=str(tmp_path / "eps"))
    try:
        env.tasks = [f"t{i}" for i in range(8)]
        orders = [env.epoch_order(e) for e in range(4)]
        assert all(sorted(o) == list(range(8)) for o in orders)  # each epoch serves every task once
        assert len({tuple(o) for o in orders}) == 4  # a fresh permutation each epoch
        pol = env.run_config().policy
        assert pol.endpoint_dir == tmp_path / "eps" and pol.base_url is None and pol.endpoint_file is None
        assert env.eval_run_name == "atropos-endless-eval"
        assert env.run_config(env.eval_run_name).run_name() == "atropos-endless-eval"
        four = _rec(0, 0.0).model_copy(update={"passed": 3, "total": 4})
        assert env.score(four).reward == 0.0 and env.score(four).reward_rule == "binary"  # every run's default
        assert env.score(_rec(1, None, "infra_error")).reward is None
    finally:
        env.close()
    fraction = _offline_env(tokenizer_dir, tmp_path, reward="fraction")
    try:
        scored = fraction.score(_rec(0, 0.0).model_copy(update={"passed": 3, "total": 4}))
        assert (scored.reward, scored.reward_rule) == (0.75, "fraction")  # the seed's rule: passed / total
        assert fraction.run_config().policy.base_url == "http://127.0.0.1:9/v1"
    finally:
        fraction.close()


def _writer(tokenizer_dir: str, root: str, out: str, start) -> None:
    """One env process writing two groups of task t into the shared run (episodes stand in)."""
    import asyncio

    from et_hpc.runs.store import Store
    from et_hpc.tasks.model import Recipe, Task

    env = _offline_env(Path(tokenizer_dir), Path(root))
    env.run_store = Store(Path(root) / "store").run("atropos-endless")
    env.eval_store = Store(Path(root) / "store").run("atropos-endless-eval")
    env._episode = lambda task, sample, cfg: _rec(sample, float(sample % 2)).model_copy(update={"run_name": "atropos-endless"})
    task = Task(id="t", prompt="p", recipe=Recipe(kind="sif", path=Path(root) / "x.sif", context_dir=Path(root)), source=Path(root))
    start.wait(60)

    async def two() -> list:
        return [await env.run_episodes(task, 3) for _ in range(2)]

    groups = asyncio.run(two())
    env.close()
    Path(out).write_text(json.dumps([[r.group_id for r in g] for g in groups]))


def test_two_env_processes_on_one_run_never_share_a_group(tokenizer_dir, tmp_path, monkeypatch):
    import multiprocessing as mp

    from et_hpc.runs.store import RunStore

    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    ctx = mp.get_context("spawn")
    start = ctx.Event()
    procs = [ctx.Process(target=_writer, args=(str(tokenizer_dir), str(tmp_path), str(tmp_path / f"w{i}.json"), start)) for i in range(2)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    sent = [gid for i in range(2) for g in json.loads((tmp_path / f"w{i}.json").read_text()) for gid in set(g)]
    assert len(sent) == len(set(sent)) == 4  # four groups, four ids
    rs = RunStore(tmp_path / "store" / "atropos-endless")
    _, groups = rs.groups()
    assert sorted(g.group_id for g in groups) == sorted(sent)  # none hidden by the dedupe
    assert all(len(g.rows) == 3 == g.group_size for g in groups)


@pytest.mark.apptainer
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkilled_env_leaves_no_sandbox(demo_images, tokenizer_dir, tmp_path):
    """A real env process SIGKILLed while its episodes' instances run: they outlive it (the positive
    control) until the next env process on the node starts, whose setup reaps them."""
    import getpass

    from et_hpc.host import apptainer
    from et_hpc.testing.scripted_server import ScriptedServer
    from helpers import until

    env = {**os.environ, **OFFLINE, "ET_HPC_SCRATCH": str(tmp_path / "scratch")}
    scratch = tmp_path / "scratch" / f"et-hpc-{getpass.getuser()}"  # et_hpc.paths.scratch_dir under it

    def env_cmd(srv, run_name: str) -> list[str]:
        extra = dict(env__total_steps=1, env__ensure_scores_are_not_same="false", env__command_timeout_s=600, env__wall_time_s=900)
        out = str(tmp_path / f"{run_name}.jsonl")
        return (
            ENV_MODULE
            + ["process"]
            + _env_flags(tokenizer_dir, srv, tmp_path / "store", run_name, [SOLVED], env__data_path_to_save_groups=out, **extra)
        )

    def live() -> list[str]:
        return sorted(json.loads(f.read_text())["name"] for f in (scratch / "live").glob("*.json"))

    def running(names: list[str]) -> list[str]:
        up = {i.name for i in apptainer.instance_list()}
        return [n for n in names if n in up]

    with ScriptedServer({"greeting.txt": [{"command": "sleep 600"}, "Done."]}) as slow:
        log = open(tmp_path / "killed.log", "w")
        p = subprocess.Popen(env_cmd(slow, "killed"), stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, env=env)
        names = until("the env's two sandboxes to run", lambda: len(running(live())) == 2 and live(), 600)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(30)
        log.close()
    time.sleep(5)
    assert running(names) == names and live() == names  # nothing of the killed env stopped them
    with ScriptedServer(SCRIPT) as srv:
        q = subprocess.run(env_cmd(srv, "next"), capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900)
    assert q.returncode == 0, (q.stdout + q.stderr)[-4000:]
    assert running(names) == []
    assert not any(n in live() for n in names) and not any(n in p.name for p in (scratch / "overlays").glob("*.img") for n in names)
