"""`mfgguf import-base` of Llama 3.x: `llama3` rope scaling, from a Hugging Face directory and from a GGUF.

A small random `LlamaForCausalLM` with rope_scaling {rope_type: llama3} (its original context short
enough that a 16-wide head has pairs in all three bands: kept, divided by `factor`, blended), converted
by llama.cpp's own convert_hf_to_gguf.py, which writes the factors as `rope_freqs.weight`. Parity
(tests/base/family_cases.py): transformers against the imported trunk in PyTorch and against llama.cpp
on the assembled trunk and MoE.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.base.family_cases import (family_case, gguf_import_matches, hf_import_computes, hf_logits, import_refused,
                                     save_random, untrained_moe_computes)
from tests.base.test_import_base import max_rel, tokenizer_json  # noqa: F401
from tests.converters import llama_logits

ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256}


def save_hf_llama3(out: Path, tokenizer_json: Path, *, tied: bool = False, seed: int = 0, rope: dict | None = ROPE) -> Path:
    """A random Llama 3.x-style LlamaForCausalLM (head_dim 16), its BOS the EOS token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return save_random(out, tokenizer_json, LlamaForCausalLM, LlamaConfig, seed=seed, bos="<|endoftext|>",
                       tokenizer={"add_prefix_space": False}, max_position_embeddings=2048, rms_norm_eps=1e-5,
                       rope_theta=10000.0, rope_scaling=dict(rope) if rope else None, tie_word_embeddings=tied)


def rope_freqs(path: Path) -> np.ndarray:
    import gguf

    return next(np.array(t.data) for t in gguf.GGUFReader(path).tensors if t.name == "rope_freqs.weight")


@pytest.fixture(scope="module")
def llama3(tmp_path_factory, tokenizer_json):
    return family_case(tmp_path_factory.mktemp("llama3"), tokenizer_json, save_hf_llama3)


def test_factors_matter(tmp_path, tokenizer_json, llama3):
    """The scaling changes this model's logits far beyond the tolerances below, so parity proves the factors."""
    hf, base, ref, ids = llama3
    plain = hf_logits(save_hf_llama3(tmp_path / "plain", tokenizer_json, rope=None), ids)
    assert max_rel(plain, ref) > 1e-2, max_rel(plain, ref)
    f = rope_freqs(base)
    assert f.shape == (8,) and f[0] == 1.0 and f[-1] == 8.0 and 1.0 < f[3] < 8.0  # all three bands


def test_hf_import_computes_transformers_logits(tmp_path, llama3):
    run, g = hf_import_computes(tmp_path, llama3)
    cfg = json.loads((run / "modules" / "trunk.json").read_text())["config"]
    assert np.allclose(cfg["rope_freq_factors"], rope_freqs(llama3[1]), rtol=1e-6, atol=0)  # the converter's factors
    assert np.array_equal(rope_freqs(g), np.asarray(cfg["rope_freq_factors"], np.float32))


def test_gguf_import_matches_the_base_file(tmp_path, llama3):
    _, base, _, ids = llama3
    g, got = gguf_import_matches(tmp_path, llama3, "rope_freqs.weight", tied=False)
    assert max_rel(got, llama_logits(base, ids, 128)) <= 1e-4


@pytest.mark.parametrize("layout", ["shared-expert", "folded"])
def test_untrained_moe_computes_the_base(tmp_path, llama3, layout):
    """Experts equal to the seed: the MoE, rope_freqs and all, is the base before training."""
    import gguf

    _, moe, _, _ = untrained_moe_computes(tmp_path, llama3, "--layout", layout)
    assert "rope_freqs.weight" in {t.name for t in gguf.GGUFReader(moe).tensors}


def test_other_rope_scaling_is_one_line(tmp_path, tokenizer_json):
    hf = save_hf_llama3(tmp_path / "hf", tokenizer_json, rope={"rope_type": "longrope", "factor": 4.0,
                                                               "short_factor": [1.0] * 8, "long_factor": [1.0] * 8})
    import_refused(hf, tmp_path / "out", "rope scaling 'longrope'")
