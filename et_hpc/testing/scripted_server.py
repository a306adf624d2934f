"""A scripted OpenAI-compatible chat server (vLLM's response shape) for tests and dry runs.

On 127.0.0.1 unless told otherwise (``host``). A script maps a substring of the first user message to the replies served
turn by turn (text, a tool call, or a fault to inject); token ids, ``usage``, logprobs and
``/tokenize`` behave like vLLM's, with ``et_hpc.testing.scripted_tokenizer``'s template. Options
mimic an older vLLM, no ``/tokenize``, an API key, served model names, an endpoint file. Usage::

    with ScriptedServer({"create": [{"command": "echo hi > f"}, "all done"]}) as srv:
        OpenAI(base_url=srv.base_url, api_key="x")...

Specification (script format, faults, token fields, options): docs/testing-doubles.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from et_hpc.testing import scripted_tokenizer as tk
from et_hpc.testing.scripted_tokenizer import logprob_of  # noqa: F401 - its name here for callers

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
DONE_REPLY = "<action>done</action>"
ATTEMPT_FAULTS = {500, 429, "timeout", "empty_choices", "context_length"}
REPLY_FAULTS = {"malformed_tool_json"}


def load_script(source: dict | str | Path) -> dict[str, list]:
    """A script from a dict, or a JSON/YAML file; raises ``UserError`` naming the file."""
    from et_hpc.errors import UserError

    if isinstance(source, dict):
        data, where = source, "script"
    else:
        path = Path(source)
        where = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise UserError(f"cannot read script {path}: {e.strerror}") from None
        try:
            if path.suffix in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(text)
            else:
                data = json.loads(text)
        except Exception as e:
            raise UserError(f"script {path} does not parse: {e}".splitlines()[0]) from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, list) for k, v in data.items()):
        raise UserError(f"{where}: a script maps a substring of the first user message to a list of replies")
    for key, replies in data.items():
        for i, r in enumerate(replies):
            ok = isinstance(r, str) or (isinstance(r, dict) and ("fault" in r or "command" in r or "content" in r or "tool_calls" in r))
            if isinstance(r, dict) and "fault" in r and r["fault"] not in ATTEMPT_FAULTS | REPLY_FAULTS:
                ok = False
            if not ok:
                raise UserError(
                    f"{where}: reply {i} of {key!r} is not text, {{command}}, {{tool_calls}} or a known "
                    f"{{fault}} ({sorted(map(str, ATTEMPT_FAULTS | REPLY_FAULTS))})"
                )
    return data


def _split_turns(replies: list) -> list[tuple[list[dict], Any]]:
    """Group attempt faults with the reply that follows them: [(faults, reply_or_None), ...]."""
    turns: list[tuple[list[dict], Any]] = []
    pending: list[dict] = []
    for r in replies:
        if isinstance(r, dict) and r.get("fault") in ATTEMPT_FAULTS:
            pending.append(r)
        else:
            turns.append((pending, r))
            pending = []
    if pending:
        turns.append((pending, None))
    return turns


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as two writes

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s " + fmt, self.address_string(), *args)

    def _send(self, code: int, body: dict | list | None, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (e.g. its timeout)

    def _error(self, code: int, msg: str, kind: str, headers: dict[str, str] | None = None) -> None:
        self._send(code, {"error": {"message": msg, "type": kind, "param": None, "code": code}}, headers)

    def _refused(self, path: str) -> bool:
        key = self.server.owner.api_key
        if key and path.startswith(("/v1", "/admin")) and self.headers.get("Authorization") != f"Bearer {key}":
            self.server.owner._count("401")
            self._send(401, {"error": "Unauthorized"})
            return True
        return False

    def do_GET(self) -> None:  # noqa: N802
        srv = self.server.owner
        srv._count("GET " + self.path)
        path = self.path.split("?")[0].rstrip("/")
        if self._refused(path):
            return
        if path in ("/v1/models", "/models"):
            self._send(
                200,
                {
                    "object": "list",
                    "data": [
                        {
                            "id": name,
                            "object": "model",
                            "created": int(srv.started),
                            "owned_by": "et-hpc",
                            "max_model_len": srv.max_model_len,
                        }
                        for name in (srv.served_names or [srv.model])
                    ],
                },
            )
        elif path in ("/health", "/v1/health"):
            self._send(200, {})
        else:
            self._error(404, f"no route GET {self.path}", "NotFoundError")

    def do_POST(self) -> None:  # noqa: N802
        srv = self.server.owner
        srv._count("POST " + self.path)
        path = self.path.split("?")[0].rstrip("/")
        try:
            n = int(self.headers.get("Content-Length") or 0)
            req = json.loads(self.rfile.read(n) or b"{}")
        except (ValueError, OSError):
            self._error(400, "request body is not JSON", "BadRequestError")
            return
        if self._refused(path):
            return
        if path in ("/tokenize", "/v1/tokenize", "/detokenize", "/v1/detokenize") and srv.tokenize_endpoint:
            srv._tokenize(self, req, path.endswith("/detokenize"))
            return
        if path == "/admin/serve" and isinstance(req.get("names"), list) and req["names"]:
            srv.serve([str(n) for n in req["names"]])
            self._send(200, {"names": srv.served_names})
            return
        if srv.on_request is not None and "completions" in path:
            srv.on_request(req)
        if "completions" in path and srv.served_names and req.get("model") not in srv.served_names:
            self._error(404, f"The model `{req.get('model')}` does not exist.", "NotFoundError")
            return
        if path in ("/v1/completions", "/completions"):
            srv._completions(self, req)
            return
        if path not in ("/v1/chat/completions", "/chat/completions"):
            self._error(404, f"no route POST {self.path}", "NotFoundError")
            return
        srv._chat(self, req)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    owner: ScriptedServer


class ScriptedServer:
    """The server; use as a context manager or ``start()``/``stop()``. ``base_url`` ends in /v1."""

    def __init__(
        self,
        script: dict | str | Path,
        *,
        port: int = 0,
        model: str = "scripted",
        max_model_len: int = 32768,
        timeout_sleep_s: float = 30.0,
        return_token_ids: bool = True,
        tokenize_endpoint: bool = True,
        api_key: str | None = None,
        served_names: list[str] | None = None,
        host: str = HOST,
    ):
        self.served_names = list(served_names) if served_names else None  # None: any name, echoed
        self.on_request: Any = None  # called with each chat/completion request before it is checked
        self.api_key = api_key  # like vllm serve --api-key: /v1/* answer 401 without "Bearer KEY"
        self.log_requests = False  # print "served chat turn=N" on stdout with each reply, before it is sent
        self.script = {k: _split_turns(v) for k, v in load_script(script).items()}
        self.model = model
        self.max_model_len = max_model_len
        self.timeout_sleep_s = timeout_sleep_s
        self.return_token_ids = return_token_ids  # False: like vLLM < 0.10.2 (fields absent)
        self.tokenize_endpoint = tokenize_endpoint  # False: no /tokenize, /detokenize
        self.started = time.time()
        self.requests: dict[str, int] = {}  # "POST /v1/chat/completions" -> count
        self.log: list[dict[str, Any]] = []  # one entry per chat request: key, turn, attempt, served, seed
        self._attempts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.address = socket.gethostname() if host in ("0.0.0.0", "") else host  # "0.0.0.0": named by its hostname
        self._httpd = _HTTPServer((host, port), _Handler)
        self._httpd.owner = self
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def base_url(self) -> str:
        return f"http://{self.address}:{self.port}/v1"

    @property
    def chat_requests(self) -> int:
        return sum(v for k, v in self.requests.items() if k.startswith("POST") and "chat/completions" in k)

    def start(self) -> ScriptedServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="scripted-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> ScriptedServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def serve(self, names: list[str]) -> None:
        """Serve these names from now on (the first is the one answers name)."""
        self.served_names = list(names)

    def write_endpoint_file(
        self, path: Path, job_id: str | None = None, model_version: str | None = None, served_model: str | None = None
    ) -> dict:
        """Write the same endpoint file as ``slurm/vllm.sbatch`` (mode 0600, with the key)."""
        from et_hpc.agent.endpoint import endpoint_record, write_endpoint_file

        rec = endpoint_record(
            self.address, self.port, self.model, job_id, api_key=self.api_key, model_version=model_version, served_model=served_model
        )
        write_endpoint_file(Path(path), rec)
        return rec

    # -- serving -----------------------------------------------------------------------------
    def _count(self, what: str) -> None:
        with self._lock:
            self.requests[what] = self.requests.get(what, 0) + 1

    def _chat(self, h: _Handler, req: dict) -> None:
        messages = req.get("messages") or []
        first_user = next((str(m.get("content") or "") for m in messages if m.get("role") == "user"), "")
        key = next((k for k in self.script if k in first_user), None)
        turn = sum(1 for m in messages if m.get("role") == "assistant")
        digest = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()
        with self._lock:
            attempt = self._attempts.get(digest, 0)
            self._attempts[digest] = attempt + 1
        entry: dict[str, Any] = {"key": key, "turn": turn, "attempt": attempt, "seed": req.get("seed")}
        with self._lock:
            self.log.append(entry)
        if key is None:
            entry["served"] = "no_match"
            h._error(400, "scripted server: no script entry matches the first user message", "BadRequestError")
            return
        try:
            prompt_ids = tk.encode_chat(
                messages, req.get("tools") or None, add_generation_prompt=bool(req.get("add_generation_prompt", True))
            )
        except (AttributeError, TypeError, ValueError) as e:
            entry["served"] = "bad_messages"
            h._error(400, f"scripted server: cannot render the messages: {e}", "BadRequestError")
            return
        prompt_tokens = len(prompt_ids)
        if prompt_tokens >= self.max_model_len:
            entry["served"] = "context_length"
            self._context_error(h, prompt_tokens, req)
            return
        turns = self.script[key]
        faults, reply = turns[turn] if turn < len(turns) else ([], DONE_REPLY)
        if attempt < len(faults) or (reply is None and faults):
            fault = faults[min(attempt, len(faults) - 1)]
            entry["served"] = f"fault:{fault['fault']}"
            self._fault(h, fault, prompt_tokens, req)
            return
        entry["served"] = "reply"
        body = self._completion(reply, req, prompt_ids)
        if self.log_requests:  # before the answer: a client that got it finds the line already there
            print(f"served chat turn={turn}", flush=True)
        h._send(200, body)

    def _completions(self, h: _Handler, req: dict) -> None:
        """vLLM's ``/v1/completions`` with a token-id ``prompt`` (the token-in mode): the prompt is decoded,
        the script entry is the one whose key is in the first user turn, the turn is the number of
        assistant headers before the final one. The reply is the text the model generates
        (``generation_text``), its ids in ``choices[0].token_ids`` ending with ``<|im_end|>``."""
        prompt = req.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = [int(t) for t in prompt]
        elif isinstance(prompt, str):
            ids = tk.encode(prompt)
        else:
            h._error(400, "prompt must be a string or a list of token ids", "BadRequestError")
            return
        text = tk.decode(ids)
        head = "<|im_start|>user\n"
        first_user = text[text.find(head) + len(head) :].split(tk.EOS, 1)[0] if head in text else ""
        key = next((k for k in self.script if k in first_user), None)
        turn = max(text.count("<|im_start|>assistant") - 1, 0)
        with self._lock:
            self.log.append({"key": key, "turn": turn, "attempt": 0, "served": "completion", "seed": req.get("seed")})
        if key is None:
            h._error(400, "scripted server: no script entry matches the first user message", "BadRequestError")
            return
        if len(ids) >= self.max_model_len:
            self._context_error(h, len(ids), req)
            return
        turns = self.script[key]
        _faults, reply = turns[turn] if turn < len(turns) else ([], DONE_REPLY)
        chat = self._completion(reply if reply is not None else DONE_REPLY, {}, ids)
        msg = chat["choices"][0]["message"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]
        gen = tk.generation_text(msg.get("content"), calls, msg.get("reasoning") or msg.get("reasoning_content"))
        finish = chat["choices"][0]["finish_reason"]
        out = tk.encode(gen) + ([] if finish == "length" else [tk.EOS_ID])
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(out), "total_tokens": len(ids) + len(out)}
        choice: dict[str, Any] = {"index": 0, "text": gen, "logprobs": tk.completion_logprobs(out, req.get("logprobs"))}
        choice.update(finish_reason="length" if finish == "length" else "stop", stop_reason=None)
        if self.return_token_ids and req.get("return_token_ids"):
            choice["token_ids"] = out
            choice["prompt_token_ids"] = ids
        h._send(
            200,
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": (self.served_names or [req.get("model") or self.model])[0],
                "choices": [choice],
                "usage": usage,
            },
        )

    def _context_error(self, h: _Handler, prompt_tokens: int, req: dict) -> None:
        want = prompt_tokens + int(req.get("max_tokens") or req.get("max_completion_tokens") or 0)
        h._error(
            400,
            (
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{want} tokens ({prompt_tokens} in the messages, {want - prompt_tokens} in the completion). "
                "Please reduce the length of the messages or completion."
            ),
            "BadRequestError",
        )

    def _fault(self, h: _Handler, fault: dict, prompt_tokens: int, req: dict) -> None:
        kind = fault["fault"]
        if kind == 500:
            h._error(500, fault.get("message", "scripted fault: internal server error"), "InternalServerError")
        elif kind == 429:
            headers = {"Retry-After": str(fault["retry_after"])} if "retry_after" in fault else None
            h._error(429, fault.get("message", "scripted fault: too many requests"), "RateLimitError", headers)
        elif kind == "timeout":
            self._stop.wait(float(fault.get("sleep_s", self.timeout_sleep_s)))
            h._error(504, "scripted fault: answered after the client's timeout", "GatewayTimeout")
        elif kind == "empty_choices":
            body = self._completion("", req, [0] * prompt_tokens)
            body["choices"] = []
            h._send(200, body)
        elif kind == "context_length":
            self._context_error(h, max(prompt_tokens, self.max_model_len + 1), req)

    def _completion(self, reply: Any, req: dict, prompt_ids: list[int]) -> dict:
        content: str | None
        tool_calls: list[dict] = []
        extra: dict = reply if isinstance(reply, dict) else {}
        if isinstance(reply, str):
            content = reply
        elif reply.get("fault") == "malformed_tool_json":
            content = None
            tool_calls.append(_tool_call({"name": "terminal", "arguments": '{"command": "ls -la", "timeout": '}))
        else:
            content = reply.get("content")
            calls = reply.get("tool_calls") or ([reply] if "command" in reply else [])
            tool_calls = [_tool_call(c) for c in calls]
        reasoning = extra.get("reasoning")
        finish = extra.get("finish_reason") or ("tool_calls" if tool_calls else "stop")
        gen = tk.generation_text(content, [(c["function"]["name"], c["function"]["arguments"]) for c in tool_calls], reasoning)
        ids = tk.encode(gen) + ([] if finish == "length" else [tk.EOS_ID])
        prompt_tokens, completion_tokens = len(prompt_ids), len(ids)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": None,
        }
        usage.update(extra.get("usage") or {})
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        as_ids = bool(req.get("return_tokens_as_token_ids"))
        top_n = int(req.get("top_logprobs") or 0)

        def entry(t: int, j: int) -> dict:
            text = tk.token_text(t)
            return {"token": f"token_id:{t}" if as_ids else text, "logprob": logprob_of(t, j), "bytes": list(text.encode("utf-8"))}

        logprobs = None
        if req.get("logprobs"):
            content_lp = []
            for j, t in enumerate(ids):
                e = entry(t, j)
                alts = [entry((t + k) % tk.VOCAB_SIZE, j) for k in range(1, top_n)]
                for a in alts:
                    a["logprob"] = min(a["logprob"], e["logprob"]) - 1.0
                e["top_logprobs"] = [dict(e)] + alts if top_n else []
                content_lp.append(e)
            logprobs = {"content": content_lp}
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.return_token_ids:  # newer vLLM: `reasoning`, tool_calls left out when empty
            message["reasoning"] = reasoning
            if tool_calls:
                message["tool_calls"] = tool_calls
        else:
            message["tool_calls"] = tool_calls
            message["reasoning_content"] = reasoning
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": None,
        }
        body: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": (self.served_names or [req.get("model") or self.model])[0],
            "choices": [choice],
            "usage": usage,
            "prompt_logprobs": None,
        }
        if self.return_token_ids:
            want = bool(req.get("return_token_ids"))
            choice["token_ids"] = ids if want else None
            body["prompt_token_ids"] = list(prompt_ids) if want else None
        return body

    def _tokenize(self, h: _Handler, req: dict, detokenize: bool) -> None:
        """vLLM's ``/tokenize`` (chat or prompt form) and ``/detokenize``."""
        try:
            if detokenize:
                h._send(200, {"prompt": tk.decode([int(t) for t in req.get("tokens") or []])})
                return
            if "messages" in req:
                agp = bool(req.get("add_generation_prompt", True))
                cont = bool(req.get("continue_final_message", False))
                if agp and cont:
                    h._error(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.", "BadRequestError")
                    return
                ids = tk.encode_chat(
                    req["messages"] or [], req.get("tools") or None, add_generation_prompt=agp, continue_final_message=cont
                )
            elif "prompt" in req:
                ids = tk.encode(str(req["prompt"]))
            else:
                h._error(400, "tokenize needs `messages` or `prompt`", "BadRequestError")
                return
        except (AttributeError, TypeError, ValueError) as e:
            h._error(400, f"scripted server: cannot tokenize: {e}", "BadRequestError")
            return
        h._send(
            200,
            {
                "count": len(ids),
                "max_model_len": self.max_model_len,
                "tokens": ids,
                "token_strs": [tk.token_text(t) for t in ids] if req.get("return_token_strs") else None,
            },
        )


def _tool_call(c: dict) -> dict:
    if "arguments" in c:
        name, args = c.get("name", "terminal"), c["arguments"]
        args = args if isinstance(args, str) else json.dumps(args)
    else:
        body = {"command": c["command"]}
        if c.get("timeout") is not None:
            body["timeout"] = c["timeout"]
        name, args = "terminal", json.dumps(body, ensure_ascii=False)  # the template's own spelling
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex[:16]}", "type": "function", "function": {"name": name, "arguments": args}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m et_hpc.testing.scripted_server",
        description="Serve scripted chat replies in vLLM's OpenAI-compatible shape on 127.0.0.1, for "
        "dry runs of the agent loop without a model. The script (JSON or YAML) maps a substring of the "
        "first user message to a list of replies: text, {command, timeout}, or {fault: ...}.",
        epilog='example:\n  echo \'{"": [{"command": "echo hi > /home/user/f"}, "done"]}\' > s.json\n'
        "  python -m et_hpc.testing.scripted_server --script s.json --port 0 --endpoint-file ep.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--script", required=True, type=Path, help="JSON or YAML script file")
    p.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: any free port)")
    p.add_argument("--host", default=HOST, help="address to listen on (0.0.0.0: every address, for clients on other nodes)")
    p.add_argument("--model", default="scripted", help="model name to report (default: scripted)")
    p.add_argument("--served-model-name", nargs="+", help="serve only these names (as vLLM's); answers name the first")
    p.add_argument("--max-model-len", type=int, default=32768, help="context length to enforce")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--endpoint-file", type=Path, help="write the endpoint JSON here (as slurm/vllm.sbatch does)")
    where.add_argument("--endpoint-dir", type=Path, help="write the endpoint JSON as DIR/<$SLURM_JOB_ID or scripted-PORT>.json")
    p.add_argument("--old-vllm", action="store_true", help="behave like vLLM before 0.10.2: ignore return_token_ids (no token-id fields)")
    p.add_argument("--no-tokenize", action="store_true", help="serve no /tokenize (like servers other than vLLM)")
    p.add_argument("--api-key", help="require this key on /v1 (default: $VLLM_API_KEY, as vllm serve: no key in the process list)")
    p.add_argument("--model-version", help="model_version to put in the endpoint file")
    p.add_argument("--log-requests", action="store_true", help="print 'served chat turn=N' after each reply")
    args = p.parse_args(argv)
    from et_hpc.errors import UserError

    try:
        srv = ScriptedServer(
            args.script,
            port=args.port,
            model=args.model,
            max_model_len=args.max_model_len,
            return_token_ids=not args.old_vllm,
            tokenize_endpoint=not args.no_tokenize,
            api_key=args.api_key or os.environ.get("VLLM_API_KEY") or None,
            served_names=args.served_model_name,
            host=args.host,
        )
    except UserError as e:
        print(f"scripted_server: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"scripted_server: error: cannot listen on {args.host}:{args.port}: {e.strerror}", file=sys.stderr)
        return 2
    srv.log_requests = args.log_requests
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    srv.start()
    job = os.environ.get("SLURM_JOB_ID")
    ep = args.endpoint_file or (args.endpoint_dir / f"{job or f'scripted-{srv.port}'}.json" if args.endpoint_dir else None)
    if ep:
        srv.write_endpoint_file(ep, job, args.model_version)
    print(f"serving {srv.base_url} (model {srv.model})", flush=True)
    done.wait()
    srv.stop()
    if ep:
        try:
            if json.loads(ep.read_text()).get("port") == srv.port:
                ep.unlink()
        except (OSError, ValueError):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
