"""Stand-ins for a policy server: a ``vllm`` on PATH that starts the scripted server with vLLM's flags."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path


def vllm_shim(tmp_path: Path, script_json: dict, *, log_requests: bool = False) -> Path:
    """Stands in for 'vllm serve WEIGHTS --served-model-name NAME... --port P': same flags, same API
    (the scripted server takes the key from $VLLM_API_KEY, as vLLM does; it serves only the names
    given, and answers with the first, as vLLM does)."""
    script = tmp_path / "s.json"
    script.write_text(json.dumps(script_json))
    shim = tmp_path / "vllm"
    extra = " --log-requests" if log_requests else ""
    shim.write_text(f"""#!/bin/bash
weights=$2; names=(); port=""
while [ $# -gt 0 ]; do
  [ "$1" = --port ] && port=$2
  if [ "$1" = --served-model-name ]; then
    while [ $# -gt 1 ] && [ "${{2#--}}" = "$2" ]; do names+=("$2"); shift; done
  fi
  shift
done
[ ${{#names[@]}} -eq 0 ] && names=("$weights")
echo "shim serving $weights" >&2
exec {sys.executable} -m et_hpc.scripted_server --script {script} --port "$port" --model "${{names[-1]}}" \
  --served-model-name "${{names[@]}}"{extra}
""")
    shim.chmod(0o755)
    return shim


def wait_for(pred, proc: subprocess.Popen, what: str, tries: int = 600) -> None:
    """Poll ``pred`` every 0.1 s until it holds or ``proc`` ends; fail with its output or naming ``what``."""
    for _ in range(tries):
        if pred() or proc.poll() is not None:
            break
        time.sleep(0.1)
    assert pred(), proc.stdout.read() if proc.poll() is not None else f"timed out waiting for {what}"
