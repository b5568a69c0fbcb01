"""`mfgguf import-base` of Llama 3.x: `llama3` rope scaling, from a Hugging Face directory and from a GGUF.

A small random `LlamaForCausalLM` with rope_scaling {rope_type: llama3} (its original context short
enough that a 16-wide head has pairs in all three bands: kept, divided by `factor`, blended), converted
by llama.cpp's own convert_hf_to_gguf.py, which writes the factors as `rope_freqs.weight`. Parity:
transformers against the imported trunk in PyTorch and against llama.cpp on the assembled trunk and MoE.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.base.test_import_base import (CHAT, cli, converted, ids_of, max_rel, prepared, tokenizer_json,  # noqa: F401
                                         trunk_gguf)
from tests.converters import llama_logits, reference_logits

ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256}


def save_hf_llama3(out: Path, tokenizer_json: Path, *, tied: bool = False, seed: int = 0, rope: dict | None = ROPE) -> Path:
    """A random Llama 3.x-style LlamaForCausalLM (GQA 4/2 heads, head_dim 16), f32, with a tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = json.loads(tokenizer_json.read_text())
    cfg = LlamaConfig(vocab_size=len(vocab["model"]["vocab"]) + 3, hidden_size=64, intermediate_size=160,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=dict(rope) if rope else None,
                      tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0, initializer_range=0.2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    (out / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
        "add_prefix_space": False, "chat_template": CHAT}))
    return out


def hf_logits(hf: Path, ids: list[int]) -> np.ndarray:
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def rope_freqs(path: Path) -> np.ndarray:
    import gguf

    return next(np.array(t.data) for t in gguf.GGUFReader(path).tensors if t.name == "rope_freqs.weight")


@pytest.fixture(scope="module")
def llama3(tmp_path_factory, tokenizer_json):
    """(HF directory, llama.cpp's f32 conversion of it, transformers' logits, token ids)."""
    d = tmp_path_factory.mktemp("llama3")
    hf = save_hf_llama3(d / "hf", tokenizer_json)
    ids = ids_of(tokenizer_json)
    return hf, converted(hf, d / "base.gguf", "f32"), hf_logits(hf, ids), ids


def test_factors_matter(tmp_path, tokenizer_json, llama3):
    """The scaling changes this model's logits far beyond the tolerances below, so parity proves the factors."""
    hf, base, ref, ids = llama3
    plain = hf_logits(save_hf_llama3(tmp_path / "plain", tokenizer_json, rope=None), ids)
    assert max_rel(plain, ref) > 1e-2, max_rel(plain, ref)
    f = rope_freqs(base)
    assert f.shape == (8,) and f[0] == 1.0 and f[-1] == 8.0 and 1.0 < f[3] < 8.0  # all three bands


def test_hf_import_computes_transformers_logits(tmp_path, llama3):
    hf, base, ref, ids = llama3
    run = prepared(hf, tmp_path / "run", "--expert-ff", "32")
    cfg = json.loads((run / "modules" / "trunk.json").read_text())["config"]
    assert np.allclose(cfg["rope_freq_factors"], rope_freqs(base), rtol=1e-6, atol=0)  # the converter's factors
    g = trunk_gguf(run, tmp_path / "trunk.gguf")
    assert np.array_equal(rope_freqs(g), np.asarray(cfg["rope_freq_factors"], np.float32))
    torch_logits, _ = reference_logits(run, g, ids)
    assert max_rel(torch_logits, ref) <= 1e-4, max_rel(torch_logits, ref)
    got = llama_logits(g, ids, 128)
    assert max_rel(got, ref) <= 1e-3, max_rel(got, ref)


def test_gguf_import_matches_the_base_file(tmp_path, llama3):
    import gguf

    hf, base, ref, ids = llama3
    run = prepared(base, tmp_path / "run")
    g = trunk_gguf(run, tmp_path / "trunk.gguf")
    mine, theirs = {t.name: t for t in gguf.GGUFReader(g).tensors}, {t.name: t for t in gguf.GGUFReader(base).tensors}
    assert sorted(mine) == sorted(theirs) and "rope_freqs.weight" in mine
    for name, t in mine.items():
        assert t.tensor_type == theirs[name].tensor_type and np.array_equal(t.data, theirs[name].data), name
    torch_logits, _ = reference_logits(run, g, ids)
    assert max_rel(torch_logits, ref) <= 1e-4, max_rel(torch_logits, ref)
    got = llama_logits(g, ids, 128)
    assert max_rel(got, ref) <= 1e-3, max_rel(got, ref)
    assert max_rel(got, llama_logits(base, ids, 128)) <= 1e-4


@pytest.mark.parametrize("layout", ["granitemoe", "mixtral"])
def test_untrained_moe_computes_the_base(tmp_path, llama3, layout):
    """Experts equal to the seed: the MoE, rope_freqs and all, is the base before training."""
    from safetensors.numpy import load_file

    from mfgguf.run import RunDir, write_module

    hf, _, ref, ids = llama3
    run = prepared(hf, tmp_path / "run", "--expert-ff", "64")
    rd = RunDir(run)
    trunk = json.loads(rd.module_meta(0).read_text())
    t = load_file(str(rd.module_file(0)))
    seed = {f"blk.{l}.ffn_{f}.weight": t[f"blk.{l}.ffn_{f}_seed.weight"] for l in range(2) for f in ("gate", "up", "down")}
    for i in (1, 2):
        write_module(rd, i, seed, {"kind": "expert", "config": trunk["config"], "trunk_sha256": trunk["sha256"]})
    moe = tmp_path / "moe.gguf"
    r = cli("assemble", run, "-o", moe, "--quant", "f32", "--router", "uniform", "--layout", layout, "-q")
    assert r.exit_code == 0, r.output
    assert "rope_freqs.weight" in {t.name for t in __import__("gguf").GGUFReader(moe).tensors}
    got = llama_logits(moe, ids, 128)
    assert max_rel(got, ref) <= 1e-3, max_rel(got, ref)


def test_other_rope_scaling_is_one_line(tmp_path, tokenizer_json):
    hf = save_hf_llama3(tmp_path / "hf", tokenizer_json, rope={"rope_type": "longrope", "factor": 4.0,
                                                               "short_factor": [1.0] * 8, "long_factor": [1.0] * 8})
    r = cli("import-base", hf, "--out", tmp_path / "out")
    assert r.exit_code == 1 and "rope scaling 'longrope'" in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "out").exists()
