"""The exported tokenizer gives the server's ids: for every named model, a corpus (numbers, $HOME,
paths, code, Unicode, whitespace runs, each model's special tokens, a rendered chat) is tokenized by
llama-server's /tokenize and by the tokenizer written from the same GGUF. The positive control: the
old GPT-2 split disagrees with the server on Qwen's digits. A pre-tokenizer not reproduced is refused."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from helpers import need

CORPUS = [
    "1234567 3.14159 -42 1e10 0x1F 2024-12-06 10,000,000",
    'echo $HOME ${PATH}:~/bin; cd "$HOME/.config" && ls -la',
    "/usr/local/bin/python3.11 ./a/b_c-d.txt ../x/y.tar.gz C:\\\\Windows\\\\sys32",
    'def f(x):\n    return x**2  # square\n\nfor i in {1..10}; do echo "$i"; done\n',
    "awk -F, 'NR>1 {s+=$3} END {print s}' data.csv > /tmp/sum.txt 2>&1",
    "héllo wörld 日本語テキスト 🙂🚀 e\u0301 \ufb01 Ωmega ß",
    "a  b   c\t\td\n\n\n  \n e    \r\n\r\n  ",
    "   leading and trailing   ",
    "don't I'LL we've THEY'RE it's",
    '{"name": "terminal", "arguments": {"command": "printf \'%s\\\\n\' hi"}}',
]
SPECIALS = {
    "smollm2-135m": "<|im_start|>system\nYou are x.<|im_end|>\n<|im_start|>user\n12 $HOME<|im_end|>\n<|endoftext|>",
    "qwen2.5-coder-0.5b": '<|im_start|>user\nhi<|im_end|>\n<tool_call>\n{"a": 1}\n</tool_call><|endoftext|><|fim_prefix|>x<|fim_middle|>',
    "qwen2.5-coder-1.5b": "<|im_start|>assistant\n<tool_call>\n{}\n</tool_call><|im_end|>\n<|file_sep|><|repo_name|>r",
}


@pytest.mark.parametrize("name", list(SPECIALS))
def test_exported_tokenizer_matches_the_server(name, tmp_path):
    need(name if name != "smollm2-135m" else "model")
    from tokenizers import Tokenizer

    from et_hpc.model.catalog import resolve
    from et_hpc.model.server import ServerConfig, serving
    from et_hpc.model.tokenizer import write_tokenizer

    m = resolve(name)
    tok = Tokenizer.from_file(str(write_tokenizer(m.path, tmp_path / "tok") / "tokenizer.json"))
    with serving(ServerConfig(model=m.path, parallel=1, ctx_size=1024, log_file=tmp_path / "server.log")) as srv:
        root = f"http://127.0.0.1:{srv.port}"
        h = {"Authorization": f"Bearer {srv.api_key}"}

        def server(text: str) -> list[int]:
            r = httpx.post(root + "/tokenize", json={"content": text, "add_special": False, "parse_special": True}, headers=h, timeout=60)
            return [int(t) for t in r.json()["tokens"]]

        chat = [{"role": "system", "content": "Run commands."}, {"role": "user", "content": "Write 'hi 42' to ~/out.txt"}]
        rendered = httpx.post(root + "/apply-template", json={"messages": chat, "add_generation_prompt": True}, headers=h, timeout=60)
        corpus = [*CORPUS, SPECIALS[name], rendered.json()["prompt"]]
        got = {t: server(t) for t in corpus}
    diff = {t: (ids, tok.encode(t, add_special_tokens=False).ids) for t, ids in got.items()}
    diff = {t: v for t, v in diff.items() if v[0] != v[1]}
    assert not diff, diff
    if name.startswith("qwen"):  # the positive control: with GPT-2's split instead of qwen2's, the corpus drifts
        from tokenizers import pre_tokenizers

        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        assert any(tok.encode(t, add_special_tokens=False).ids != ids for t, ids in got.items())


def test_a_pre_tokenizer_not_reproduced_is_refused(tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "other.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(["a", "b", "ab"])
    w.add_token_types([1, 1, 1])
    w.add_token_merges(["a b"])
    w.add_tensor("t", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = subprocess.run([sys.executable, "-m", "et_hpc.model.tokenizer", str(tmp_path / "out"), str(path)], capture_output=True, text=True)
    assert r.returncode == 2 and "llama-bpe" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out" / "tokenizer.json").exists()
