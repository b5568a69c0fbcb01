"""`mfgguf import-base` of Qwen2 / Qwen2.5: Q/K/V biases, NEOX RoPE, tied embeddings, the qwen2 pre-tokenizer.

A small random `Qwen2ForCausalLM` (tied embeddings, biases away from zero so that a dropped one shows),
saved by transformers and converted by llama.cpp's own convert_hf_to_gguf.py. Parity
(tests/base/family_cases.py): transformers against the imported trunk in PyTorch, and against llama.cpp
on the assembled `qwen2` trunk and the untrained `qwen2moe` MoE (whose shared expert is the anchor behind
a constant 0.5 gate).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.base.family_cases import (arch, extends_as_assembled, family_case, gguf_import_matches, hf_import_computes,
                                     import_refused, save_random, synced_moe_computes, untrained_moe_computes,
                                     with_config)
from tests.base.test_import_base import cli, max_rel, prepared, tokenizer_json, trunk_gguf  # noqa: F401
from tests.converters import llama_logits, llama_tokenize, reference_logits, text_sample


def save_hf_qwen2(out: Path, tokenizer_json: Path, *, tied: bool = True, seed: int = 0, **extra) -> Path:
    """A random Qwen2ForCausalLM (head_dim 16), its Q/K/V biases drawn away from zero."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return save_random(out, tokenizer_json, Qwen2ForCausalLM, Qwen2Config, seed=seed, biases=True,
                       max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=tied,
                       **extra)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, tokenizer_json):
    return family_case(tmp_path_factory.mktemp("qwen2"), tokenizer_json, save_hf_qwen2)


def test_hf_import_computes_transformers_logits(tmp_path, qwen2):
    hf_import_computes(tmp_path, qwen2, "qwen2")


def test_gguf_import_matches_the_base_file(tmp_path, qwen2):
    assert arch(qwen2[1]) == "qwen2"
    gguf_import_matches(tmp_path, qwen2, "blk.0.attn_q.bias", tied=True)


def test_untrained_qwen2moe_computes_the_base(tmp_path, qwen2):
    """Experts equal to the seed, the anchor as the gated shared expert: before training, the MoE is the base.

    qwen2moe does not renormalise the top-k weights, so both experts are used (0.5 + 0.5 of the seed)."""
    import gguf

    _, _, ref, ids = qwen2
    run, moe, t, got = untrained_moe_computes(tmp_path, qwen2, "--top-k", "2")
    tensors = {x.name: np.array(x.data) for x in gguf.GGUFReader(moe).tensors}
    assert arch(moe) == "qwen2moe" and np.array_equal(tensors["blk.0.ffn_down_shexp.weight"], 2 * t["blk.0.ffn_down_shexp.weight"])
    torch_logits, _ = reference_logits(run, moe, ids)
    assert max_rel(got, torch_logits) <= 1e-3, max_rel(got, torch_logits)
    # top-1: qwen2moe weights the expert by its softmax probability (1/2 here), and the reference says so too
    r = cli("assemble", run, "-o", tmp_path / "top1.gguf", "--quant", "f32", "--router", "uniform", "-q")
    assert r.exit_code == 0, r.output
    got1, (torch1, _) = llama_logits(tmp_path / "top1.gguf", ids, 128), reference_logits(run, tmp_path / "top1.gguf", ids)
    assert max_rel(got1, torch1) <= 1e-3 < max_rel(got1, ref), (max_rel(got1, torch1), max_rel(got1, ref))


def test_qwen2_pre_tokenizer_tokenizes_the_same_in_llama_cpp(tmp_path):
    """Qwen2's pre-tokenizer (Split regex, digits one by one + ByteLevel) maps to llama.cpp's `qwen2`."""
    import gguf
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from mfgguf.base.hf_vocab import QWEN2_REGEX

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text_sample(60_000)] * 2, trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tj = tmp_path / "tokenizer.json"
    tok.save(str(tj))
    hf = save_hf_qwen2(tmp_path / "hf", tj)
    g = trunk_gguf(prepared(hf, tmp_path / "run"), tmp_path / "trunk.gguf")
    assert gguf.GGUFReader(g).get_field("tokenizer.ggml.pre").contents() == "qwen2"
    text = "Don'T stop: 1234567 dogs' TOYS\r\n\n\t  x=1+2;  ünïcödé 日本語 -- " + text_sample(2000)
    assert llama_tokenize(g, text) == tok.encode(text).ids


def test_unsupported_is_one_line(tmp_path, tokenizer_json):
    # another architecture, by its config
    moe = with_config(save_hf_qwen2(tmp_path / "moe", tokenizer_json), architectures=["Qwen2MoeForCausalLM"])
    swa = save_hf_qwen2(tmp_path / "swa", tokenizer_json, use_sliding_window=True, sliding_window=32, max_window_layers=0)
    for src, what in ((moe, "Qwen2MoeForCausalLM; import-base reads"), (swa, "sliding-window attention")):
        import_refused(src, tmp_path / "out", what)


def test_trained_expert_assembles_as_it_trained(tmp_path, qwen2):
    """An expert trained against the imported trunk (biases loaded from it), alone in a qwen2moe: its one
    softmax weight is 1, so llama.cpp computes the training forward."""
    hf, _, ref, ids = qwen2
    run = prepared(hf, tmp_path / "run", "--expert-ff", "32", "--preset", "tiny")
    r = cli("train-expert", run, "--expert", "1", "--no-progress")
    assert r.exit_code == 0, r.output
    moe = tmp_path / "moe.gguf"
    r = cli("assemble", run, "-o", moe, "--experts", "1", "--quant", "f32", "--router", "uniform", "-q")
    assert r.exit_code == 0, r.output
    got, (want, _) = llama_logits(moe, ids, 128), reference_logits(run, moe, ids)
    assert max_rel(got, want) <= 1e-3 < max_rel(got, ref), (max_rel(got, want), max_rel(got, ref))


def test_mixtral_layout_is_exact_at_top_1(tmp_path, qwen2):
    """--layout folded: a `llama` file (Q/K rows and biases permuted to adjacent-pair RoPE, the anchor folded
    into every expert), whose top-k weights are renormalised: top-1 of two untrained experts is the base."""
    import gguf

    from mfgguf.base.source import rope_permute

    _, moe, t, _ = untrained_moe_computes(tmp_path, qwen2, "--layout", "folded")
    tensors = {x.name: np.array(x.data) for x in gguf.GGUFReader(moe).tensors}
    assert arch(moe) == "llama" and np.array_equal(tensors["blk.1.attn_k.bias"], rope_permute(t["blk.1.attn_k.bias"], 2))


def test_extend_and_calibrate_work_on_qwen2moe(tmp_path, qwen2):
    """A qwen2moe file takes a later expert with `extend` (the bytes `assemble` writes for both), and `calibrate`
    searches the router temperature at top-1 too: qwen2moe weights the chosen expert by its probability, so the
    temperature changes the output, where a graph that renormalises makes it idle."""
    from mfgguf.converters.routing.calibrate import CalibrationGrid, calibrate

    run, _, both = extends_as_assembled(tmp_path, qwen2[0], "qwen2moe")
    cal = calibrate(both, run, tmp_path / "cal.gguf", grid=CalibrationGrid(top_k=(1,), temperature=(0.5, 2.0)),
                    tokens=512, progress=False)
    top1 = {c["temperature"]: c["ppl"] for c in cal["candidates"] if c["top_k"] == 1}
    assert {0.5, 2.0} <= set(top1) and top1[0.5] != top1[2.0], cal["candidates"]


def test_sync_rounds_work_on_qwen2moe(tmp_path, qwen2):
    """Experts with private attention copies over two sync rounds: the qwen2moe file of the synced run is its
    reference forward, with the merged Q/K/V beside the imported biases they were trained with (`--shared attn`
    copies no bias), and the anchor, which no expert copies, still the shared expert behind its 0.5 gate."""
    from safetensors.numpy import load_file

    from mfgguf.run import RunDir

    run, _, tensors = synced_moe_computes(tmp_path, qwen2, "qwen2moe", "blk.0.attn_q.bias")
    trunk = load_file(str(RunDir(run).module_file(0)))
    assert np.array_equal(tensors["blk.1.ffn_down_shexp.weight"], 2 * trunk["blk.1.ffn_down_shexp.weight"])
