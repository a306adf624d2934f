"""Bad input, fuzzed: hundreds of malformed inputs, each ends in one clear line (exit 2) or an error record.

A seeded generator mutates real inputs (the fixture task folders, their defs and Dockerfiles,
task.json/task.toml, a SkyRL parquet file, run configs, endpoint files, chat-completion bodies)
by truncating, splicing junk bytes, dropping and duplicating lines and swapping value types, and
adds hand-picked nasty cases. Each input goes through the real entry point: ``et_hpc.cli.main``
in-process (stderr captured) for task folders, recipes, parquet rows and run configs, the endpoint
resolver for endpoint files, and the agent loop with the real OpenAI policy against a real local
HTTP server that replays the raw body for chat completions. Assertions: exit 0 or 2, on 2 exactly
one ``et-hpc: error:`` line per broken task and never a traceback; chat ends as ``policy_error``;
a run's run.json and store shard written before are byte-identical afterwards. A small sample
runs as a subprocess to check the real stderr. ``COUNTS`` at the end says how many of each kind.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from et_hpc.cli import main
from et_hpc.errors import UserError

SEED = int(os.environ.get("ET_HPC_FUZZ_SEED", "20260411"))
COUNTS: Counter = Counter()
JUNK = [
    "",
    "\x00",
    "\xff\xfe",
    "{",
    "}",
    "[",
    "]",
    '"',
    "'",
    "\\",
    "=",
    ":",
    "\n",
    "\t",
    "%",
    "%post",
    "%files",
    "Bootstrap:",
    "From:",
    "FROM",
    "RUN",
    "COPY",
    "WORKDIR",
    "USER",
    "ENV",
    "<<EOF",
    "EOF",
    "\u202e",
    "é",
    "💥",
    "null",
    "true",
    "-1",
    "1e309",
    "NaN",
    "9" * 40,
    "a" * 5000,
    "../../../etc/passwd",
    "$(reboot)",
    "`id`",
    "${HOME}",
    "~",
    "*",
    "?",
    "[x]",
]


def _mutate(rng: random.Random, text: str) -> str:
    """One to three random edits of ``text``."""
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(7)
        lines = text.splitlines(keepends=True)
        if op == 0 and text:
            text = text[: rng.randrange(len(text))]  # truncated
        elif op == 1:
            i = rng.randrange(len(text) + 1)
            text = text[:i] + rng.choice(JUNK) + text[i:]
        elif op == 2 and lines:
            del lines[rng.randrange(len(lines))]
            text = "".join(lines)
        elif op == 3 and lines:
            i = rng.randrange(len(lines))
            lines.insert(i, lines[i] * rng.randint(2, 4))
            text = "".join(lines)
        elif op == 4 and lines:
            lines[rng.randrange(len(lines))] = rng.choice(JUNK) + "\n"
            text = "".join(lines)
        elif op == 5:
            text = "".join(rng.sample(lines, len(lines))) if lines else rng.choice(JUNK)
        else:
            text = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))).decode("latin-1") + text
    return text


def _odd_value(rng: random.Random):
    return rng.choice(
        [
            None,
            0,
            -1,
            1.5,
            "",
            "x" * 300,
            [],
            [1, "a"],
            {},
            {"a": {"b": None}},
            True,
            "\x00",
            10**30,
            float("inf") if rng.random() < 0.1 else "inf",
        ]
    )


def _one_error_line(err: str) -> list[str]:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err, err
    assert all(ln.startswith("et-hpc: error:") for ln in lines), err
    return lines


def _cli(capsys, args: list[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        rc = main(args)
    except SystemExit as e:  # argparse: usage errors exit 2 with its own two lines
        rc = int(e.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def _copy(src: Path, dst: Path) -> Path:
    """A writable copy of a (read-only) fixture folder."""
    shutil.copytree(src, dst, copy_function=shutil.copyfile)
    for p in [dst, *dst.rglob("*")]:
        if p.is_dir() and not p.is_symlink():
            p.chmod(0o755)
    return dst


def _fixtures(fixtures_dir: Path) -> tuple[list[Path], list[Path]]:
    return sorted((fixtures_dir / "native").iterdir()), sorted((fixtures_dir / "harbor").iterdir())[:6]


# ---------------------------------------------------------------- task folders, defs, Dockerfiles, task.json/toml
def _check_task_source(capsys, folder: Path) -> None:
    rc, out, err = _cli(capsys, ["tasks", "list", str(folder), "--validate", "--json"])
    assert rc in (0, 2), (rc, err)
    lines = _one_error_line(err)
    if rc == 2:
        assert len(lines) == 1, err  # one task folder: one line naming it
        assert str(folder) in lines[0] or folder.name in lines[0], lines[0]
    else:  # loaded (the edit left it valid), or nothing there to load: an emptied folder
        assert not lines and (json.loads(out)["tasks"] or not any(folder.rglob("*"))), (out, err)


KINDS = {
    "native task.json": ("native", "task.json"),
    "def": ("native", "container.def"),
    "harbor task.toml": ("harbor", "task.toml"),
    "harbor environment/task.json": ("harbor", "environment/task.json"),
    "Dockerfile": ("harbor", "environment/Dockerfile"),
    "instruction.md": ("harbor", "instruction.md"),
}


@pytest.mark.parametrize(
    "kind,n",
    [
        ("native task.json", 40),
        ("def", 60),
        ("harbor task.toml", 40),
        ("harbor environment/task.json", 20),
        ("Dockerfile", 60),
        ("instruction.md", 10),
    ],
)
def test_fuzz_task_files(tmp_path: Path, capsys, fixtures_dir: Path, monkeypatch, kind: str, n: int) -> None:
    monkeypatch.setenv("ET_HPC_CACHE", str(tmp_path / "cache"))
    native, harbor = _fixtures(fixtures_dir)
    layout, rel = KINDS[kind]
    rng = random.Random(f"{SEED}-{kind}")
    for i in range(n):
        src = rng.choice(native if layout == "native" else harbor)
        d = _copy(src, tmp_path / f"case{i}" / src.name)
        f = d / rel
        if rng.random() < 0.1:  # a directory, an unreadable file, or nothing where the file should be
            choice = rng.randrange(3)
            f.unlink()
            if choice == 0:
                f.mkdir()
            elif choice == 1:
                f.write_text("x")
                f.chmod(0)
        elif kind.endswith("task.json") and rng.random() < 0.4:
            data = json.loads(f.read_text())
            data[rng.choice(list(data) + ["description", "truth", "name"])] = _odd_value(rng)
            f.write_text(json.dumps(data, default=str))
        else:
            f.write_bytes(_mutate(rng, f.read_text()).encode("utf-8", "surrogateescape"))
        _check_task_source(capsys, d)
        COUNTS[kind] += 1


def test_fuzz_task_folders(tmp_path: Path, capsys, fixtures_dir: Path, monkeypatch) -> None:
    """Whole folders: files removed, renamed, mixed layouts, symlink loops, empty folders."""
    monkeypatch.setenv("ET_HPC_CACHE", str(tmp_path / "cache"))
    native, harbor = _fixtures(fixtures_dir)
    rng = random.Random(f"{SEED}-folders")
    for i in range(40):
        src = rng.choice(native + harbor)
        d = _copy(src, tmp_path / f"f{i}" / src.name)
        files = sorted(p for p in d.rglob("*") if p.is_file())
        for _ in range(rng.randint(1, 3)):
            op = rng.randrange(5)
            if op == 0 and files:
                rng.choice(files).unlink(missing_ok=True)
            elif op == 1:
                target = d / rng.choice(["task.json", "container.def", "instruction.md", "task.toml"])
                target.unlink(missing_ok=True)
                target.write_text(_mutate(rng, ""))
            elif op == 2:
                link = d / rng.choice(["container.def", "environment/Dockerfile", "task.json"])
                link.parent.mkdir(exist_ok=True)
                link.unlink(missing_ok=True)
                link.symlink_to(link)  # a loop
            elif op == 3:
                for p in list(d.iterdir()):
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
            else:
                (d / "container.sif").write_text("")  # an empty prebuilt image
        _check_task_source(capsys, d)
        COUNTS["task folder"] += 1


# ---------------------------------------------------------------- parquet rows
def test_fuzz_parquet_rows(tmp_path: Path, capsys, fixtures_dir: Path) -> None:
    base = pq.read_table(fixtures_dir / "skyrl" / "train.parquet").to_pylist()
    tasks_dir = fixtures_dir / "native"
    rng = random.Random(f"{SEED}-parquet")
    for i in range(50):
        rows = [dict(r) for r in rng.sample(base, min(len(base), rng.randint(1, 3)))]
        for r in rows:
            for _ in range(rng.randint(1, 3)):
                key = rng.choice(list(r) + ["task_dir", "extra_info", "reward_spec", "prompt"])
                r[key] = _odd_value(rng) if rng.random() < 0.7 else json.dumps(_odd_value(rng))
        f = tmp_path / f"p{i}" / "train.parquet"
        f.parent.mkdir()
        try:
            table = pa.Table.from_pylist(
                [
                    {k: json.dumps(v, default=str) if isinstance(v, (dict, list)) and rng.random() < 0.5 else v for k, v in r.items()}
                    for r in rows
                ]
            )
            pq.write_table(table, f)
        except (pa.ArrowException, OverflowError, TypeError):  # rows pyarrow itself cannot write
            f.write_bytes(b"PAR1" + bytes(rng.randrange(256) for _ in range(100)))
        if rng.random() < 0.15:
            f.write_bytes(f.read_bytes()[: rng.randrange(1, 200)])  # truncated file
        rc, out, err = _cli(capsys, ["tasks", "list", str(f), "--tasks-dir", str(tasks_dir), "--json"])
        assert rc in (0, 2), (rc, err)
        lines = _one_error_line(err)
        if rc == 0:
            assert not lines
        COUNTS["parquet rows"] += 1


# ---------------------------------------------------------------- run configs (and nothing written is lost)
VALID_CONFIG = {
    "name": "fz",
    "samples": 2,
    "tasks": {"source": "x", "ids": ["a"]},
    "policy": {"kind": "oracle"},
    "budgets": {"max_turns": 4, "wall_time_s": 30},
    "executor": "slurm",
    "concurrency": 2,
    "slurm": {"partition": "cpu", "units_per_task": 4, "setup": ["module load apptainer"], "time_min": 5},
}
BAD_VALUES = [-1, 0, "", "abc", [], {}, [[]], {"x": 1}, "1e999", None, 10**20, "nan"]


def _bad_config(rng: random.Random) -> str:
    """A run config that is certainly invalid (a wrong type or value, an unknown key, or broken YAML)."""
    import yaml

    data = json.loads(json.dumps(VALID_CONFIG))
    op = rng.randrange(5)
    if op == 0:  # unknown key somewhere
        sect = rng.choice([data, data["tasks"], data["policy"], data["budgets"], data["slurm"]])
        sect[rng.choice(["partiton", "smaples", "kindd", "x", "", "0", "policy.kind"])] = 1
    elif op == 1:  # a number field gets something that is no valid number for it
        sect, key = rng.choice(
            [
                (data, "samples"),
                (data, "concurrency"),
                (data["slurm"], "units_per_task"),
                (data["slurm"], "time_min"),
                (data["budgets"], "max_turns"),
                (data["slurm"], "cpus_per_task"),
                (data["slurm"], "array_parallelism"),
            ]
        )
        sect[key] = rng.choice([-1, 0, "abc", [], {}, "1e999", [[1]], {"a": 1}])
    elif op == 2:  # a section that is not a mapping, or an enum outside its values
        choice = rng.randrange(4)
        if choice == 0:
            data[rng.choice(["tasks", "policy", "budgets", "slurm", "sandbox"])] = rng.choice(["x", 3, [1], True])
        elif choice == 1:
            data["executor"] = rng.choice(["cloud", "", 1, ["local"], "LOCAL"])
        elif choice == 2:
            data["name"] = rng.choice(["a b", "../x", "", "x/y", "ü", "a\nb"])
        else:
            data["sandbox"] = {"network": rng.choice(["all", 1, "", None, "bridge"])}
    elif op == 3:  # the top level is not a mapping
        return yaml.safe_dump(rng.choice([[1, 2], "just text", 42, [VALID_CONFIG]]))
    else:  # broken YAML
        text = yaml.safe_dump(data)
        i = rng.randrange(len(text))
        return text[:i] + rng.choice(["\t", ": : :", "[", "{", '"', "&a *b", "!!python/object:os.system"]) + text[i:]
    return yaml.safe_dump(data, allow_unicode=True)


def _digest(paths: list[Path]) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def _seed_run(store: Path) -> list[Path]:
    """A run already on disk: its run.json and one shard, as an earlier `et-hpc run` left them."""
    from et_hpc.record import EpisodeRecord
    from et_hpc.runs.store import RunStore

    run = RunStore(store / "fz")
    run.path.mkdir(parents=True)
    (run.path / "run.json").write_text(json.dumps({"name": "fz", "config": VALID_CONFIG, "plan": {"units_total": 2}}))
    shard = run.write([EpisodeRecord(run_name="fz", task_id="a", sample=0, status="ok", reward=1.0)])
    return [run.path / "run.json", shard]


def test_fuzz_run_configs(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("ET_HPC_STORE", str(tmp_path / "store"))
    kept = _seed_run(tmp_path / "store")
    before = _digest(kept)
    rng = random.Random(f"{SEED}-config")
    for i in range(60):
        y = tmp_path / f"c{i}.yaml"
        y.write_text(_bad_config(rng), encoding="utf-8")
        extra = (
            []
            if rng.random() < 0.7
            else ["--set", rng.choice(["samples", "=1", "slurm.x.y=1", "tasks=3", "samples=-3", "policy.kind.x=1"])]
        )
        rc, out, err = _cli(capsys, ["run", "--config", str(y), "--store", str(tmp_path / "store"), *extra])
        assert rc == 2, (y.read_text(), err)
        assert len(_one_error_line(err)) == 1, err
        COUNTS["run config"] += 1
    assert _digest(kept) == before  # nothing already written was touched
    assert sorted(p.name for p in (tmp_path / "store" / "fz").iterdir()) == sorted(p.name for p in kept)


def test_fuzz_sample_as_subprocess(tmp_path: Path, fixtures_dir: Path) -> None:
    """The real stderr of the real command: one line, exit 2 (no log noise, no traceback)."""
    rng = random.Random(f"{SEED}-sub")
    env = dict(os.environ, ET_HPC_STORE=str(tmp_path / "store"), ET_HPC_CACHE=str(tmp_path / "cache"))
    kept = _seed_run(tmp_path / "store")
    before = _digest(kept)
    src = next(iter(_fixtures(fixtures_dir)[1]))
    for i in range(8):
        y = tmp_path / f"c{i}.yaml"
        y.write_text(_bad_config(rng))
        d = _copy(src, tmp_path / f"t{i}" / src.name)
        (d / "environment" / "Dockerfile").write_text(rng.choice(["", "FROM\n", "RUN echo hi\n", "FROM a b c d\n"]))
        for args in (["run", "--config", str(y)], ["tasks", "list", str(d), "--validate", "--json"]):
            r = subprocess.run([sys.executable, "-m", "et_hpc.cli", *args], env=env, capture_output=True, text=True, timeout=120)
            assert r.returncode == 2, (args, r.stderr)
            assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("et-hpc: error:"), r.stderr
            COUNTS["subprocess sample"] += 1
    assert _digest(kept) == before


# ---------------------------------------------------------------- endpoint files
def _bad_endpoint(rng: random.Random, dead_url: str) -> str:
    good = {
        "host": "127.0.0.1",
        "port": 1,
        "base_url": dead_url,
        "model": "m",
        "job_id": "123",
        "model_version": "v1",
        "started_at": "2026-01-01T00:00:00Z",
    }
    op = rng.randrange(4)
    if op == 0:
        return _mutate(rng, json.dumps(good))
    if op == 1:
        good[rng.choice(list(good))] = _odd_value(rng)
        return json.dumps(good, default=str)
    if op == 2:
        return json.dumps(
            rng.choice(
                [
                    [],
                    [good],
                    "x",
                    1,
                    None,
                    {"base_url": ""},
                    {"host": "h"},
                    {"port": 5},
                    {"host": [], "port": {}},
                    {"base_url": "not a url"},
                    {"base_url": "http://[::1"},
                    {"base_url": "ftp://x/v1"},
                    {"base_url": "http://127.0.0.1:99999/v1"},
                ]
            )
        )
    return rng.choice(["", "\x00\x00", "{" * 5000, "\ufeff{}", "null"])


def test_fuzz_endpoint_files(tmp_path: Path) -> None:
    from et_hpc.agent.endpoint import EndpointWatch, read_endpoint_file, resolve_endpoint

    rng = random.Random(f"{SEED}-endpoint")
    dead = "http://127.0.0.1:9/v1"  # discard port: nothing answers
    for i in range(40):
        f = tmp_path / f"ep{i}.json"
        f.write_text(_bad_endpoint(rng, dead), encoding="utf-8", errors="surrogateescape")
        f.chmod(0o600)
        try:
            read_endpoint_file(f)
            EndpointWatch(f).version()
            resolve_endpoint(None, f, wait_s=0.2, poll_s=0.1)
        except UserError as e:
            assert "\n" not in str(e) and str(e), repr(e)
        else:
            pytest.fail(f"{f.read_text()[:200]!r}: a dead or malformed endpoint was accepted")
        COUNTS["endpoint file"] += 1


# ---------------------------------------------------------------- chat-completion responses
class _Replay(BaseHTTPRequestHandler):
    """Answers GET /v1/models properly and every POST with the raw body (and status) it is given."""

    body: bytes = b""
    status = 200
    ctype = "application/json"

    def log_message(self, *a) -> None:
        pass

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        self._send(200, json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode(), "application/json")

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        srv = self.server
        if self.path.endswith("/tokenize"):
            self._send(404, b"{}", "application/json")
            return
        self._send(srv.status, srv.body, srv.ctype)  # type: ignore[attr-defined]


def _bad_bodies(rng: random.Random) -> list[tuple[int, bytes, str]]:
    good = {
        "id": "c1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "t", "type": "function", "function": {"name": "terminal", "arguments": '{"command": "ls"}'}}],
                },
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    fixed = [
        b"",
        b"null",
        b"[]",
        b"{}",
        b"not json",
        b"<html>502 Bad Gateway</html>",
        b'{"choices": []}',
        b'{"choices": null}',
        b'{"choices": [null]}',
        b'{"choices": [{}]}',
        b'{"choices": 5}',
        b'{"choices": [{"message": null}]}',
        b'{"choices": [{"message": 7}]}',
        b'{"choices": [{"message": {"tool_calls": 3}}]}',
        b'{"choices": [{"message": {"tool_calls": [7]}}]}',
        b'{"choices": [{"message": {"tool_calls": [{"function": 1}]}}]}',
        b'{"choices": [{"message": {"content": {"a": 1}}}]}',
        b'{"choices": [{"message": {"content": "x"}, "logprobs": {"content": [1]}}]}',
        b'{"choices": [{"message": {"content": "x"}}], "usage": 7}',
        b"\xff\xfe\x00garbage",
        b"{" * 3000,
    ]
    out = [(200, b, "application/json") for b in fixed]
    out += [(200, b'{"choices": [', "text/html"), (200, json.dumps(good).encode()[:-40], "application/json")]
    for _ in range(14):
        text = json.dumps(good)
        if rng.random() < 0.5:  # broken JSON: mutated, and cut before its last brace if it still parses
            text = _mutate(rng, text)
            try:
                json.loads(text)
                text = text[: text.rfind("}")] if "}" in text else text + "{"
            except ValueError:
                pass
        else:  # valid JSON with a part the client needs of the wrong type
            d = json.loads(text)
            choice, msg = d["choices"][0], d["choices"][0]["message"]
            where, key, values = rng.choice(
                [
                    (d, "choices", [None, 5, "x", {}, [None], True, [[]]]),
                    (choice, "message", [None, 5, "x", [], True]),
                    (msg, "tool_calls", [5, "x", {}, [None], [5], True, [{"function": None}]]),
                    (msg, "content", [5, [], {}, True, 1.5]),
                ]
            )
            where[key] = rng.choice(values)
            text = json.dumps(d)
        out.append((200, text.encode("utf-8", "surrogateescape"), "application/json"))
    return out


class _NoShell:
    """The agent loop's shell for these cases: the policy fails before any command may run."""

    def __init__(self) -> None:
        self.commands: list[str] = []

    def run(self, command: str, timeout: float = 60.0):
        self.commands.append(command)
        r = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=timeout)
        from types import SimpleNamespace

        return SimpleNamespace(output=r.stdout + r.stderr, exit_code=r.returncode, timed_out=False)


def test_fuzz_chat_completion_bodies() -> None:
    from et_hpc.agent.loop import BudgetConfig, run_agent
    from et_hpc.agent.openai_policy import OpenAIPolicy

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Replay)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    rng = random.Random(f"{SEED}-chat")
    statuses: Counter = Counter()
    try:
        for status, body, ctype in _bad_bodies(rng):
            httpd.body, httpd.status, httpd.ctype = body, status, ctype  # type: ignore[attr-defined]
            policy = OpenAIPolicy(
                url, "m", max_retries=1, retry_budget_s=5, backoff_base_s=0, backoff_max_s=0, request_timeout_s=10, sleep=lambda s: None
            )
            shell = _NoShell()
            try:
                res = run_agent("list the files", shell, policy, BudgetConfig(max_turns=2, wall_time_s=30))
            finally:
                policy.close()
            statuses[res.status] += 1
            assert res.status == "policy_error", (body[:200], res.status, res.stop_reason)
            assert res.error and "\n" not in res.error.strip(), res.error
            COUNTS["chat-completion body"] += 1
    finally:
        httpd.shutdown()
    assert statuses == {"policy_error": len(_bad_bodies(random.Random(f"{SEED}-chat")))}


def test_zz_counts() -> None:
    """At least 300 malformed inputs across the kinds (runs last in this file)."""
    total = sum(COUNTS.values())
    print("fuzz counts:", dict(COUNTS), "total", total)
    if total == 0:
        pytest.skip("run the whole file to count")
    assert total >= 300, COUNTS
