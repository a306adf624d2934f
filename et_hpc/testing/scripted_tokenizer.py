"""The scripted server's tokenizer and chat template: deterministic, pure Python, no downloads.

Token ids 0..255 are UTF-8 bytes and 256..264 whole-string special and added tokens, matched
before the bytes as Hugging Face tokenizers do. The chat template is ChatML as Qwen2.5/Qwen3
write it and re-renders history as real templates do (tool-call arguments re-serialised,
reasoning only after the last user message), which is what makes naive multi-turn token
concatenation drift. ``generation_text()`` is what the scripted model generates for a reply;
``write_hf_tokenizer(dir)`` writes the same tokenizer and template for
``transformers.AutoTokenizer``, offline. Specification: docs/testing-doubles.md ("The tokenizer").
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
STRING_TOKENS = SPECIAL_TOKENS + ADDED_TOKENS
STRING_IDS = {s: 256 + i for i, s in enumerate(STRING_TOKENS)}
ID_STRINGS = {i: s for s, i in STRING_IDS.items()}
VOCAB_SIZE = 256 + len(STRING_TOKENS)
EOS = "<|im_end|>"
EOS_ID = STRING_IDS[EOS]
_SPLIT_RE = re.compile("(" + "|".join(re.escape(s) for s in STRING_TOKENS) + ")")

TOOLS_PREAMBLE = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\n</tool_call>'
)


def encode(text: str) -> list[int]:
    """Token ids of ``text``: added tokens first, every other byte its own id."""
    out: list[int] = []
    for part in _SPLIT_RE.split(text or ""):
        if part in STRING_IDS:
            out.append(STRING_IDS[part])
        elif part:
            out.extend(part.encode("utf-8"))
    return out


def decode(ids: list[int]) -> str:
    buf = bytearray()
    out: list[str] = []
    for i in ids:
        if i in ID_STRINGS:
            out.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
            out.append(ID_STRINGS[i])
        elif 0 <= i < 256:
            buf.append(i)
        else:
            raise ValueError(f"token id {i} is outside the vocabulary (0..{VOCAB_SIZE - 1})")
    out.append(buf.decode("utf-8", errors="replace"))
    return "".join(out)


def token_text(i: int) -> str:
    """One token as text (a lone byte of a multi-byte character decodes to U+FFFD, as in vLLM)."""
    return decode([i])


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # content parts
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


class HistoryError(ValueError):
    """A conversation the server refuses to render (as vLLM and llama-server do)."""


def _args_json(arguments: Any) -> str:
    """How the template writes a history call's arguments: parsed (as vLLM and llama-server do),
    then ``tojson``; text that is not JSON makes the request fail, as it does on those servers."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError as e:
            raise HistoryError(f"Failed to parse tool call arguments as JSON: {e}") from None
    return json.dumps(arguments, ensure_ascii=False)


def tool_call_block(name: str, arguments_text: str) -> str:
    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + arguments_text + "}\n</tool_call>"


def assistant_body(content: str | None, calls: list[tuple[str, str]], reasoning: str | None = None) -> str:
    """An assistant turn between ``<|im_start|>assistant\\n`` and ``<|im_end|>``."""
    body = f"<think>\n{reasoning.strip()}\n</think>\n\n" if reasoning else ""
    text = content or ""
    for name, args in calls:
        text += ("\n" if text else "") + tool_call_block(name, args)
    return body + text


def generation_text(content: str | None, calls: list[tuple[str, str]], reasoning: str | None = None) -> str:
    """What the model emits for a reply (``calls``: (name, arguments as the model wrote them))."""
    return assistant_body(content, calls, reasoning)


def render_chat(
    messages: list[dict[str, Any]],
    tools: list[dict] | None = None,
    *,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
) -> str:
    """The chat template (see the module docstring); the Jinja twin is ``CHAT_TEMPLATE``."""
    out: list[str] = []
    msgs = list(messages)
    if tools:
        sys_text = _text(msgs[0].get("content")) if msgs and msgs[0].get("role") == "system" else ""
        out.append("<|im_start|>system\n" + sys_text + TOOLS_PREAMBLE)
        for t in tools:
            out.append("\n" + json.dumps(t, ensure_ascii=False))
        out.append(TOOLS_POSTAMBLE + "<|im_end|>\n")
        if msgs and msgs[0].get("role") == "system":
            msgs = msgs[1:]
    last_user = -1
    for i, m in enumerate(msgs):
        if m.get("role") == "user":
            last_user = i
    for i, m in enumerate(msgs):
        role = m.get("role")
        if role in ("system", "user"):
            out.append(f"<|im_start|>{role}\n{_text(m.get('content'))}<|im_end|>\n")
        elif role == "assistant":
            reasoning = m.get("reasoning") or m.get("reasoning_content")
            calls = []
            for c in m.get("tool_calls") or []:
                fn = c.get("function") or {}
                calls.append((str(fn.get("name") or ""), _args_json(fn.get("arguments"))))
            body = assistant_body(_text(m.get("content")), calls, reasoning if i > last_user else None)
            if continue_final_message and i == len(msgs) - 1:
                out.append("<|im_start|>assistant\n" + body)
            else:
                out.append("<|im_start|>assistant\n" + body + "<|im_end|>\n")
        elif role == "tool":
            if i == 0 or msgs[i - 1].get("role") != "tool":
                out.append("<|im_start|>user")
            out.append("\n<tool_response>\n" + _text(m.get("content")) + "\n</tool_response>")
            if i == len(msgs) - 1 or msgs[i + 1].get("role") != "tool":
                out.append("<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def encode_chat(messages: list[dict[str, Any]], tools: list[dict] | None = None, **kw: Any) -> list[int]:
    return encode(render_chat(messages, tools, **kw))


# The same template in Jinja (transformers' environment: trim_blocks, lstrip_blocks, a tojson
# that is json.dumps with ensure_ascii=False). Written without literal whitespace between tags.
_J = [
    "{%- set msgs = messages -%}",
    "{%- if tools -%}",
    "{{- '<|im_start|>system\\n' -}}",
    "{%- if msgs and msgs[0]['role'] == 'system' -%}",
    "{{- msgs[0]['content'] or '' -}}{%- set msgs = msgs[1:] -%}",
    "{%- endif -%}",
    "{{- " + json.dumps(TOOLS_PREAMBLE) + " -}}",
    "{%- for t in tools -%}{{- '\\n' + (t | tojson) -}}{%- endfor -%}",
    "{{- " + json.dumps(TOOLS_POSTAMBLE + "<|im_end|>\n") + " -}}",
    "{%- endif -%}",
    "{%- set ns = namespace(last_user=-1) -%}",
    "{%- for m in msgs -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}",
    "{%- for m in msgs -%}",
    "{%- if m['role'] in ['system', 'user'] -%}",
    "{{- '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') + '<|im_end|>\\n' -}}",
    "{%- elif m['role'] == 'assistant' -%}",
    "{{- '<|im_start|>assistant\\n' -}}",
    "{%- set r = m.get('reasoning') or m.get('reasoning_content') -%}",
    "{%- if r and loop.index0 > ns.last_user -%}{{- '<think>\\n' + (r | trim) + '\\n</think>\\n\\n' -}}{%- endif -%}",
    "{%- set ns2 = namespace(text=(m['content'] or '')) -%}",
    "{%- for c in (m.get('tool_calls') or []) -%}",
    "{%- set a = c['function']['arguments'] -%}",
    "{%- if a is not string -%}{%- set a = a | tojson -%}{%- endif -%}",
    "{%- if ns2.text -%}{%- set ns2.text = ns2.text + '\\n' -%}{%- endif -%}",
    "{%- set ns2.text = ns2.text + '<tool_call>\\n{\"name\": \"' + c['function']['name'] + '\", \"arguments\": ' + a + '}\\n</tool_call>' -%}",  # noqa: E501
    "{%- endfor -%}",
    "{{- ns2.text -}}",
    "{%- if not (continue_final_message and loop.last) -%}{{- '<|im_end|>\\n' -}}{%- endif -%}",
    "{%- elif m['role'] == 'tool' -%}",
    "{%- if loop.first or loop.previtem['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}",
    "{{- '\\n<tool_response>\\n' + (m['content'] or '') + '\\n</tool_response>' -}}",
    "{%- if loop.last or loop.nextitem['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}",
    "{%- endif -%}",
    "{%- endfor -%}",
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}",
]
CHAT_TEMPLATE = "".join(_J)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte (what a ByteLevel vocab is keyed by)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def write_hf_tokenizer(directory: str | Path, *, model_max_length: int = 32768) -> Path:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` for this tokenizer into ``directory``.

    Needs the ``tokenizers`` package (a test dependency). Returns the directory.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    b2u = _bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in ADDED_TOKENS])
    for s, i in STRING_IDS.items():
        if tok.token_to_id(s) != i:
            raise RuntimeError(f"tokenizers gave {s!r} id {tok.token_to_id(s)}, expected {i}")
    tok.save(str(d / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return d


def logprob_of(token: int, position: int) -> float:
    """The deterministic sampling logprob the scripted model reports for a token."""
    return -(((token * 7919 + position * 104729) % 1000) / 1000.0)


def completion_logprobs(ids: list[int], n: Any) -> dict[str, Any] | None:
    """vLLM's ``/v1/completions`` ``logprobs`` for the sampled ``ids`` when the request asked for
    ``n`` (an integer >= 0: the sampled token's logprob, and ``n`` alternatives), else None."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        return None
    texts = [token_text(t) for t in ids]
    lps = [logprob_of(t, j) for j, t in enumerate(ids)]
    offsets = [sum(len(x) for x in texts[:j]) for j in range(len(texts))]
    top = [{texts[j]: lps[j], **{token_text((t + k) % VOCAB_SIZE): lps[j] - k for k in range(1, n)}} for j, t in enumerate(ids)]
    return {"text_offset": offsets, "token_logprobs": lps, "tokens": texts, "top_logprobs": top}
