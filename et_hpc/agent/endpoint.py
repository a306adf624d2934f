"""Find the policy server: a given base URL, or the endpoint file a vLLM Slurm job writes.

The endpoint file (JSON on the shared filesystem, written by ``slurm/vllm.sbatch`` or
``python -m et_hpc.scripted_server --endpoint-file``) holds
``{"host", "port", "model", "job_id", "base_url", "started_at"}``. ``resolve_endpoint`` waits,
bounded, for the file and for ``GET {base_url}/models`` to answer 200, and on give-up raises a
``UserError`` that names the file, the job and what Slurm says about it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from pydantic import BaseModel

from et_hpc.errors import UserError

log = logging.getLogger(__name__)


class Endpoint(BaseModel):
    base_url: str
    model: str | None = None
    job_id: str | None = None


def endpoint_record(host: str, port: int, model: str | None, job_id: str | None = None) -> dict:
    """The endpoint file's content, as every writer must produce it."""
    return {
        "host": host,
        "port": int(port),
        "model": model,
        "job_id": job_id,
        "base_url": f"http://{host}:{int(port)}/v1",
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _read_file(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    if not data.get("base_url") and data.get("host") and data.get("port"):
        data["base_url"] = f"http://{data['host']}:{data['port']}/v1"
    return data if data.get("base_url") else None


def probe_models(base_url: str, timeout: float = 5.0) -> tuple[bool, str | None, str]:
    """``GET {base_url}/models``: (answered 200, first model id, what happened)."""
    key = os.environ.get("OPENAI_API_KEY") or "EMPTY"
    req = urllib.request.Request(base_url.rstrip("/") + "/models", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
            if r.status != 200:
                return False, None, f"HTTP {r.status}"
    except urllib.error.HTTPError as e:
        return False, None, f"HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return False, None, f"not reachable ({getattr(e, 'reason', e)})"
    try:
        data = json.loads(body).get("data") or []
        model = data[0].get("id") if data else None
    except (ValueError, AttributeError, IndexError):
        model = None
    return True, model, "HTTP 200"


def slurm_job_state(job_id: str | None) -> str | None:
    """The job's state from ``squeue`` ("PENDING", "RUNNING", ...), "gone", or None without Slurm."""
    if not job_id or not shutil.which("squeue"):
        return None
    try:
        r = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], capture_output=True,
                           text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return None
    state = r.stdout.strip()
    if r.returncode == 0 and state:
        return state.splitlines()[0]
    return "gone"


def _describe_job(job_id: str | None) -> str:
    if not job_id:
        return ""
    state = slurm_job_state(job_id)
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
) -> Endpoint:
    """Wait (at most ``wait_s``) until the server answers, and say where it is and what it serves."""
    if not base_url and endpoint_file is None:
        raise UserError("no policy server given: pass --base-url URL or --endpoint-file FILE (from slurm/vllm.sbatch)")
    deadline = time.monotonic() + wait_s
    record: dict | None = None
    last = "not tried"
    url = base_url.rstrip("/") if base_url else None
    while True:
        if not base_url and endpoint_file is not None:
            fresh = _read_file(Path(endpoint_file))  # re-read: a restarted job rewrites it
            if fresh is not None:
                record = fresh
                url = str(record["base_url"]).rstrip("/")
        if url is not None:
            ok, model, last = probe_models(url, timeout=max(1.0, min(10.0, poll_s * 2)))
            if ok:
                rec_model = record.get("model") if record else None
                job = record.get("job_id") if record else None
                return Endpoint(base_url=url, model=rec_model or model,
                                job_id=None if job is None else str(job))
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
