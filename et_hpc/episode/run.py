"""One episode end to end: sandbox up, agent loop, scoring in the same instance, sandbox down.

``run_episode(task, sample, cfg, image)`` (``cfg``: an ``EpisodeConfig`` or a run config) never
raises for infrastructure trouble: a sandbox that will not start, a failing policy server or a
broken scoring become an ``EpisodeRecord`` with an error status and ``reward=None``; only a reward
from the task's final tests is recorded. The run's sandbox limits and a watchdog apply to the agent
and the tests; what the agent's own actions cause (a watchdog kill, hanging tests, a broken shell)
is status ``ok``, reward 0.0 and a ``score_note``. With a warm pool (``warm``) the episode uses the
reserved sandbox when it is alive and hands it back at the end. Details: docs/sandbox.md, "An
episode".
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from et_hpc import __version__
from et_hpc.agent.base import Action, Policy
from et_hpc.agent.loop import AgentResult, BudgetConfig, run_agent
from et_hpc.agent.policies import PolicyConfig, make_policy
from et_hpc.agent.wire import Mode
from et_hpc.episode.config import EpisodeConfig
from et_hpc.errors import InfraError, UserError
from et_hpc.record import EpisodeRecord, Status, Timings
from et_hpc.sandbox.warm import AGENT_UMASK, Ready, SandboxSpec, Ticket, start_ready  # noqa: F401 - AGENT_UMASK re-exported
from et_hpc.sandbox.watchdog import PHASE_SCORING, Watchdog
from et_hpc.scoring.live import GONE_NOTE, ScoreResult, score, score_fields
from et_hpc.tasks.model import Task

log = logging.getLogger(__name__)


class Interrupted(InfraError):
    """The run was asked to stop (Ctrl-C, SIGTERM, preemption) while this episode ran."""


class _StopAware:
    """Wraps a policy so that a set ``stop`` event ends the agent loop at the next turn."""

    def __init__(self, policy: Policy, stop: threading.Event):
        self._policy, self._stop = policy, stop
        self.mode: Mode = policy.mode if hasattr(policy, "mode") else "text"

    def act(self, messages: list[dict[str, Any]]) -> Action:
        if self._stop.is_set():
            raise Interrupted("stopped by the run (signal or preemption)")
        return self._policy.act(messages)

    def __getattr__(self, name: str) -> Any:  # capture_tokens and the like
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._policy, name)


@functools.lru_cache(maxsize=1)
def _versions() -> dict[str, str]:
    from et_hpc.host.doctor import apptainer_version

    v = apptainer_version()
    return {
        "et_hpc": __version__,
        "apptainer": ".".join(map(str, v)) if v else "",
        "python": platform.python_version(),
    }


_ENDPOINTS: dict[tuple, Any] = {}  # what was resolved once per process: a replica set's wait, an endpoint
_ENDPOINT_LOCK = threading.Lock()


def resolve_policy_config(cfg: PolicyConfig) -> PolicyConfig:
    """Fill ``base_url``/``model`` of an openai policy from the endpoint file (read once per process).

    Only the endpoint's own fields (address, served model, key) are taken from what was resolved;
    everything else is this episode's own ``cfg`` (its sample's seed above all). With
    ``endpoint_dir``, wait (once per process, at most ``endpoint_wait_s``) until one replica of the
    process's replica set answers; each episode's policy then takes a replica of its own."""
    if cfg.kind == "openai" and cfg.endpoint_dir is not None:
        from et_hpc.agent.replicas import replica_set

        rs = replica_set(cfg.endpoint_dir, api_key=cfg.key_value(), api_key_env=cfg.api_key_env)
        with _ENDPOINT_LOCK:
            if ("dir", id(rs)) not in _ENDPOINTS:
                rs.wait_live(cfg.endpoint_wait_s)
                _ENDPOINTS[("dir", id(rs))] = True
        return cfg
    if cfg.kind != "openai" or (cfg.base_url and not cfg.endpoint_file):
        return cfg
    key = (cfg.base_url, str(cfg.endpoint_file), cfg.model)  # the model: a trainer-owned switch names a new one
    with _ENDPOINT_LOCK:
        if key not in _ENDPOINTS:
            from et_hpc.agent.endpoint import resolve_endpoint

            _ENDPOINTS[key] = resolve_endpoint(
                cfg.base_url, cfg.endpoint_file, wait_s=cfg.endpoint_wait_s, api_key=cfg.key_value(), api_key_env=cfg.api_key_env
            )
        ep = _ENDPOINTS[key]
    from pydantic import SecretStr

    # in memory only: the key is never serialised
    return cfg.model_copy(update={"base_url": ep.base_url, "model": cfg.model or ep.model, "api_key": SecretStr(ep.api_key or "")})


def policy_version_fields(policy: Any) -> dict[str, Any]:
    """``policy_version`` (at the first turn), ``policy_versions`` (each change, in order) and
    ``crossed_version`` from each turn's version (the one its response named, else the endpoint's
    before and after the request; an episode without turns: the version when the policy was made),
    and ``version_source`` (``response``, ``endpoint`` or ``mixed``)."""
    seen: list[str] = []
    pairs = getattr(policy, "turn_versions", None) or [(getattr(policy, "start_version", None), None)]
    for v in [v for pair in pairs for v in pair]:
        if v is not None and (not seen or seen[-1] != v):
            seen.append(v)
    if not seen:
        return {}
    sources = set(getattr(policy, "version_sources", None) or [])  # "response" / "endpoint" per turn
    source = (sources.pop() if len(sources) == 1 else "mixed") if sources else "endpoint"
    return {"policy_version": seen[0], "policy_versions": seen, "crossed_version": len(set(seen)) > 1, "version_source": source}


def episode_budgets(budgets: BudgetConfig, task: Task) -> BudgetConfig:
    """The run's budgets, with the task's own limits (task.toml) where it sets them."""
    upd: dict[str, Any] = {}
    if task.limits.max_turns:
        upd["max_turns"] = task.limits.max_turns
    if task.limits.wall_time_s:
        upd["wall_time_s"] = task.limits.wall_time_s
    return budgets.model_copy(update=upd) if upd else budgets


def _slurm_ids() -> tuple[str | None, int | None]:
    job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    task = os.environ.get("SLURM_ARRAY_TASK_ID")
    return job, int(task) if task and task.isdigit() else None


def _base_fields(task: Task, sample: int, cfg: EpisodeConfig, pcfg: PolicyConfig, image: Any) -> dict[str, Any]:
    """The record's fields known before the episode starts (who, what, where)."""
    job, array_task = _slurm_ids()
    return dict(
        run_name=cfg.run_name(),
        task_id=task.id,
        sample=sample,
        split=task.split,
        policy_kind=pcfg.kind if pcfg.kind != "openai" else f"openai-{pcfg.mode}",
        model=pcfg.model,
        sampling_params={k: getattr(pcfg, k) for k in ("temperature", "top_p", "max_tokens", "seed")} if pcfg.kind == "openai" else {},
        image_digest=getattr(image, "digest", None),
        image_path=str(getattr(image, "path", "") or "") or None,
        host=socket.gethostname(),
        worker=f"{socket.gethostname()}:{os.getpid()}",
        slurm_job_id=job,
        slurm_array_task_id=array_task,
        versions=_versions(),
    )


def _episode_record(
    base: dict[str, Any],
    versions: dict[str, Any],
    timings: dict[str, float],
    status: Status,
    *,
    error: str | None = None,
    result: AgentResult | None = None,
    sc: ScoreResult | None = None,
    events: list[str] | None = None,
) -> EpisodeRecord:
    """The episode's record from its fields, the agent's result and the score (either may be missing)."""
    tok = result.tokens if result else None
    peak_pids = timings.get("peak_pids")
    return EpisodeRecord(
        **base,
        messages=result.messages if result else [],
        turns=len(result.turns) if result else 0,
        turn_s=[[round(t.policy_s, 3), round(t.exec_s, 3)] for t in result.turns] if result else None,
        stop_reason=result.stop_reason if result else None,
        status=status,
        **score_fields(sc, status),
        prompt_tokens=result.usage.prompt_tokens if result else None,
        completion_tokens=result.usage.completion_tokens if result else None,
        prompt_token_ids=tok.prompt_token_ids if tok else None,
        token_ids=tok.token_ids if tok else None,
        logprobs=tok.logprobs if tok else None,
        tokens_source=tok.tokens_source if tok else None,
        token_drift=tok.token_drift if tok else None,
        **versions,
        timings=Timings(**{k: v for k, v in timings.items() if k not in _PEAK_KEYS}),
        peak_mem_mb=timings.get("peak_mem_mb"),
        peak_pids=None if peak_pids is None else int(peak_pids),
        error=error,
        events=[*(result.events if result else []), *(events or []), *((sc.notes or []) if sc is not None else [])],
    )


def run_episode(
    task: Task, sample: int, cfg: EpisodeConfig, image: Any, *, stop: threading.Event | None = None, warm: Ticket | None = None
) -> EpisodeRecord:
    """Run one (task, sample) unit of a run and return its record (see the module docstring).

    ``warm``: a sandbox reserved from a ``WarmPool`` for this episode (et_hpc.sandbox.warm); when it
    is alive it is used, else (dead, failed, none) the episode starts its own as without a pool.
    """
    t_start = time.time()
    t0 = time.monotonic()
    stop = stop or threading.Event()
    pcfg: PolicyConfig = cfg.policy
    if pcfg.kind == "replay":
        # Sample i of a replay run replays recorded run (replay_index + i).
        pcfg = pcfg.model_copy(update={"replay_index": pcfg.replay_index + sample})
    elif pcfg.kind == "openai" and pcfg.seed is not None and sample:
        # Sample i sends seed + i: each sample is reproducible, and a group's samples are not all one.
        pcfg = pcfg.model_copy(update={"seed": pcfg.seed + sample})
    budgets = episode_budgets(cfg.budgets, task)
    base = _base_fields(task, sample, cfg, pcfg, image)
    timings: dict[str, float] = {"start_s": t_start}
    versions: dict[str, Any] = {}

    def record(
        status: Status,
        *,
        error: str | None = None,
        result: AgentResult | None = None,
        sc: ScoreResult | None = None,
        events: list[str] | None = None,
    ) -> EpisodeRecord:
        if warm is not None:
            warm.discard()  # a reserved sandbox the episode did not use (no-op once handed out)
        timings["stop_s"] = time.time()
        timings["total_s"] = time.monotonic() - t0
        return _episode_record(base, versions, timings, status, error=error, result=result, sc=sc, events=events)

    image_path = getattr(image, "path", None)
    if image is None or image_path is None:
        return record("infra_error", error=f"no image for task {task.id}: run 'et-hpc build'")
    if task.final_tests is None:
        return record("infra_error", error=f"task {task.id} has no test_final_state.py")
    try:
        policy = make_policy(resolve_policy_config(pcfg), task, max_tokens=budgets.max_tokens_per_turn)
    except (UserError, InfraError) as e:
        return record("policy_error", error=str(e))
    ready: list[Ready] = []  # the episode's sandbox, once there is one
    setup = functools.partial(_setup, _spec(task, cfg, image, image_path), warm, f"{task.id}#{sample}", timings, ready)
    pre_setup = time.monotonic() - t0  # the policy and its endpoint: counted as setup
    status, kw = _drive(task, setup, policy, pcfg, budgets, cfg, stop, timings)
    if "setup_s" in timings:
        timings["setup_s"] += pre_setup
    base["model"] = getattr(policy, "model", None) or base["model"]  # a served model is named on first use
    constrained = getattr(policy, "constrained", None)
    if isinstance(constrained, list) and constrained:  # per turn: how the reply was constrained
        base["sampling_params"] = {**base["sampling_params"], "constrained": list(constrained)}
    _tear_down(task, cfg, warm, ready, status, base, kw, timings)
    versions.update(policy_version_fields(policy))
    if getattr(policy, "server_sampling", None):  # what the server sampled with, its own defaults included
        base["sampling_params"] = {**base["sampling_params"], "server": policy.server_sampling}  # type: ignore[attr-defined]
    close = getattr(policy, "close", None)
    if close:
        close()
    policy_events = getattr(policy, "events", None)
    if policy_events:  # failovers between policy servers
        kw["events"] = [*policy_events, *kw.get("events", [])]
    return record(status, **kw)


def _tear_down(
    task: Task,
    cfg: EpisodeConfig,
    warm: Ticket | None,
    ready: list[Ready],
    status: Status,
    base: dict[str, Any],
    kw: dict[str, Any],
    timings: dict[str, float],
) -> None:
    """Stop the episode's sandbox (or hand it back to the pool), keeping its final state first when
    the run asks for it (``base``'s ``final_state``/``tests_digest``, an event in ``kw`` if not kept)."""
    t = time.monotonic()
    kept: dict[str, str] = {}
    keep = cfg.sandbox.keep_final_state and bool(ready) and status in ("ok", "score_error")
    if keep:  # archived by the stop, before the overlay is deleted: so not in the background
        keep_state_hook(ready[-1].sandbox, cfg.run_dir(), cfg.sandbox.final_state_mb, kept)
    if keep or warm is None or not warm.retire(ready):  # with a pool, it stops them in the background
        for r in ready:
            r.stop()
    timings["teardown_s"] = time.monotonic() - t
    if not keep:
        return
    try:  # the tests that scored it, kept beside it: what a rescore diffs against
        from et_hpc.runs.final_state import keep_tests

        assert task.final_tests is not None  # run_episode checked it
        base["tests_digest"] = keep_tests(cfg.run_dir(), task.final_tests)
    except OSError as e:
        log.warning("could not keep the final tests of %s: %s", task.id, e)
    base["final_state"] = kept.get("final_state", "not kept: the sandbox stopped before scoring")
    if base["final_state"].startswith("not kept"):
        kw["events"] = [*kw.get("events", []), f"final_state: {base['final_state']}"]


def sandbox_spec(task: Task, cfg: EpisodeConfig, image: Any) -> SandboxSpec | None:
    """What the episode's sandbox is made of (None without an image): the key of warm sandboxes."""
    path = getattr(image, "path", None)
    return None if path is None else _spec(task, cfg, image, path)


def _spec(task: Task, cfg: EpisodeConfig, image: Any, path: Any) -> SandboxSpec:
    """``sandbox_spec`` of an image at ``path``."""
    opts = cfg.sandbox
    storage = task.limits.storage_mb or opts.overlay_mb
    return SandboxSpec(
        image_path=str(path),
        image_digest=getattr(image, "digest", None),
        run_prefix=f"et-{cfg.run_name()}"[:24],
        overlay_mb=None if opts.writable_tmpfs else max(storage, 64),
        writable_tmpfs=opts.writable_tmpfs,
        network_none=opts.network == "none",
        nproc=opts.max_pids + PIDS_HEADROOM,
        vmem_mb=opts.vmem_mb,
        fsize_mb=opts.fsize_mb,
        output_limit=cfg.budgets.output_limit_chars,
        memory_mb=opts.memory_mb,
        max_pids=opts.max_pids,
        watchdog_interval_s=opts.watchdog_interval_s,
        local_copy=opts.local_copy,
        local_copy_budget_gb=opts.local_copy_budget_gb,
        binds=tuple(opts.bind_options()),
    )


def _setup(spec: SandboxSpec, warm: Ticket | None, label: str, timings: dict[str, float], out: list[Ready]) -> Ready:
    """The episode's sandbox, appended to ``out``: the warm one when it is alive, else one started now."""
    ready = warm.take() if warm is not None else None
    if ready is not None:
        timings["warm_s"] = ready.start_s
    out.append(ready or start_ready(spec))
    log.debug("episode %s: sandbox %s (%s)", label, out[-1].sandbox.name, "warm" if ready else "started inline")
    return out[-1]


def _drive(
    task: Task,
    setup: Callable[[], Ready],
    policy: Policy,
    pcfg: PolicyConfig,
    budgets: BudgetConfig,
    cfg: EpisodeConfig,
    stop: threading.Event,
    timings: dict[str, float],
) -> tuple[Status, dict[str, Any]]:
    """Get the sandbox from ``setup()``, run the agent, score. Returns (status, record fields); never raises."""
    result: AgentResult | None = None
    wd: Watchdog | None = None
    sandbox = None
    try:
        try:
            t = time.monotonic()
            r = setup()
            sandbox, shell = r.sandbox, r.shell
            wd = r.watchdog.start() if r.watchdog is not None else None
            timings["setup_s"] = time.monotonic() - t
        except (InfraError, OSError) as e:
            return "infra_error", {"error": f"sandbox: {e}"}
        t = time.monotonic()
        result = run_agent(
            task.prompt,
            shell,
            _StopAware(policy, stop),
            budgets,
            system_prompt=pcfg.system_prompt,
            shell_blame=lambda e: not stop.is_set() and sandbox.health() in ("alive", "gone"),
        )
        timings["agent_s"] = time.monotonic() - t
        timings["model_s"], timings["exec_s"] = result.model_s, result.exec_s
        if stop.is_set():
            return "infra_error", {"error": "interrupted by the run", "result": result}
        if result.status != "ok":
            return result.status, {"error": result.error, "result": result}
        events = [f"shell_broken: {result.error}"] if result.stop_reason == "shell_broken" else []
        t = time.monotonic()
        sc, wd_events = final_score(sandbox, wd, task, cfg)
        timings["score_s"] = time.monotonic() - t
        events += wd_events
        if stop.is_set() and (sc.status != "ok" or sc.note == GONE_NOTE):
            return "infra_error", {"error": "interrupted by the run", "result": result, "events": events}
        if sc.status != "ok":
            return "score_error", {"error": sc.error, "result": result, "sc": sc, "events": events}
        if result.stop_reason == "shell_broken" and sc.reward == 0.0 and not sc.note:
            sc.note = f"the agent broke its shell ({result.error}); the state it left fails the tests"
        return "ok", {"result": result, "sc": sc, "events": events}
    except Exception as e:  # noqa: BLE001 - an episode must end in a record, whatever broke
        log.exception("episode %s/%s failed", task.id, getattr(sandbox, "name", "?"))
        return "infra_error", {"error": f"{type(e).__name__}: {e}", "result": result}
    finally:
        if wd is not None:
            wd.stop()
            timings["peak_mem_mb"], timings["peak_pids"] = round(wd.peak_kb / 1024, 3), wd.peak_pids


def final_score(sandbox: Any, wd: Watchdog | None, task: Task, cfg: EpisodeConfig) -> tuple[Any, list[str]]:
    """Score the state in ``sandbox`` with ``task``'s final tests, as every episode is scored (also
    what 'et-hpc rescore' runs on a kept state): the watchdog switched to its scoring phase, then
    stopped, a kill during the tests blamed on the state. Returns (score result, watchdog events)."""
    timeout = cfg.scoring_timeout_s
    if task.limits.verifier_timeout_s:
        timeout = max(timeout, task.limits.verifier_timeout_s)
    if wd is not None:
        wd.phase, wd.protect = PHASE_SCORING, set  # scoring closes the shells
    assert task.final_tests is not None, f"task {task.id} has no final tests"  # callers check it first
    sc = score(sandbox, task.final_tests, timeout_s=timeout)
    events: list[str] = []
    if wd is not None:
        wd.stop()
        events += wd.events
        sc = watchdog_blame(wd, sc)
    return sc, events


def keep_state_hook(sandbox: Any, run_dir: Any, limit_mb: float, out: dict[str, str]) -> None:
    """Have ``sandbox.stop()`` archive its overlay (et_hpc.runs.final_state) into ``out["final_state"]``."""
    from et_hpc.runs.final_state import NOT_KEPT, keep

    if getattr(sandbox, "overlay", None) is None:
        out["final_state"] = f"{NOT_KEPT}the sandbox has no overlay image (sandbox.writable_tmpfs)"
        return
    sandbox.before_overlay_delete = lambda path: out.__setitem__("final_state", keep(path, run_dir, limit_mb))


# measured beside the timings, recorded as their own columns
_PEAK_KEYS = ("peak_mem_mb", "peak_pids")

# ``ulimit -u`` sits this far above ``sandbox.max_pids``, so the watchdog sees a fork bomb reach
# max_pids and kills it, instead of the bomb saturating just under the rlimit until the timeout.
PIDS_HEADROOM = 64


def watchdog_blame(wd: Watchdog, sc: Any) -> Any:
    """A watchdog kill during the final tests is the agent's doing (it left a /dev/zero symlink, a
    huge sparse file, a full /dev/shm): a score that failed because of it becomes ok, reward 0."""
    if sc.status == "ok" or not wd.tripped_in(PHASE_SCORING):
        return sc
    line = next(e for e in wd.events if PHASE_SCORING in e)
    return sc.model_copy(update={"status": "ok", "reward": 0.0, "error": None, "note": f"the final tests hit a limit: {line}"})
