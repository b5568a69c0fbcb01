"""The exported tokenizer splits text as llama.cpp does, for every pre-tokenizer export-hf writes.

On the real SmolLM2 vocabulary (49,152 tokens; skipped where `make smollm2` has not fetched it): its
own `smollm` pre-tokenizer, and the same tokens and merges under `gpt-2`, `llama-bpe` and `qwen2`
(vocab-only GGUFs that differ from the base in `tokenizer.ggml.pre` alone), each against llama.cpp's
tokenizer on the same file. An unknown pre-tokenizer is refused in one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mfgguf.base.known import cached
from mfgguf.converters.hf.source import GGUFSource
from mfgguf.converters.hf.tokenizer import build_tokenizer, tokenizer_files
from mfgguf.errors import MfggufError
from tests.converters import llama_tokenize, text_sample

SMOLLM2 = cached("smollm2")
TEXT = (text_sample(6000) + "\n\tdef f(x):\n        return x ** 2  # ünïcödé, 日本語 😀\n"
        "In 2024, 1234567 people paid $3.50 each; it's 10:45PM. I'VE SEEN 'EM ALL!!\r\n\n   spaced   out\n")


def vocab_gguf(src: Path, out: Path, pre: str) -> Path:
    """A vocab-only copy of `src`'s key-values with tokenizer.ggml.pre = `pre` (llama.cpp loads it with vocab_only)."""
    import gguf

    from mfgguf.gguf.header import read_gguf_header

    kv = read_gguf_header(src).kv
    w = gguf.GGUFWriter(str(out), next(v for k, _, v in kv if k == "general.architecture"))
    for key, vt, value in kv:
        if key == "general.architecture":
            continue
        if vt == "ARRAY":
            w.add_key_value(key, value[1], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType[value[0]])
        else:
            w.add_key_value(key, pre if key == "tokenizer.ggml.pre" else value, gguf.GGUFValueType[vt])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def smollm2() -> Path:
    if SMOLLM2 is None:
        pytest.skip("SmolLM2-135M-Instruct is not fetched: run `make smollm2`")
    return SMOLLM2


@pytest.mark.parametrize("pre", ["smollm", "gpt-2", "llama-bpe", "qwen2"])
def test_tokenizes_as_llama_cpp(smollm2, tmp_path, pre):
    from tokenizers import Tokenizer

    g = smollm2 if pre == "smollm" else vocab_gguf(smollm2, tmp_path / f"{pre}.gguf", pre)
    with GGUFSource(g) as src:
        tok = Tokenizer.from_str(tokenizer_files(src)["tokenizer.json"])
    assert tok.encode(TEXT, add_special_tokens=False).ids == llama_tokenize(g, TEXT)


def test_unknown_pre_tokenizer_is_refused(smollm2, tmp_path):
    g = vocab_gguf(smollm2, tmp_path / "x.gguf", "deepseek-coder")
    with GGUFSource(g) as src, pytest.raises(MfggufError, match="pre-tokenizer 'deepseek-coder' is not one"):
        build_tokenizer(src)
