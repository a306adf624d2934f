"""Token-in/token-out capture without a sandbox: the scripted tokenizer and template (and its Hugging
Face twin), the server's vLLM token fields and /tokenize, ``check_tokens``, the OpenAI policy's
capture through the real agent loop (a host bash shell), drift detection, the old-server fallback,
and that a shard written with the version-1 schema still reads.
"""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from et_hpc.agent.loop import BudgetConfig, run_agent
from et_hpc.agent.openai_policy import OpenAIPolicy
from et_hpc.agent.wire import TERMINAL_TOOL
from et_hpc.record import EPISODE_SCHEMA, SCHEMA_VERSION, EpisodeRecord, check_tokens
from et_hpc.testing import scripted_tokenizer as tk
from et_hpc.testing.scripted_server import ScriptedServer

TEXTS = [
    "hello world",
    "  two  spaces\tand a tab\n",
    "Ünïcödé ✓ 日本語",
    "ls -la /home/user && echo $?",
    "<|im_start|>user\nhi<|im_end|>",
    "a <tool_call> b </think>",
    "",
]


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _root(srv: ScriptedServer) -> str:
    return srv.base_url[: -len("/v1")]


def _conversation() -> list[dict]:
    return [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "do it"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "terminal", "arguments": {"command": "ls -la"}}}],
        },
        {"role": "tool", "tool_call_id": "1", "content": "out\n"},
        {
            "role": "assistant",
            "content": "now two",
            "reasoning": "hmm",
            "tool_calls": [
                {"id": "2", "type": "function", "function": {"name": "terminal", "arguments": {"command": "pwd"}}},
                {"id": "3", "type": "function", "function": {"name": "terminal", "arguments": {"command": "id", "timeout": 5}}},
            ],
        },
        {"role": "tool", "tool_call_id": "2", "content": "/home/user"},
        {"role": "tool", "tool_call_id": "3", "content": "uid=1000"},
        {"role": "assistant", "content": "done"},
    ]


# -- the tokenizer and template ----------------------------------------------------------------
def test_byte_level_ids_and_added_tokens():
    assert tk.encode("hi") == [104, 105]
    assert tk.encode("<|im_end|>x") == [tk.EOS_ID, 120]
    assert tk.encode("é") == list("é".encode())
    for s in TEXTS:
        assert tk.decode(tk.encode(s)) == s
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tk.decode([tk.VOCAB_SIZE])


def test_template_rerenders_history_like_real_templates():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    model_wrote = tk.generation_text(None, [("terminal", '{"command":"ls"}')])  # compact JSON
    canonical = tk.generation_text(None, [("terminal", '{"command": "ls"}')])
    hist = msgs + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "terminal", "arguments": '{"command":"ls"}'}}],
        }
    ]
    rendered = tk.render_chat(hist)
    prompt = tk.render_chat(msgs, add_generation_prompt=True)
    assert rendered == prompt + canonical + "<|im_end|>\n"  # the template re-serialises arguments
    assert rendered != prompt + model_wrote + "<|im_end|>\n"
    # reasoning: kept after the last user message, dropped before it
    think = msgs + [{"role": "assistant", "content": "a", "reasoning": "r"}]
    assert "<think>\nr\n</think>\n\na<|im_end|>" in tk.render_chat(think)
    assert "<think>" not in tk.render_chat(think + [{"role": "user", "content": "next"}])
    # tools are listed in the system turn
    assert json.dumps(TERMINAL_TOOL) in tk.render_chat(msgs, [TERMINAL_TOOL])


def test_hf_tokenizer_agrees(tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    d = tk.write_hf_tokenizer(tmp_path / "tok")
    raw = Tokenizer.from_file(str(d / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(str(d))  # offline: a local directory
    for s in TEXTS:
        assert raw.encode(s).ids == tk.encode(s), s
        assert auto.encode(s, add_special_tokens=False) == tk.encode(s), s
        assert auto.decode(tk.encode(s)) == s
    assert auto.eos_token_id == tk.EOS_ID
    msgs = _conversation()
    for tools in (None, [TERMINAL_TOOL]):
        for agp in (False, True):
            text = auto.apply_chat_template(msgs, tools=tools, add_generation_prompt=agp, tokenize=False)
            assert text == tk.render_chat(msgs, tools, add_generation_prompt=agp)
            assert auto.encode(text, add_special_tokens=False) == tk.encode_chat(msgs, tools, add_generation_prompt=agp)
    # positive control: a different conversation renders differently
    assert auto.apply_chat_template(msgs[:2], tokenize=False) != auto.apply_chat_template(msgs, tokenize=False)


# -- the server's fields -----------------------------------------------------------------------
def test_server_token_fields_and_tokenize():
    with ScriptedServer({"u": [{"command": "ls"}]}) as srv:
        msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        body = {
            "model": "scripted",
            "messages": msgs,
            "tools": [TERMINAL_TOOL],
            "return_token_ids": True,
            "logprobs": True,
            "top_logprobs": 2,
        }
        code, r = _post(srv.base_url + "/chat/completions", body)
        assert code == 200
        prompt, ids = r["prompt_token_ids"], r["choices"][0]["token_ids"]
        assert prompt == tk.encode_chat(msgs, [TERMINAL_TOOL], add_generation_prompt=True)
        assert r["usage"]["prompt_tokens"] == len(prompt) and r["usage"]["completion_tokens"] == len(ids)
        assert tk.decode(ids) == '<tool_call>\n{"name": "terminal", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>'
        content = r["choices"][0]["logprobs"]["content"]
        assert [c["token"] for c in content] == [tk.token_text(t) for t in ids]
        assert all(len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["logprob"] == c["logprob"] for c in content)
        # /tokenize, chat form: the same ids as the request's prompt; then with the reply appended
        code, t = _post(
            _root(srv) + "/tokenize", {"model": "scripted", "messages": msgs, "tools": [TERMINAL_TOOL], "add_generation_prompt": True}
        )
        assert code == 200 and t["tokens"] == prompt and t["count"] == len(prompt) and t["max_model_len"] == 32768
        full = _post(
            _root(srv) + "/tokenize",
            {"messages": msgs + [r["choices"][0]["message"]], "tools": [TERMINAL_TOOL], "add_generation_prompt": False},
        )[1]["tokens"]
        assert full == prompt + ids + tk.encode("\n")  # the template closes the turn with a newline
        code, t = _post(_root(srv) + "/tokenize", {"prompt": "hi", "return_token_strs": True})
        assert t["tokens"] == [104, 105] and t["token_strs"] == ["h", "i"]
        assert _post(_root(srv) + "/detokenize", {"tokens": ids})[1]["prompt"] == tk.decode(ids)
        code, e = _post(_root(srv) + "/tokenize", {"messages": msgs, "add_generation_prompt": True, "continue_final_message": True})
        assert code == 400 and "continue_final_message" in e["error"]["message"]


def test_old_server_leaves_fields_out_and_no_tokenize_is_404():
    with ScriptedServer({"u": ["hi"]}, return_token_ids=False, tokenize_endpoint=False) as srv:
        msgs = [{"role": "user", "content": "u"}]
        code, r = _post(srv.base_url + "/chat/completions", {"messages": msgs, "return_token_ids": True})
        assert code == 200 and "prompt_token_ids" not in r and "token_ids" not in r["choices"][0]
        assert r["choices"][0]["message"]["tool_calls"] == [] and "reasoning_content" in r["choices"][0]["message"]
        assert _post(_root(srv) + "/tokenize", {"messages": msgs})[0] == 404


# -- check_tokens --------------------------------------------------------------------------------
def test_check_tokens_exact_and_drift():
    prompts = [[1, 2, 3], [1, 2, 3, 4, 5, 9, 9], [1, 2, 3, 4, 5, 9, 9, 6, 7]]
    completions = [[4, 5], [6], [8]]
    deltas, drift = check_tokens(prompts, completions, final=[1, 2, 3, 4, 5, 9, 9, 6, 7, 8, 0])
    assert deltas == [[1, 2, 3], [9, 9], [7]] and drift is None
    rec = EpisodeRecord(run_name="r", task_id="t", sample=0, status="ok", reward=1.0, prompt_token_ids=deltas, token_ids=completions)
    assert rec.token_sequence()[0] == [1, 2, 3, 4, 5, 9, 9, 6, 7, 8]
    # turn 1's prompt re-renders completion 0 differently
    _, drift = check_tokens([[1, 2, 3], [1, 2, 3, 4, 0, 9]], [[4, 5], [6]])
    assert drift == "turn 1: the server's prompt (6 tokens) differs from the tokens of the earlier turns (5) at position 4"
    # the last completion disagrees with the server's tokenization of the whole conversation
    _, drift = check_tokens([[1, 2]], [[3, 4]], final=[1, 2, 3, 5])
    assert drift and drift.startswith("end:") and "position 3" in drift
    _, drift = check_tokens([[1], [1, 5, 0]], [[2], [3]], final=[9])
    assert drift and drift.endswith("(+1 more)")
    drifted = rec.model_copy(update={"token_drift": drift})
    assert rec.has_tokens and not drifted.has_tokens  # exports fall back to the messages
    with pytest.raises(ValueError, match="drift"):
        drifted.token_sequence()


# -- the policy through the loop ------------------------------------------------------------------
def _run(shell, script, mode="tools", server_kw=None, **policy_kw):
    with ScriptedServer(script, **(server_kw or {})) as srv:
        pol = OpenAIPolicy(srv.base_url, mode=mode, backoff_base_s=0.01, rng=random.Random(0), **policy_kw)
        r = run_agent("do the task", shell, pol, BudgetConfig())
        final = None
        if srv.tokenize_endpoint:
            last = max(i for i, m in enumerate(r.messages) if m["role"] == "assistant")
            body = {"messages": r.messages[: last + 1], "add_generation_prompt": False}
            if mode == "tools":
                body["tools"] = [TERMINAL_TOOL]
            final = _post(_root(srv) + "/tokenize", body)[1]["tokens"]
        pol.close()
    return r, final


def _sequence(r) -> list[int]:
    rec = EpisodeRecord(
        run_name="r",
        task_id="t",
        sample=0,
        status="ok",
        reward=0.0,
        prompt_token_ids=r.tokens.prompt_token_ids,
        token_ids=r.tokens.token_ids,
    )
    return rec.token_sequence()[0]


TOOLS_SCRIPT = {"task": [{"command": "echo hi"}, {"command": "printf 'ü\\n'", "timeout": 5}, "All done."]}
TEXT_SCRIPT = {"task": ["Look first.\n<command>echo hi</command>", "<command>ls /</command>", "<action>done</action>"]}


@pytest.mark.parametrize("mode,script", [("tools", TOOLS_SCRIPT), ("text", TEXT_SCRIPT)])
def test_server_exact_concatenates_to_servers_tokenization(shell, mode, script):
    r, final = _run(shell, script, mode, logprobs=True)
    t = r.tokens
    assert r.status == "ok" and len(r.turns) == 3
    assert (t.tokens_source, t.token_drift) == ("server-exact", None)
    assert final == _sequence(r) + tk.encode("\n")  # everything the model saw and said, then the closing newline
    assert [len(lp) for lp in t.logprobs] == [len(c) for c in t.token_ids]
    assert all(c[-1] == tk.EOS_ID for c in t.token_ids)


def test_wrong_concatenation_is_detected(shell):
    """Tool output tokenized on its own, without the template's turn tokens: the classic client mistake."""
    r, final = _run(shell, TOOLS_SCRIPT)
    turns, msgs = r.turns, r.messages
    assert r.tokens.token_drift is None  # positive control: the right way agrees
    seq = list(turns[0].prompt_token_ids)
    prompts = []
    tool_outputs = [m["content"] for m in msgs if m["role"] == "tool"]
    for i, turn in enumerate(turns):
        if i:
            seq += tk.encode(tool_outputs[i - 1])  # wrong: no <|im_start|>user / <tool_response> tokens
        prompts.append(list(seq))
        seq += turn.token_ids
    _, drift = check_tokens(prompts, [t.token_ids for t in turns], final)
    assert drift and drift.startswith("end:")
    # the client-built prompts also disagree with what the server actually tokenized
    _, drift = check_tokens(
        [p if i == 0 else t.prompt_token_ids for i, (p, t) in enumerate(zip(prompts, turns))], [t.token_ids for t in turns]
    )
    assert drift is None  # the server's own prompts are consistent ...
    assert prompts[1] != turns[1].prompt_token_ids  # ... and the client's are not them


@pytest.mark.parametrize(
    "mode,script",
    [
        ("tools", {"task": [{"tool_calls": [{"name": "terminal", "arguments": '{"command":"echo hi"}'}]}, "done"]}),
        ("text", {"task": [{"content": "<command>echo hi</command>", "reasoning": "I should look."}, "<action>done</action>"]}),
    ],
)
def test_template_rerender_drift_is_recorded(shell, mode, script):
    """The model's own format (compact JSON, a think part) is re-rendered differently next turn."""
    r, _ = _run(shell, script, mode)
    assert r.status == "ok" and r.tokens.tokens_source == "server-exact"
    assert r.tokens.token_drift and r.tokens.token_drift.startswith("turn 1:"), r.tokens.token_drift


def test_old_server_falls_back_to_tokenize(shell):
    r, final = _run(shell, TOOLS_SCRIPT, server_kw={"return_token_ids": False}, logprobs=True)
    assert r.tokens.tokens_source == "re-tokenized" and r.tokens.token_drift is None
    assert final == _sequence(r) + tk.encode("\n")
    assert all(t.tokens_from == "tokenize" for t in r.turns)
    # without logprobs the completions are re-rendered open-ended (no template tokens after them)
    r, final = _run(shell, TOOLS_SCRIPT, server_kw={"return_token_ids": False})
    assert r.tokens.tokens_source == "re-tokenized" and r.tokens.token_drift is None
    assert final[: len(_sequence(r))] == _sequence(r)


def test_no_token_ids_anywhere_is_absent_and_said(shell):
    r, final = _run(shell, TOOLS_SCRIPT, server_kw={"return_token_ids": False, "tokenize_endpoint": False})
    assert r.status == "ok" and final is None
    assert r.tokens.tokens_source == "absent" and r.tokens.prompt_token_ids is None
    assert "no token ids" in r.tokens.token_drift


# -- schema versions ---------------------------------------------------------------------------
V1_COLUMNS = [f.name for f in EPISODE_SCHEMA][: EPISODE_SCHEMA.get_field_index("created_at") + 1]


def test_v1_shard_still_reads(tmp_path):
    from et_hpc.runs.store import RunStore

    v1 = pa.schema([EPISODE_SCHEMA.field(c) for c in V1_COLUMNS], metadata={b"et_hpc.schema_version": b"1"})
    row = {c: None for c in V1_COLUMNS}
    row.update(
        schema_version=1,
        episode_id="e1",
        run_name="old",
        task_id="t",
        sample=0,
        group_id="t",
        status="ok",
        reward=1.0,
        messages="[]",
        sampling_params="{}",
        versions="{}",
        prompt_token_ids=[[1, 2]],
        token_ids=[[3]],
        logprobs=[[-0.5]],
        tests=[],
        created_at=datetime(2025, 1, 1, tzinfo=timezone.utc),
    )
    run = tmp_path / "old"
    run.mkdir()
    pq.write_table(pa.Table.from_pylist([row], schema=v1), run / "part-20250101T000000000000Z-h-1-0.parquet")
    assert "tokens_source" not in pq.read_schema(run / "part-20250101T000000000000Z-h-1-0.parquet").names
    store = RunStore(run)
    table = store.read()
    assert table.column("tokens_source").to_pylist() == [None]  # a v2 column, null for the v1 row
    (rec,) = store.records()
    assert rec.schema_version == 1 and rec.tokens_source is None and rec.token_drift is None
    assert rec.token_sequence()[0] == [1, 2, 3]
    # a v2 shard beside it reads together
    store.write(
        [
            EpisodeRecord(
                run_name="old",
                task_id="t",
                sample=1,
                status="ok",
                reward=0.0,
                tokens_source="server-exact",
                prompt_token_ids=[[5]],
                token_ids=[[6]],
            )
        ]
    )
    got = {r.sample: r for r in store.records()}
    assert got[0].schema_version == 1 and got[1].schema_version == SCHEMA_VERSION and got[1].tokens_source == "server-exact"
