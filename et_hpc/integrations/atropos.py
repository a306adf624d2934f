"""The Endless Terminals environment for Atropos, on et-hpc: ``EndlessTerminalsEnv`` (an atroposlib ``BaseEnv``).

Configured like the seed environment (hermes-agent's ``endless_terminals_env.py``):
``dataset_name`` (a hub dataset, a local parquet file or a folder of task folders), ``split``,
``tasks_base_dir`` (parquet rows' task folders are remapped by name onto it), ``test_timeout_s``,
``max_agent_turns``, ``group_size``, ``system_prompt``; plus et-hpc's own settings below.

Each trajectory is one et-hpc episode (``et_hpc.episode.run_episode``): the task's SIF from the
image cache (build it first with ``et-hpc build``), one Apptainer instance and one overlay per
episode, the model driven through et-hpc's OpenAI policy against the server of the ``--openai.*``
settings (exact token ids via ``return_token_ids``, logprobs), the final tests run in the same
instance after the agent stops. Every episode is also written to et-hpc's run store
(``store``/``run_name``), so ``et-hpc store summary`` and the exports see the same data.

A group (``collect_trajectories``) is ``group_size`` episodes of one task, turned into a
``ScoredDataGroup`` by ``et_hpc.runs.export.atropos_group`` (tokens, masks ``-100`` on prompt and
tool-output positions, scores = the episodes' rewards, ``inference_logprobs``) and checked with
``validate_atropos_group``. Failures are handled as in the store's group selection:

- an episode with an error status (server, host, our bugs; never the agent's doing) masks the
  whole group by default (``on_error: mask``): nothing is sent for it; ``keep-ok`` sends the ok
  episodes with ``group_overrides.group_size`` set to their number;
- the agent's own failures are ok episodes with reward 0.0 and are sent (trained on);
- a group whose episodes carry no token ids (a server without ``return_token_ids`` or
  ``/tokenize``) is not sent: Atropos trains on tokens, and re-tokenizing transcripts is not exact.

Run it with atropos' own subcommands (``BaseEnv.cli``)::

    python -m et_hpc.integrations.atropos serve --env.dataset_name defs/demo \\
        --env.tokenizer_name /path/to/tokenizer --env.rollout_server_url http://127.0.0.1:8000 \\
        --openai.base_url http://127.0.0.1:9000/v1 --openai.model_name my-model
    python -m et_hpc.integrations.atropos process ... --env.data_path_to_save_groups groups.jsonl
"""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup
from pydantic import Field

from et_hpc.agent.base import DEFAULT_MAX_TOKENS
from et_hpc.agent.loop import BudgetConfig
from et_hpc.agent.policies import PolicyConfig
from et_hpc.errors import UserError
from et_hpc.record import EpisodeRecord, solved
from et_hpc.runner.config import RunConfig, SandboxConfig
from et_hpc.runs.export import atropos_group, validate_atropos_group
from et_hpc.runs.store import RunStore, Store
from et_hpc.sandbox.config import DEFAULT_OVERLAY_MB

log = logging.getLogger(__name__)

SEED_DATASET = "obiwan96/endless-terminals-train"


class EndlessTerminalsEnvConfig(BaseEnvConfig):
    """The seed environment's settings, plus where et-hpc keeps episodes and how it runs them."""

    dataset_name: str = Field(default=SEED_DATASET, description="hub dataset (org/name), local .parquet, or a folder of task folders")
    split: str | None = Field(default=None, description="only tasks of this split (parquet sources)")
    tasks_base_dir: str | None = Field(default=None, description="folder holding the task_* folders parquet rows name")
    task_ids: str | None = Field(default=None, description="only these task ids (comma-separated)")
    test_timeout_s: float = Field(default=60.0, gt=0, description="final tests time limit (s)")
    max_agent_turns: int = Field(default=32, ge=1, description="agent turns per episode")
    system_prompt: str | None = Field(default=None, description="system prompt (default: et-hpc's prompt for the mode)")
    mode: Literal["tools", "text"] = Field(default="tools", description="tool calls, or the <command> text protocol")
    agent_temperature: float = Field(default=1.0, ge=0, description="sampling temperature")
    token_in: bool = Field(default=False, description="send token ids (llama-server /completion, vLLM /v1/completions): "
                           "exact tokens from servers whose chat route returns none")
    max_tokens_per_turn: int = Field(default=DEFAULT_MAX_TOKENS, ge=1, description="completion tokens per turn")
    wall_time_s: float = Field(default=300.0, gt=0, description="agent wall time per episode (s)")
    command_timeout_s: float = Field(default=60.0, gt=0, description="time limit of one shell command (s)")
    max_concurrent_episodes: int = Field(default=16, ge=1, description="episodes (instances) running at once")
    on_error: Literal["mask", "keep-ok"] = Field(default="mask", description="a group with an error episode: mask it or keep its ok episodes")  # noqa: E501
    store: str | None = Field(default=None, description="et-hpc store root for the episodes (default $ET_HPC_STORE or ./et-hpc-runs)")
    run_name: str = Field(default="atropos-endless", description="run name inside the store")
    shuffle_seed: int = Field(default=0, description="order in which tasks are served")
    num_eval_tasks: int = Field(default=0, ge=0, description="tasks held out for evaluate() (one episode each)")
    overlay_mb: int = Field(default=DEFAULT_OVERLAY_MB, ge=16, description="per-episode writable overlay size")


class EndlessTerminalsEnv(BaseEnv):
    """Endless Terminals tasks as an Atropos environment; every trajectory is a real et-hpc episode."""

    name = "endless_terminals"
    env_config_cls = EndlessTerminalsEnvConfig

    def __init__(self, config: EndlessTerminalsEnvConfig, server_configs: Any, slurm: bool = False,
                 testing: bool = False) -> None:
        super().__init__(config, server_configs, slurm, testing)
        self.config: EndlessTerminalsEnvConfig = config
        self.tasks: list[Any] = []
        self.eval_tasks: list[Any] = []
        self.images: dict[str, Any] = {}
        self._order: list[int] = []
        self._pos = 0
        self._next_sample: dict[str, int] = {}
        self._sample_lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=config.max_concurrent_episodes, thread_name_prefix="et-episode")
        self.run_store: RunStore | None = None
        self.counts = {"groups_sent": 0, "groups_masked": 0, "groups_without_tokens": 0, "episodes": 0,
                       "episode_errors": 0}

    @classmethod
    def config_init(cls) -> tuple[EndlessTerminalsEnvConfig, list[APIServerConfig]]:
        env = EndlessTerminalsEnvConfig(group_size=8, use_wandb=False, max_token_length=16384, wandb_name=cls.name,
                                        ensure_scores_are_not_same=True, steps_per_eval=500, total_steps=10000)
        server = APIServerConfig(model_name="default", base_url="http://localhost:8000/v1", api_key="EMPTY",
                                 server_type="openai", health_check=False)
        return env, [server]

    # --- setup ---------------------------------------------------------------------------------
    async def setup(self) -> None:
        from et_hpc.images.store import ImageStore
        from et_hpc.runner.plan import image_missing
        from et_hpc.tasks.loader import load_tasks

        c = self.config
        ids = [i.strip() for i in c.task_ids.split(",") if i.strip()] if c.task_ids else None
        res = load_tasks(c.dataset_name, tasks_dir=c.tasks_base_dir, ids=ids, split=c.split, progress=False)
        for e in res.errors:
            log.warning("task source %s: %s", c.dataset_name, e)
        store = ImageStore()
        ready = []
        for task, img in zip(res.tasks, store.lookup_many(res.tasks)):
            why = image_missing(img)
            if why:
                log.warning("task %s skipped: image %s (build it with 'et-hpc build %s')", task.id, why, c.dataset_name)
                continue
            self.images[task.id] = img
            ready.append(task)
        if not ready:
            raise UserError(f"{c.dataset_name}: no task with a built image ({len(res.tasks)} tasks loaded); "
                            f"run 'et-hpc build {c.dataset_name}' first")
        rng = random.Random(c.shuffle_seed)
        rng.shuffle(ready)
        n_eval = min(c.num_eval_tasks, max(0, len(ready) - 1))
        self.eval_tasks, self.tasks = ready[:n_eval], ready[n_eval:]
        self._order = list(range(len(self.tasks)))
        self.run_store = Store(Path(c.store).expanduser() if c.store else None).run(c.run_name)
        done = self.run_store.units()
        for task_id, sample in done:
            self._next_sample[task_id] = max(self._next_sample.get(task_id, 0), sample + 1)
        log.info("endless_terminals: %d tasks (%d held out for eval), episodes go to %s",
                 len(self.tasks), len(self.eval_tasks), self.run_store.path)

    async def get_next_item(self) -> Any:
        if not self.tasks:
            return None
        if self._pos >= len(self._order):
            random.Random(self.config.shuffle_seed + self._pos).shuffle(self._order)
            self._pos = 0
        task = self.tasks[self._order[self._pos % len(self._order)]]
        self._pos += 1
        return task

    # --- episodes ------------------------------------------------------------------------------
    def run_config(self) -> RunConfig:
        """The et-hpc run config of this environment's episodes (the model server from ``--openai.*``)."""
        c = self.config
        srv = self.server.servers[0].config
        policy = PolicyConfig(
            kind="openai", base_url=srv.base_url or None, model=None if srv.model_name in ("", "default") else srv.model_name,
            api_key=srv.api_key or None, mode=c.mode, temperature=c.agent_temperature,
            max_tokens=c.max_tokens_per_turn, logprobs=True, return_token_ids=True, system_prompt=c.system_prompt,
            request_timeout_s=float(srv.timeout), token_in=c.token_in,
        )
        budgets = BudgetConfig(max_turns=c.max_agent_turns, wall_time_s=c.wall_time_s, command_timeout_s=c.command_timeout_s,
                          max_tokens_per_turn=c.max_tokens_per_turn, context_tokens=max(c.max_token_length, 1024))
        return RunConfig(name=c.run_name, store=Path(c.store).expanduser() if c.store else None, samples=c.group_size,
                         policy=policy, budgets=budgets, scoring_timeout_s=c.test_timeout_s,
                         sandbox=SandboxConfig(overlay_mb=c.overlay_mb))

    def _samples(self, task_id: str, n: int) -> list[int]:
        with self._sample_lock:
            first = self._next_sample.get(task_id, 0)
            self._next_sample[task_id] = first + n
        return list(range(first, first + n))

    def _episode(self, task: Any, sample: int, cfg: RunConfig) -> EpisodeRecord:
        from et_hpc.episode.run import run_episode

        return run_episode(task, sample, cfg, self.images[task.id], stop=self._stop)

    async def run_episodes(self, task: Any, n: int) -> list[EpisodeRecord]:
        """``n`` episodes of ``task`` at once (threads), stored in the run store as one shard."""
        cfg = self.run_config()
        loop = asyncio.get_running_loop()
        futs = [loop.run_in_executor(self._pool, self._episode, task, s, cfg) for s in self._samples(task.id, n)]
        records = list(await asyncio.gather(*futs))
        if self._stop.is_set():  # interrupted episodes are not data; a later run redoes them
            records = [r for r in records if r.status == "ok"]
        if self.run_store is not None:
            self.run_store.write(records)
        self.counts["episodes"] += len(records)
        self.counts["episode_errors"] += sum(r.status != "ok" for r in records)
        return records

    def group_from_records(self, records: list[EpisodeRecord]) -> ScoredDataGroup | None:
        """The ScoredDataGroup to send for one group's episodes, or None (masked, or no tokens)."""
        if not records:
            return None
        errors = [r for r in records if r.status != "ok"]
        ok = [r for r in records if r.status == "ok"]
        if errors and (self.config.on_error == "mask" or not ok):
            self.counts["groups_masked"] += 1
            log.warning("group of %s masked: %d of %d episodes ended in an error (%s)", records[0].task_id,
                        len(errors), len(records), "; ".join(f"{r.status}: {(r.error or '')[:120]}" for r in errors[:3]))
            return None
        if not all(r.has_tokens for r in ok):
            self.counts["groups_without_tokens"] += 1
            log.warning("group of %s not sent: episodes without token ids (serve the model with "
                        "return_token_ids, e.g. vLLM >= 0.10.2)", ok[0].task_id)
            return None
        group = atropos_group(ok)
        validate_atropos_group(group)
        if not self.config.include_messages:
            group["messages"] = None
        self.counts["groups_sent"] += 1
        return group  # type: ignore[return-value]

    async def collect_trajectories(self, item: Any) -> tuple[ScoredDataGroup | None, list[Any]]:
        records = await self.run_episodes(item, self.config.group_size)
        if self._stop.is_set():  # stopping: its interrupted episodes were dropped, so no whole group
            return None, []
        return self.group_from_records(records), []

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        """One episode per held-out task; logs the pass rate and mean reward."""
        if not self.eval_tasks:
            return
        records = [r for t in self.eval_tasks for r in await self.run_episodes(t, 1)]
        ok = [r for r in records if r.status == "ok"]
        metrics = {
            "eval/episodes": float(len(records)),
            "eval/errors": float(len(records) - len(ok)),
            "eval/mean_reward": (sum(r.reward or 0.0 for r in ok) / len(ok)) if ok else 0.0,
            "eval/pass_rate": (sum(solved(r.reward) for r in ok) / len(ok)) if ok else 0.0,
        }
        log.info("endless_terminals eval: %s", metrics)
        await self.evaluate_log(metrics)

    async def wandb_log(self, wandb_metrics: dict | None = None) -> None:
        wandb_metrics = dict(wandb_metrics or {})
        for k, v in self.counts.items():
            wandb_metrics[f"train/et_hpc_{k}"] = v
        await super().wandb_log(wandb_metrics)

    async def env_manager(self) -> None:
        """Atropos' serve loop, stopped cleanly by SIGINT/SIGTERM (see ``_until_signalled``)."""
        await self._until_signalled(super().env_manager())

    async def process_manager(self) -> None:
        """Atropos' process loop, stopped cleanly by SIGINT/SIGTERM."""
        await self._until_signalled(super().process_manager())

    async def _until_signalled(self, coro: Any) -> None:
        """Run ``coro``; on SIGINT/SIGTERM stop it, let running episodes end at their next turn
        (their instances stop, their interrupted records are not stored) and return normally."""
        loop = asyncio.get_running_loop()
        main = asyncio.ensure_future(coro)

        def stop(name: str) -> None:
            if not self._stop.is_set():
                log.warning("%s: stopping; running episodes end at their next turn", name)
            self._stop.set()
            main.cancel()

        installed = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop, sig.name)
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
                pass
        try:
            await main
        except asyncio.CancelledError:
            if not self._stop.is_set():
                raise
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)
            await loop.run_in_executor(None, self._pool.shutdown, True)
        log.info("endless_terminals: %s", self.counts)

    async def cleanup(self) -> None:
        """Called by Atropos after each group; nothing to do (sandboxes end with their episode)."""

    def close(self) -> None:
        """Stop running episodes at their next turn and wait for them (their instances stop)."""
        self._stop.set()
        self._pool.shutdown(wait=True)


if __name__ == "__main__":
    EndlessTerminalsEnv.cli()
