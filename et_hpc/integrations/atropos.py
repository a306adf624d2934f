"""The Endless Terminals environment for Atropos, on et-hpc: ``EndlessTerminalsEnv`` (an atroposlib ``BaseEnv``).

Configured like the seed environment (hermes-agent's ``endless_terminals_env.py``) plus et-hpc's
own settings. Each trajectory is one et-hpc episode (``et_hpc.episode.run.run_episode``), also
written to et-hpc's run store. A group is ``group_size`` episodes of one task with an id no other
env process shares, sent as a validated ``ScoredDataGroup`` when ``untrainable`` allows; rewards
follow ``reward`` (binary by default, as every run). No episode is lost to a cancel (the group is
stored, marked ``CANCELLED_EVENT``); a stop stores running episodes as ``infra_error``; dead env
processes' sandboxes are reaped at setup and by a thread. Run it with atropos' subcommands:
``python -m et_hpc.integrations.atropos serve|process ...``. Specification: docs/atropos.md.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup
from pydantic import Field

from et_hpc.agent.base import DEFAULT_MAX_TOKENS
from et_hpc.agent.loop import BudgetConfig
from et_hpc.agent.policies import PolicyConfig
from et_hpc.episode.config import EpisodeConfig
from et_hpc.errors import UserError
from et_hpc.record import CANCELLED_EVENT, DEFAULT_REWARD_RULE, EpisodeRecord, apply_reward_rule, solved
from et_hpc.runs.export import atropos_group, validate_atropos_group
from et_hpc.runs.groups import group_of_records, take_samples, untrainable
from et_hpc.runs.store import RunStore, Store
from et_hpc.sandbox.config import DEFAULT_OVERLAY_MB, SandboxConfig
from et_hpc.text import storable

if TYPE_CHECKING:
    from et_hpc.images.store import ImageResult
    from et_hpc.tasks.model import Task

log = logging.getLogger(__name__)

SEED_DATASET = "obiwan96/endless-terminals-train"
REAP_EVERY_S = 30.0  # the reaper thread's period: dead env processes' sandboxes on this node go within it


@dataclass
class _GroupRun:
    """One ``collect_trajectories`` group in flight: its members' records as they end."""

    task: Task
    group_id: str
    store: RunStore
    size: int
    eval_run: bool = False
    cancelled: bool = False
    started: bool = False  # a member has started: the whole group runs and is stored
    left: int = 0
    records: list[EpisodeRecord | None] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.left = self.size
        self.records = [None] * self.size


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
    token_in: bool = Field(
        default=False,
        description="send token ids (llama-server /completion, vLLM /v1/completions): "
        "exact tokens from servers whose chat route returns none",
    )
    max_tokens_per_turn: int = Field(default=DEFAULT_MAX_TOKENS, ge=1, description="completion tokens per turn")
    wall_time_s: float = Field(default=300.0, gt=0, description="agent wall time per episode (s)")
    command_timeout_s: float = Field(default=60.0, gt=0, description="time limit of one shell command (s)")
    max_concurrent_episodes: int = Field(default=16, ge=1, description="episodes (instances) running at once")
    on_error: Literal["mask", "keep-ok"] = Field(
        default="mask", description="a group with an error episode: mask it or keep its ok episodes"
    )  # noqa: E501
    store: str | None = Field(default=None, description="et-hpc store root for the episodes (default $ET_HPC_STORE or ./et-hpc-runs)")
    run_name: str = Field(default="atropos-endless", description="run name inside the store")
    eval_run_name: str | None = Field(default=None, description="run name of evaluate()'s episodes (default <run_name>-eval)")
    reward: Literal["binary", "fraction"] = Field(
        default=DEFAULT_REWARD_RULE,
        description="binary: 1 when all final tests pass (every et-hpc run's default); fraction: passed/total (the seed's rule)",
    )
    endpoint_file: str | None = Field(
        default=None, description="endpoint file of slurm/vllm.sbatch (address, key, model_version); replaces --openai.base_url"
    )
    endpoint_dir: str | None = Field(
        default=None, description="folder of endpoint files, one per server (replicas, failover); replaces --openai.base_url"
    )
    shuffle_seed: int = Field(default=0, description="order in which tasks are served")
    num_eval_tasks: int = Field(default=0, ge=0, description="tasks held out for evaluate() (one episode each)")
    overlay_mb: int = Field(default=DEFAULT_OVERLAY_MB, ge=16, description="per-episode writable overlay size")


class _QuietInterrupts(logging.Filter):
    """Drops the agent loop's traceback for an episode a stop interrupted (one line per episode is
    logged by the environment instead)."""

    def filter(self, record: logging.LogRecord) -> bool:
        from et_hpc.episode.run import Interrupted

        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, Interrupted)


class EndlessTerminalsEnv(BaseEnv):
    """Endless Terminals tasks as an Atropos environment; every trajectory is a real et-hpc episode."""

    name = "endless_terminals"
    env_config_cls = EndlessTerminalsEnvConfig

    def __init__(self, config: EndlessTerminalsEnvConfig, server_configs: Any, slurm: bool = False, testing: bool = False) -> None:
        super().__init__(config, server_configs, slurm, testing)
        self.config: EndlessTerminalsEnvConfig = config
        self.tasks: list[Task] = []
        self.eval_tasks: list[Task] = []
        self.images: dict[str, ImageResult] = {}
        self._order: list[int] = []
        self._pos = 0
        self._epoch = -1
        self._next_sample: dict[tuple[str, str], int] = {}  # (run dir, task id) -> above every stored sample
        self._sample_lock = threading.Lock()
        self.writer = secrets.token_hex(4)  # this process's part of its group ids
        self._reaping = threading.Event()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=config.max_concurrent_episodes, thread_name_prefix="et-episode")
        self.run_store: RunStore | None = None
        self.eval_store: RunStore | None = None
        loop_log = logging.getLogger("et_hpc.agent.loop")
        if not any(isinstance(f, _QuietInterrupts) for f in loop_log.filters):
            loop_log.addFilter(_QuietInterrupts())
        self.counts = {
            "groups_sent": 0,
            "groups_masked": 0,
            "groups_without_tokens": 0,
            "groups_cancelled": 0,
            "episodes": 0,
            "episodes_started": 0,
            "episodes_stored": 0,
            "episodes_interrupted": 0,
            "episode_errors": 0,
            "store_errors": 0,
        }

    @classmethod
    def config_init(cls) -> tuple[EndlessTerminalsEnvConfig, list[APIServerConfig]]:
        env = EndlessTerminalsEnvConfig(
            group_size=8,
            use_wandb=False,
            max_token_length=16384,
            wandb_name=cls.name,
            ensure_scores_are_not_same=True,
            steps_per_eval=500,
            total_steps=10000,
        )
        server = APIServerConfig(
            model_name="default", base_url="http://localhost:8000/v1", api_key="EMPTY", server_type="openai", health_check=False
        )
        return env, [server]

    # --- setup ---------------------------------------------------------------------------------
    async def setup(self) -> None:
        from et_hpc.runner.config import RunConfig
        from et_hpc.runner.plan import prepare_run
        from et_hpc.sandbox.reaper import reap_dead, start_reaping
        from et_hpc.tasks.loader import load_tasks

        c = self.config
        # the sandboxes of env processes (or workers) on this node that died without stopping them
        reap_dead()
        start_reaping(self._reaping, REAP_EVERY_S)
        ids = [i.strip() for i in c.task_ids.split(",") if i.strip()] if c.task_ids else None
        res = load_tasks(c.dataset_name, tasks_dir=c.tasks_base_dir, ids=ids, split=c.split, progress=False)
        for e in res.errors:
            log.warning("task source %s: %s", c.dataset_name, e)
        cfg = RunConfig.model_validate({"name": c.run_name, "tasks": {"source": c.dataset_name}})
        prep = prepare_run(cfg, tasks=list(res.tasks), missing="skip")
        for tid, why in prep.no_image.items():
            log.warning("task %s skipped: image %s (build it with 'et-hpc build %s')", tid, why, c.dataset_name)
        self.images = prep.images
        ready = [t for t in res.tasks if t.id in prep.images]
        if c.endpoint_file and c.endpoint_dir:
            raise UserError("set one of --env.endpoint_file and --env.endpoint_dir, not both")
        rng = random.Random(c.shuffle_seed)
        rng.shuffle(ready)
        n_eval = min(c.num_eval_tasks, max(0, len(ready) - 1))
        self.eval_tasks, self.tasks = ready[:n_eval], ready[n_eval:]
        root = Store(Path(c.store).expanduser() if c.store else None)
        self.run_store = root.run(c.run_name)
        self.eval_store = root.run(self.eval_run_name)
        if self.eval_store.path == self.run_store.path:
            raise UserError(f"--env.eval_run_name {self.eval_run_name!r} is the training run: evaluation episodes need their own run")
        for rs in (self.run_store, self.eval_store):
            for task_id, sample in rs.units():
                key = (str(rs.path), task_id)
                self._next_sample[key] = max(self._next_sample.get(key, 0), sample + 1)
        self.run_store.write_config(
            {
                "kind": "atropos-env",
                "env": self.name,
                "dataset": c.dataset_name,
                "group_size": c.group_size,
                "reward": c.reward,
                "config": {"reward": c.reward, "samples": c.group_size},
                "eval_run": self.eval_run_name,
            }
        )
        log.info(
            "endless_terminals: %d tasks (%d held out for eval), episodes go to %s (eval: %s), reward %s",
            len(self.tasks),
            len(self.eval_tasks),
            self.run_store.path,
            self.eval_store.path,
            c.reward,
        )

    @property
    def eval_run_name(self) -> str:
        return self.config.eval_run_name or f"{self.config.run_name}-eval"

    def epoch_order(self, epoch: int) -> list[int]:
        """The order tasks are served in epoch ``epoch``: a fresh permutation per epoch (seeded)."""
        order = list(range(len(self.tasks)))
        random.Random(f"{self.config.shuffle_seed}:{epoch}").shuffle(order)
        return order

    async def get_next_item(self) -> Any:
        if not self.tasks:
            return None
        if self._epoch < 0 or self._pos >= len(self._order):
            self._epoch += 1
            self._order = self.epoch_order(self._epoch)
            self._pos = 0
        task = self.tasks[self._order[self._pos]]
        self._pos += 1
        return task

    # --- episodes ------------------------------------------------------------------------------
    def run_config(self, run_name: str | None = None) -> EpisodeConfig:
        """The episode config of this environment's episodes (no run config: the episodes are
        Atropos's, not a run's): the model server of
        ``--env.endpoint_file``/``--env.endpoint_dir`` (et-hpc's client: replicas, failover, the
        file's key, policy versions), else of ``--openai.*``."""
        c = self.config
        srv = self.server.servers[0].config
        model = None if srv.model_name in ("", "default") else srv.model_name
        where: dict[str, Any]
        if c.endpoint_file or c.endpoint_dir:
            where = {
                "endpoint_file": Path(c.endpoint_file).expanduser() if c.endpoint_file else None,
                "endpoint_dir": Path(c.endpoint_dir).expanduser() if c.endpoint_dir else None,
            }
            if srv.api_key and srv.api_key != "EMPTY":
                where["api_key"] = srv.api_key
        else:
            where = {"base_url": srv.base_url or None, "api_key": srv.api_key or None}
        policy = PolicyConfig(
            kind="openai",
            model=model,
            mode=c.mode,
            temperature=c.agent_temperature,
            max_tokens=c.max_tokens_per_turn,
            logprobs=True,
            return_token_ids=True,
            system_prompt=c.system_prompt,
            request_timeout_s=float(srv.timeout),
            token_in=c.token_in,
            **where,
        )
        budgets = BudgetConfig(
            max_turns=c.max_agent_turns,
            wall_time_s=c.wall_time_s,
            command_timeout_s=c.command_timeout_s,
            max_tokens_per_turn=c.max_tokens_per_turn,
            context_tokens=max(c.max_token_length, 1024),
        )
        return EpisodeConfig(
            name=run_name or c.run_name,
            store=Path(c.store).expanduser() if c.store else None,
            policy=policy,
            budgets=budgets,
            scoring_timeout_s=c.test_timeout_s,
            sandbox=SandboxConfig(overlay_mb=c.overlay_mb),
        )

    def _samples(self, store: RunStore, task_id: str, n: int) -> list[int]:
        """``n`` samples of ``task_id`` no other process of this run gets (``take_samples``)."""
        key = (str(store.path), task_id)
        with self._sample_lock:
            got = take_samples(store.path, task_id, n, self._next_sample.get(key, 0))
            self._next_sample[key] = got[-1] + 1
        return got

    def _episode(self, task: Task, sample: int, cfg: EpisodeConfig) -> EpisodeRecord:
        from et_hpc.episode.run import run_episode

        return run_episode(task, sample, cfg, self.images[task.id], stop=self._stop)

    def score(self, rec: EpisodeRecord) -> EpisodeRecord:
        """``rec`` with its reward under ``config.reward`` (``apply_reward_rule``: ``binary`` = 1
        when all final tests pass, ``fraction`` = passed/total, the seed's rule), rule recorded."""
        return apply_reward_rule(rec, self.config.reward)

    async def run_episodes(self, task: Task, n: int, store: RunStore | None = None) -> list[EpisodeRecord]:
        """``n`` episodes of ``task`` as one group (threads), stored as one shard when the last ends.

        The group's ``group_id`` is ``<task_id>@w<writer>-s<first sample>`` (``writer``: this
        process's random id; samples come from ``_samples``). Episodes run in the pool, not in
        the coroutine: when Atropos cancels the coroutine (``worker_timeout``, a full queue, an
        eval), the episodes finish and the group is still stored, with the event
        ``collect cancelled: not sent``. A stop (SIGINT/SIGTERM, ``close``) ends running episodes at
        their next turn; they are stored as ``infra_error`` (masked) and logged one line each.
        """
        store = store or self.run_store
        assert store is not None, "setup() first"
        eval_run = store is self.eval_store
        cfg = self.run_config(store.name)
        samples = self._samples(store, task.id, n)
        group = _GroupRun(task=task, group_id=f"{task.id}@w{self.writer}-s{samples[0]}", store=store, size=n, eval_run=eval_run)
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def finished(records: list[EpisodeRecord]) -> None:  # in the thread that ended the group
            def settle() -> None:
                if not done.done():
                    done.set_result(records)

            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:  # the loop is gone (shutdown): the group is stored all the same
                pass

        for i, sample in enumerate(samples):
            self._pool.submit(self._run_member, group, i, sample, cfg, finished)
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            with group.lock:
                group.cancelled = True
            with self._sample_lock:
                self.counts["groups_cancelled"] += 1
            if not self._stop.is_set():
                log.info("group %s cancelled by atropos: its episodes finish and are stored, the group is not sent", group.group_id)
            raise

    def _run_member(self, group: _GroupRun, i: int, sample: int, cfg: EpisodeConfig, finished: Any) -> None:
        """One member of ``group`` in a pool thread; the last member to end writes the group.

        A group that Atropos cancelled, or that a stop reached, before any member started is
        dropped whole (nothing ran, nothing is stored). Once a member started, every member runs
        (or, stopping, is recorded as interrupted), so a stored group always has all its members.
        """
        task = group.task
        with group.lock:
            skip = not group.started and (group.cancelled or self._stop.is_set())
            group.started = group.started or not skip
        if skip:
            with group.lock:
                group.left -= 1
                last = group.left == 0
            if last:
                finished([])
            return
        if self._stop.is_set():  # its group started, it did not: recorded so the group stays whole (masked)
            rec = EpisodeRecord(
                run_name=cfg.run_name(),
                task_id=task.id,
                sample=sample,
                status="infra_error",
                error="interrupted by the run before it started",
                policy_kind=f"openai-{cfg.policy.mode}",
            )
        else:
            with self._sample_lock:
                self.counts["episodes_started"] += 1
            try:
                rec = self._episode(task, sample, cfg)
            except Exception as e:  # our bug, never the agent's: an error record, not a lost episode
                log.exception("episode %s sample %d failed", task.id, sample)
                rec = EpisodeRecord(
                    run_name=cfg.run_name(), task_id=task.id, sample=sample, status="infra_error", error=f"{type(e).__name__}: {e}"[:2000]
                )
        rec = self.score(rec).model_copy(update={"group_id": group.group_id, "group_size": group.size})
        if self._stop.is_set() and rec.status != "ok":
            with self._sample_lock:
                self.counts["episodes_interrupted"] += 1
            log.warning(
                "interrupted: %s sample %d (group %s) stored as %s: %s", task.id, sample, group.group_id, rec.status, rec.error or ""
            )
        with group.lock:
            group.records[i] = rec
            group.left -= 1
            last = group.left == 0
            cancelled = group.cancelled
        if not last:
            return
        records = [r for r in group.records if r is not None]
        if not records:
            finished([])
            return
        if cancelled:
            records = [r.model_copy(update={"events": [*r.events, CANCELLED_EVENT]}) for r in records]
        try:
            group.store.write(records)
            with self._sample_lock:
                self.counts["episodes_stored"] += len(records)
        except Exception as e:
            with self._sample_lock:
                self.counts["store_errors"] += 1
            log.error("group %s: writing its %d episodes to %s failed: %s", group.group_id, len(records), group.store.path, e)
        with self._sample_lock:
            if not group.eval_run:
                self.counts["episodes"] += len(records)
                self.counts["episode_errors"] += sum(r.status != "ok" for r in records)
        finished(records)

    def group_from_records(self, records: list[EpisodeRecord]) -> ScoredDataGroup | None:
        """The ScoredDataGroup to send for one group's episodes, or None (masked, or no tokens)."""
        if not records:
            return None
        errors = [r for r in records if r.status != "ok"]
        ok = [r for r in records if r.status == "ok"]
        why = untrainable(group_of_records(records), self.config.on_error)
        if why in ("masked", "incomplete"):
            self.counts["groups_masked"] += 1
            log.warning(
                "group of %s masked: %d of %d episodes ended in an error (%s)",
                records[0].task_id,
                len(errors),
                records[0].group_size or len(records),
                "; ".join(f"{r.status}: {(r.error or '')[:120]}" for r in errors[:3]),
            )
            return None
        if why == "no_tokens":
            self.counts["groups_without_tokens"] += 1
            log.warning(
                "group of %s not sent: episodes without token ids (serve the model with return_token_ids, e.g. vLLM >= 0.10.2)",
                ok[0].task_id,
            )
            return None
        group, _ = storable(atropos_group(ok))  # sent as JSON: lone surrogates as \udcHH text, as exported
        validate_atropos_group(group)
        if not self.config.include_messages:
            group["messages"] = None
        self.counts["groups_sent"] += 1
        return cast("ScoredDataGroup", group)  # atropos_group fills every key of one (a plain dict)

    async def collect_trajectories(self, item: Any) -> tuple[ScoredDataGroup | None, list[Any]]:
        records = await self.run_episodes(item, self.config.group_size)
        if self._stop.is_set():  # stopping: its interrupted episodes were dropped, so no whole group
            return None, []
        return self.group_from_records(records), []

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        """One episode per held-out task; logs the pass rate and mean reward."""
        if not self.eval_tasks:
            return
        records = [r for t in self.eval_tasks for r in await self.run_episodes(t, 1, self.eval_store)]
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
        (their instances stop; they are stored as ``infra_error``, one log line each) and return."""
        loop = asyncio.get_running_loop()
        main = asyncio.ensure_future(coro)

        def stop(name: str) -> None:
            if not self._stop.is_set():
                log.warning("%s: stopping; running episodes end at their next turn and are stored", name)
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
            self._reaping.set()
        log.info("endless_terminals: %s", self.counts)
        c = self.counts
        log.warning(
            "endless_terminals: episodes started %d, stored %d (%d interrupted), groups cancelled %d",
            c["episodes_started"],
            c["episodes_stored"],
            c["episodes_interrupted"],
            c["groups_cancelled"],
        )

    async def cleanup(self) -> None:
        """Called by Atropos after each group; nothing to do (sandboxes end with their episode)."""

    def close(self) -> None:
        """Stop running episodes at their next turn and wait for them (their instances stop)."""
        self._stop.set()
        self._pool.shutdown(wait=True)
        self._reaping.set()


if __name__ == "__main__":
    EndlessTerminalsEnv.cli()
