"""Real runs for the viewer and ATIF tests, made once per session.

- ``oracle``: ``et-hpc run defs/demo --policy oracle --samples 2`` (real sandboxes, real scoring);
- ``hostile``: one tool-calling episode against the scripted server (logprobs and token ids
  recorded) whose model text, reasoning and command output carry HTML and script, ANSI escapes and
  bytes that are not UTF-8, then solve the task; plus one record written through the store API whose
  output is a 1 MB line (the shell keeps only 50,000 characters of a command's output, so a real
  run cannot hold one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers.demo import DEMO, KEY, SOLVE, TASK

ET_HPC = [sys.executable, "-m", "et_hpc.cli"]
# each payload sets a marker the browser test looks for; inserted as HTML they would run
PAYLOAD_SCRIPT = "<script>window.__etv_pwned = 'script'; document.title = 'pwned';</script>"
PAYLOAD_IMG = "<img src=x onerror=\"window.__etv_pwned = 'img'; document.title = 'pwned'\">"
PAYLOAD = PAYLOAD_SCRIPT + PAYLOAD_IMG
ANSI = "\x1b[31mRED\x1b[0m"
BIG_LINE = 1024 * 1024


PLAIN_KEY = "sales.csv"  # demo_csv_sum's prompt: an episode whose token ids are exact (no reasoning)


def hostile_script() -> dict:
    """The scripted server's replies: the hostile episode (demo_hello_file; its first tool call's
    arguments are compact JSON, which the chat template re-serialises in later prompts, so its ids
    drift) and a plain one (demo_csv_sum)."""
    echo = PAYLOAD.replace("'", "'\\''")
    first = json.dumps({"command": f"printf '%s\\n' '{echo}'"}, separators=(",", ":"))
    return {
        KEY: [
            {"tool_calls": [{"name": "terminal", "arguments": first}], "reasoning": "Let me try " + PAYLOAD_SCRIPT},
            {"command": "printf '\\033[31mRED\\033[0m and bytes \\377\\376 end\\n'; exit_code_test=1; false"},
            {"command": SOLVE, "content": "Writing the file now. " + PAYLOAD_IMG},
            "All done. " + PAYLOAD,
        ],
        PLAIN_KEY: [{"command": "head -n 3 /home/user/data/sales.csv"}, "Done."],
    }


def make_runs(root: Path, base_url: str) -> dict[str, Path]:
    store = root / "store"
    env = os.environ.copy()
    common = ["--store", str(store), "--concurrency", "2", "--json"]
    r = subprocess.run(
        ET_HPC + ["run", str(DEMO), "--policy", "oracle", "--samples", "2", "--run-name", "oracle", *common],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=root,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run(
        ET_HPC
        + [
            "run",
            str(DEMO),
            "--set",
            f"tasks.ids=[{TASK},demo_csv_sum]",
            "--run-name",
            "hostile",
            *common,
            "--set",
            "policy.kind=openai",
            "--set",
            f"policy.base_url={base_url}",
            "--set",
            "policy.mode=tools",
            "--set",
            "policy.logprobs=true",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=root,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    from et_hpc.record import EpisodeRecord
    from et_hpc.runs.store import RunStore

    big = "B" * BIG_LINE
    rec = EpisodeRecord(
        run_name="hostile",
        task_id="big_output",
        sample=0,
        status="ok",
        reward=0.0,
        passed=0,
        total=1,
        turns=1,
        stop_reason="done",
        policy_kind="text",
        score_note="the agent printed a 1 MB line",
        messages=[
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "print a lot"},
            {
                "role": "assistant",
                "content": "<command>yes B | head -c 1048576</command>",
                "reasoning_content": "I will print <b>a lot</b>",
            },
            {"role": "user", "content": f"Command executed successfully. Output: {ANSI} {big}\n\n(exit_code=0)"},
            {"role": "assistant", "content": "<action>done</action>"},
        ],
        tests=[{"name": "test_final_state::test_big", "outcome": "failed"}],
        events=[f"ansi {ANSI} in an event", PAYLOAD],
    )
    RunStore(store / "hostile").write([rec])
    return {"oracle": store / "oracle", "hostile": store / "hostile"}
