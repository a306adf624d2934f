"""Find the policy server and its key: a given base URL, or the endpoint file a vLLM Slurm job writes.

Offers ``write_endpoint_file``/``read_endpoint_file`` (atomic, mode 0600), ``EndpointWatch``
(the current ``model_version``, re-read only when the file's stat changed), ``resolve_api_key``
and ``resolve_endpoint`` (waits, bounded, for the file and for ``GET /models``, giving an
``Endpoint``). Guarantees: a file that carries a key and is readable by others, or is not ours,
is refused in one line; a give-up is a ``UserError`` naming the file, the job and what Slurm
says; the key is never written elsewhere, logged or shown in a repr. Fields: docs/policy.md;
who may read the key: SECURITY.md.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from et_hpc.errors import UserError
from et_hpc.host import slurm
from et_hpc.util import atomic_open

log = logging.getLogger(__name__)

DEFAULT_KEY_ENV = "OPENAI_API_KEY"
NO_KEY = "EMPTY"  # sent when no key is known (vLLM without --api-key takes any)


@dataclass(frozen=True)
class ClientDefaults:
    """The OpenAI client's defaults, for PolicyConfig and OpenAIPolicy alike."""

    temperature: float = 0.7
    top_p: float = 1.0
    request_timeout_s: float = 300.0  # one request
    max_retries: int = 6  # retries of a failed request
    retry_budget_s: float = 180.0  # all retries of one request
    backoff_base_s: float = 1.0
    backoff_max_s: float = 30.0
    failover_after: int = 2  # endpoint_dir: failed attempts in a row before another server


CLIENT = ClientDefaults()


class Endpoint(BaseModel):
    base_url: str
    model: str | None = None
    job_id: str | None = None
    model_version: str | None = None
    served_model: str | None = None  # the versioned alias (et_hpc.agent.served)
    api_key: str | None = Field(default=None, exclude=True, repr=False)


def endpoint_record(
    host: str,
    port: int,
    model: str | None,
    job_id: str | None = None,
    *,
    api_key: str | None = None,
    model_version: str | None = None,
    started_at: str | None = None,
    served_model: str | None = None,
) -> dict:
    """The endpoint file's content, as every writer must produce it."""
    now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return {
        "host": host,
        "port": int(port),
        "base_url": f"http://{host}:{int(port)}/v1",
        "model": model,
        "api_key": api_key,
        "model_version": model_version,
        "served_model": served_model,
        "job_id": job_id,
        "started_at": started_at or now,
        "written_at": now,
    }


def write_endpoint_file(path: Path, record: dict) -> None:
    """Publish ``record`` at ``path``: mode 0600, temp file + rename in a 0700 directory if new."""
    with atomic_open(Path(path), tmp_name=f".endpoint.{os.getpid()}.{time.monotonic_ns()}", mode=0o600, dir_mode=0o700) as f:
        f.write((json.dumps(record, indent=2) + "\n").encode("utf-8"))


def check_endpoint_file(path: Path, st: os.stat_result, has_key: bool) -> None:
    """Refuse an endpoint file with a key that others could read, or that is not ours."""
    if not has_key:
        return
    if st.st_uid != os.getuid():
        raise UserError(
            f"endpoint file {path} holds an API key but belongs to uid {st.st_uid}, not you: use an endpoint file your own server job wrote"
        )
    if st.st_mode & 0o077:
        raise UserError(
            f"endpoint file {path} holds an API key and is readable by others "
            f"(mode {stat.S_IMODE(st.st_mode):04o}): run `chmod 600 {path}` and restart the server "
            f"job (its key may be known)"
        )


def parse_endpoint(text: str) -> dict | None:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return None
    if not data.get("base_url") and data.get("host") and data.get("port"):
        data["base_url"] = f"http://{data['host']}:{data['port']}/v1"
    return data if data.get("base_url") else None


def read_endpoint_file(path: Path) -> dict | None:
    """The endpoint record, or None while the file is missing or half-written (see ``check_endpoint_file``)."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            st = os.fstat(f.fileno())
            text = f.read()
    except OSError:
        return None
    data = parse_endpoint(text)
    if data is not None:
        check_endpoint_file(path, st, bool(data.get("api_key")))
    return data


class EndpointWatch:
    """The endpoint file's current record, re-read only when its inode, size or mtime change."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._sig: tuple[int, int, int] | None = None
        self._record: dict | None = None

    def current(self) -> dict | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return self._record  # between a job's end and the next one: the last one known
        sig = (st.st_ino, st.st_size, st.st_mtime_ns)
        if sig != self._sig:
            fresh = read_endpoint_file(self.path)
            if fresh is not None:  # a torn write: keep the old record, look again next time
                self._record, self._sig = fresh, sig
        return self._record

    def version(self) -> str | None:
        rec = self.current()
        v = rec.get("model_version") if rec else None
        return None if v is None else str(v)


def resolve_api_key(explicit: str | None = None, env_name: str | None = None, endpoint: dict | Endpoint | None = None) -> str:
    """The key to send: the endpoint file's, else the configured one, else ``$env_name``, else "EMPTY"."""
    from_file = endpoint.get("api_key") if isinstance(endpoint, dict) else getattr(endpoint, "api_key", None)
    return key_or_default(from_file or explicit, env_name)


def key_or_default(key: str | None, env_name: str | None = None) -> str:
    """``key``, else ``$env_name`` (default ``$OPENAI_API_KEY``), else "EMPTY"."""
    return key or os.environ.get(env_name or DEFAULT_KEY_ENV) or NO_KEY


def probe_models(base_url: str, timeout: float = 5.0, api_key: str | None = None) -> tuple[bool, str | None, str]:
    """``GET {base_url}/models``: (answered 200, first model id, what happened)."""
    key = key_or_default(api_key)
    try:
        req = urllib.request.Request(base_url.rstrip("/") + "/models", headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
            if r.status != 200:
                return False, None, f"HTTP {r.status}"
    except urllib.error.HTTPError as e:
        if e.code == 401:
            return False, None, "HTTP 401 (the server wants another API key: check policy.api_key / the endpoint file)"
        return False, None, f"HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return False, None, f"not reachable ({getattr(e, 'reason', e)})"
    except ValueError as e:  # not an http(s) URL, a bad port, ...
        return False, None, f"not a usable URL ({e})"
    try:
        data = json.loads(body).get("data") or []
        model = data[0].get("id") if data else None
    except (ValueError, AttributeError, IndexError):
        model = None
    return True, model, "HTTP 200"


def _describe_job(job_id: str | None) -> str:
    if not job_id:
        return ""
    state = slurm.job_state(job_id)
    if state is None:
        return f"; server job {job_id}"
    if state == "gone":
        return f"; server job {job_id} is no longer queued or running (see `sacct -j {job_id}` and its log)"
    if state == "PENDING":
        return f"; server job {job_id} is still PENDING in the queue (wait longer: raise the wait time)"
    return f"; server job {job_id} is {state}"


def resolve_endpoint(
    base_url: str | None,
    endpoint_file: Path | None,
    wait_s: float = 600.0,
    *,
    poll_s: float = 2.0,
    api_key: str | None = None,
    api_key_env: str | None = None,
) -> Endpoint:
    """Wait (at most ``wait_s``) until the server answers, and say where it is, what it serves and its key.

    The key is the endpoint file's when it has one, else ``api_key``, else ``$api_key_env``
    (default ``OPENAI_API_KEY``), else "EMPTY" (``resolve_api_key``).
    """
    if not base_url and endpoint_file is None:
        raise UserError("no policy server given: pass --base-url URL or --endpoint-file FILE (from slurm/vllm.sbatch)")
    deadline = time.monotonic() + wait_s
    record: dict | None = None
    last = "not tried"
    url = base_url.rstrip("/") if base_url else None
    while True:
        if not base_url and endpoint_file is not None:
            fresh = read_endpoint_file(Path(endpoint_file))  # re-read: a restarted job rewrites it
            if fresh is not None:
                record = fresh
                url = str(record["base_url"]).rstrip("/")
        if url is not None:
            key = resolve_api_key(api_key, api_key_env, record)
            ok, model, last = probe_models(url, timeout=max(1.0, min(10.0, poll_s * 2)), api_key=key)
            if ok:
                rec: dict[str, Any] = record or {}
                job, version = rec.get("job_id"), rec.get("model_version")
                return Endpoint(
                    base_url=url,
                    model=rec.get("model") or model,
                    job_id=None if job is None else str(job),
                    served_model=rec.get("served_model"),
                    model_version=None if version is None else str(version),
                    api_key=key,
                )
        if time.monotonic() + poll_s > deadline:
            break
        time.sleep(poll_s)

    job_id = str(record["job_id"]) if record and record.get("job_id") is not None else None
    if url is None:
        raise UserError(
            f"endpoint file {endpoint_file} did not appear within {wait_s:g} s; start the server with "
            f"`sbatch slurm/vllm.sbatch` (it writes that file), or pass --base-url, or wait longer"
        )
    where = f" (from {endpoint_file})" if endpoint_file is not None and record is not None else ""
    raise UserError(
        f"policy server {url}{where} did not answer GET /models within {wait_s:g} s: {last}"
        f"{_describe_job(job_id)}; check the server log, or start a new one with `sbatch slurm/vllm.sbatch`"
    )
