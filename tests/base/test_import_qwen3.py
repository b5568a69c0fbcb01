"""`mfgguf import-base` of Qwen3: per-head Q/K RMSNorm, NEOX RoPE, a head width of its own, no biases.

A small random `Qwen3ForCausalLM` (head_dim 32 with a 64-wide residual and 4 heads, so Q is wider than
the residual; tied embeddings; Q/K norms away from 1), saved by transformers and converted by llama.cpp's
own convert_hf_to_gguf.py. Parity (tests/base/family_cases.py): transformers against the imported trunk
in PyTorch, and against llama.cpp on the assembled `qwen3` trunk and the untrained `qwen3moe` MoE (the
anchor folded into every expert: qwen3moe has no shared expert but renormalises the top-k weights).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.base.family_cases import (arch, extends_as_assembled, family_case, gguf_import_matches, hf_import_computes,
                                     import_refused, one_line, save_random, synced_moe_computes,
                                     untrained_moe_computes, with_config)
from tests.base.test_import_base import cli, prepared, tokenizer_json  # noqa: F401


def save_hf_qwen3(out: Path, tokenizer_json: Path, *, seed: int = 0) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return save_random(out, tokenizer_json, Qwen3ForCausalLM, Qwen3Config, seed=seed, head_dim=32,
                       max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, tokenizer_json):
    return family_case(tmp_path_factory.mktemp("qwen3"), tokenizer_json, save_hf_qwen3)


def test_hf_import_computes_transformers_logits(tmp_path, qwen3):
    run, _ = hf_import_computes(tmp_path, qwen3, "qwen3")
    assert json.loads((run / "modules" / "trunk.json").read_text())["config"]["attn_head_dim"] == 32


def test_gguf_import_matches_the_base_file(tmp_path, qwen3):
    assert arch(qwen3[1]) == "qwen3"
    gguf_import_matches(tmp_path, qwen3, "blk.0.attn_q_norm.weight", tied=True)


def test_untrained_qwen3moe_computes_the_base(tmp_path, qwen3):
    run, moe, _, _ = untrained_moe_computes(tmp_path, qwen3)  # --layout auto: qwen3moe
    assert arch(moe) == "qwen3moe"
    r = cli("assemble", run, "-o", tmp_path / "g.gguf", "--quant", "f32", "--router", "uniform", "--layout", "shared-expert")
    one_line(r, "--layout folded")


def test_unsupported_is_one_line(tmp_path, tokenizer_json):
    biased = with_config(save_hf_qwen3(tmp_path / "biased", tokenizer_json), attention_bias=True)
    import_refused(biased, tmp_path / "out", "attention_bias")


def test_extend_works_on_qwen3moe(tmp_path, tokenizer_json):
    """qwen3moe, Qwen3's only MoE layout, folds the anchor into every expert; `extend` rebuilds a later expert's
    slot with it: the bytes `assemble` writes for both, and removing the expert gives the first file back."""
    _, one, both = extends_as_assembled(tmp_path, save_hf_qwen3(tmp_path / "hf", tokenizer_json), "qwen3moe")
    back = tmp_path / "back.gguf"
    r = cli("extend", both, "--remove", "2", "-o", back)
    assert r.exit_code == 0, r.output
    assert back.read_bytes() == one.read_bytes()


def test_sync_rounds_work_on_qwen3moe(tmp_path, qwen3):
    """Experts with private attention copies over two sync rounds: the qwen3moe file of the synced run (the anchor
    folded into every expert) is its reference forward, with the merged Q/K beside the per-head Q/K norms they were
    trained with, as imported (`--shared attn` copies no Q/K norm)."""
    synced_moe_computes(tmp_path, qwen3, "qwen3moe", "blk.1.attn_k_norm.weight")
