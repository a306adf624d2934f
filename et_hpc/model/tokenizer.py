"""A Hugging Face tokenizer directory from a GGUF file's own vocabulary (byte-level BPE models).

Trainers and atroposlib load a tokenizer with ``AutoTokenizer.from_pretrained(DIR)``; a GGUF file
carries the vocabulary, merges, special tokens and chat template, so the tokenizer of the model the
CPU server runs is written from it, offline (needs the ``gguf`` and ``tokenizers`` packages). The
pre-tokenizer is the one llama.cpp uses for the file's ``tokenizer.ggml.pre`` (``PRE_TOKENIZERS``:
gpt2, smollm, qwen2); any other is refused rather than approximated (ids would drift from the server's).

    python -m et_hpc.model.tokenizer OUT_DIR [GGUF|MODEL-NAME]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _str(field) -> str:
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def _strs(field) -> list[str]:
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def _pair(merge: str) -> tuple[str, str]:
    """A GGUF merge rule ``"a b"`` as the pair BPE takes."""
    left, sep, right = merge.partition(" ")
    if not sep:
        raise ValueError(f"not a BPE merge rule (two symbols separated by a space): {merge!r}")
    return left, right


# llama.cpp's split (src/llama-vocab.cpp) for each tokenizer.ggml.pre this module reproduces
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = ("gpt2", "smollm", "qwen2")


def pre_tokenizer(pre: str):
    """The ``tokenizers`` pre-tokenizer doing what llama.cpp does for ``tokenizer.ggml.pre`` = ``pre``."""
    from tokenizers import Regex, pre_tokenizers

    def split(regex: str):
        return pre_tokenizers.Split(Regex(regex), behavior="isolated")

    bytelevel = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "gpt2":
        return pre_tokenizers.Sequence([split(_GPT2_RE), bytelevel])
    if pre == "smollm":  # digits one by one, then GPT-2's split
        return pre_tokenizers.Sequence([split(r"\p{N}"), split(_GPT2_RE), bytelevel])
    if pre == "qwen2":
        return pre_tokenizers.Sequence([split(_QWEN2_RE), bytelevel])
    known = ", ".join(PRE_TOKENIZERS)
    raise ValueError(
        f"tokenizer.ggml.pre = {pre!r} is not reproduced here ({known} are): refusing a tokenizer that would drift from the server's"
    )


def write_tokenizer(gguf_path: Path, out: Path) -> Path:
    from gguf import GGUFReader
    from tokenizers import Tokenizer, decoders, models

    r = GGUFReader(str(gguf_path))
    f = r.fields
    if _str(f["tokenizer.ggml.model"]) != "gpt2":
        raise ValueError(f"{gguf_path}: only byte-level BPE ('gpt2') vocabularies are supported")
    if "tokenizer.ggml.pre" not in f:
        raise ValueError(f"{gguf_path}: no tokenizer.ggml.pre: the server's pre-tokenizer is unknown")
    pre = pre_tokenizer(_str(f["tokenizer.ggml.pre"]))
    tokens = _strs(f["tokenizer.ggml.tokens"])
    types = [int(f["tokenizer.ggml.token_type"].parts[i][0]) for i in f["tokenizer.ggml.token_type"].data]
    merges = [_pair(m) for m in _strs(f["tokenizer.ggml.merges"])]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken

    # CONTROL tokens (<|im_start|>, <|im_end|>, ...) are special; USER_DEFINED ones (Qwen's <tool_call>,
    # ...) are matched whole too, as llama.cpp always does, but are not special
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))

    def tid(key: str) -> str | None:
        return tokens[int(f[key].parts[f[key].data[0]][0])] if key in f else None

    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tid("tokenizer.ggml.bos_token_id"),
        "eos_token": tid("tokenizer.ggml.eos_token_id"),
        "unk_token": tid("tokenizer.ggml.unknown_token_id"),
        "pad_token": tid("tokenizer.ggml.padding_token_id"),
        "add_bos_token": False,
        "model_max_length": 8192,
    }
    if "tokenizer.chat_template" in f:
        cfg["chat_template"] = _str(f["tokenizer.chat_template"])
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    return out


def main(argv: list[str] | None = None) -> int:
    from et_hpc.errors import UserError
    from et_hpc.model.catalog import resolve

    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m et_hpc.model.tokenizer OUT_DIR [GGUF|MODEL-NAME]", file=sys.stderr)
        return 2
    try:
        gguf = resolve(args[1] if len(args) > 1 else None).path
        print(write_tokenizer(gguf, Path(args[0])))
    except (UserError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
