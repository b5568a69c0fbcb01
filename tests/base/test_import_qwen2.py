"""`mfgguf import-base` of Qwen2 / Qwen2.5: Q/K/V biases, NEOX RoPE, tied embeddings, the qwen2 pre-tokenizer.

A small random `Qwen2ForCausalLM` (tied embeddings, biases away from zero so that a dropped one shows),
saved by transformers and converted by llama.cpp's own convert_hf_to_gguf.py. Parity: transformers
against the imported trunk in PyTorch, and against llama.cpp on the assembled `qwen2` trunk and the
untrained `qwen2moe` MoE (whose shared expert is the anchor behind a constant 0.5 gate).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.base.test_import_base import (CHAT, cli, converted, ids_of, max_rel, prepared, tokenizer_json,  # noqa: F401
                                         trunk_gguf)
from tests.converters import llama_logits, llama_tokenize, reference_logits, text_sample


def save_hf_qwen2(out: Path, tokenizer_json: Path, *, tied: bool = True, seed: int = 0, **extra) -> Path:
    """A random Qwen2ForCausalLM (GQA 4/2 heads, head_dim 16), f32, with a tokenizer and chat template."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab = json.loads(tokenizer_json.read_text())
    cfg = Qwen2Config(vocab_size=len(vocab["model"]["vocab"]) + 3, hidden_size=64, intermediate_size=160,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=tied, bos_token_id=0,
                      eos_token_id=0, initializer_range=0.2, **extra)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(out)
    (out / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": None,
        "chat_template": CHAT}))
    return out


def hf_logits(hf: Path, ids: list[int]) -> np.ndarray:
    import torch
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def arch(path: Path) -> str:
    import gguf

    return gguf.GGUFReader(path).get_field("general.architecture").contents()


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, tokenizer_json):
    """(HF directory, llama.cpp's f32 conversion of it, transformers' logits, token ids)."""
    d = tmp_path_factory.mktemp("qwen2")
    hf = save_hf_qwen2(d / "hf", tokenizer_json)
    ids = ids_of(tokenizer_json)
    return hf, converted(hf, d / "base.gguf", "f32"), hf_logits(hf, ids), ids


def test_hf_import_computes_transformers_logits(tmp_path, qwen2):
    hf, _, ref, ids = qwen2
    run = prepared(hf, tmp_path / "run", "--expert-ff", "32")
    g = trunk_gguf(run, tmp_path / "trunk.gguf")
    assert arch(g) == "qwen2"
    torch_logits, _ = reference_logits(run, g, ids)
    assert max_rel(torch_logits, ref) <= 1e-4, max_rel(torch_logits, ref)
    got = llama_logits(g, ids, 128)
    assert max_rel(got, ref) <= 1e-3, max_rel(got, ref)


def test_gguf_import_matches_the_base_file(tmp_path, qwen2):
    import gguf

    hf, base, ref, ids = qwen2
    assert arch(base) == "qwen2"
    run = prepared(base, tmp_path / "run")
    g = trunk_gguf(run, tmp_path / "trunk.gguf")
    mine, theirs = {t.name: t for t in gguf.GGUFReader(g).tensors}, {t.name: t for t in gguf.GGUFReader(base).tensors}
    theirs.setdefault("output.weight", theirs["token_embd.weight"])  # tied: the trunk writes the head
    assert sorted(mine) == sorted(theirs) and "blk.0.attn_q.bias" in mine
    for name, t in mine.items():
        assert t.tensor_type == theirs[name].tensor_type and np.array_equal(t.data, theirs[name].data), name
    torch_logits, _ = reference_logits(run, g, ids)
    assert max_rel(torch_logits, ref) <= 1e-4, max_rel(torch_logits, ref)
    got = llama_logits(g, ids, 128)
    assert max_rel(got, ref) <= 1e-3, max_rel(got, ref)


def test_untrained_qwen2moe_computes_the_base(tmp_path, qwen2):
    """Experts equal to the seed, the anchor as the gated shared expert: before training, the MoE is the base.

    qwen2moe does not renormalise the top-k weights, so both experts are used (0.5 + 0.5 of the seed)."""
    import gguf
    from safetensors.numpy import load_file

    from mfgguf.run import RunDir, write_module

    hf, _, ref, ids = qwen2
    run = prepared(hf, tmp_path / "run", "--expert-ff", "64")
    rd = RunDir(run)
    trunk = json.loads(rd.module_meta(0).read_text())
    t = load_file(str(rd.module_file(0)))
    seed = {f"blk.{l}.ffn_{f}.weight": t[f"blk.{l}.ffn_{f}_seed.weight"] for l in range(2) for f in ("gate", "up", "down")}
    for i in (1, 2):
        write_module(rd, i, seed, {"kind": "expert", "config": trunk["config"], "trunk_sha256": trunk["sha256"]})
    moe = tmp_path / "moe.gguf"
    r = cli("assemble", run, "-o", moe, "--quant", "f32", "--router", "uniform", "--top-k", "2", "-q")
    assert r.exit_code == 0, r.output
    tensors = {x.name: np.array(x.data) for x in gguf.GGUFReader(moe).tensors}
    assert arch(moe) == "qwen2moe" and np.array_equal(tensors["blk.0.ffn_down_shexp.weight"], 2 * t["blk.0.ffn_down_shexp.weight"])
    got = llama_logits(moe, ids, 128)
    assert max_rel(got, ref) <= 1e-3, max_rel(got, ref)
    torch_logits, _ = reference_logits(run, moe, ids)
    assert max_rel(got, torch_logits) <= 1e-3, max_rel(got, torch_logits)
    # top-1: qwen2moe weights the expert by its softmax probability (1/2 here), and the reference says so too
    r = cli("assemble", run, "-o", tmp_path / "top1.gguf", "--quant", "f32", "--router", "uniform", "-q")
    assert r.exit_code == 0, r.output
    got1, (torch1, _) = llama_logits(tmp_path / "top1.gguf", ids, 128), reference_logits(run, tmp_path / "top1.gguf", ids)
    assert max_rel(got1, torch1) <= 1e-3 < max_rel(got1, ref), (max_rel(got1, torch1), max_rel(got1, ref))


def test_qwen2_pre_tokenizer_tokenizes_the_same_in_llama_cpp(tmp_path):
    """Qwen2's pre-tokenizer (Split regex, digits one by one + ByteLevel) maps to llama.cpp's `qwen2`."""
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
    import gguf

    assert gguf.GGUFReader(g).get_field("tokenizer.ggml.pre").contents() == "qwen2"
    text = "Don'T stop: 1234567 dogs' TOYS\r\n\n\t  x=1+2;  ünïcödé 日本語 -- " + text_sample(2000)
    assert llama_tokenize(g, text) == tok.encode(text).ids


def test_unsupported_is_one_line(tmp_path, tokenizer_json):
    moe = save_hf_qwen2(tmp_path / "moe", tokenizer_json)  # another architecture, by its config
    cfg = json.loads((moe / "config.json").read_text())
    (moe / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen2MoeForCausalLM"]}))
    swa = save_hf_qwen2(tmp_path / "swa", tokenizer_json, use_sliding_window=True, sliding_window=32, max_window_layers=0)
    for src, what in ((moe, "Qwen2MoeForCausalLM; import-base reads"), (swa, "sliding-window attention")):
        r = cli("import-base", src, "--out", tmp_path / "out")
        assert r.exit_code == 1 and what in r.output and len(r.output.strip().splitlines()) == 1, r.output
        assert not (tmp_path / "out").exists()


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
    """--layout mixtral: a `llama` file (Q/K rows and biases permuted to adjacent-pair RoPE, the anchor folded
    into every expert), whose top-k weights are renormalised: top-1 of two untrained experts is the base."""
    import gguf
    from safetensors.numpy import load_file

    from mfgguf.base.source import rope_permute
    from mfgguf.run import RunDir, write_module

    hf, _, ref, ids = qwen2
    run = prepared(hf, tmp_path / "run", "--expert-ff", "64")
    rd = RunDir(run)
    trunk = json.loads(rd.module_meta(0).read_text())
    t = load_file(str(rd.module_file(0)))
    seed = {f"blk.{l}.ffn_{f}.weight": t[f"blk.{l}.ffn_{f}_seed.weight"] for l in range(2) for f in ("gate", "up", "down")}
    for i in (1, 2):
        write_module(rd, i, seed, {"kind": "expert", "config": trunk["config"], "trunk_sha256": trunk["sha256"]})
    moe = tmp_path / "moe.gguf"
    r = cli("assemble", run, "-o", moe, "--quant", "f32", "--router", "uniform", "--layout", "mixtral", "-q")
    assert r.exit_code == 0, r.output
    tensors = {x.name: np.array(x.data) for x in gguf.GGUFReader(moe).tensors}
    assert arch(moe) == "llama" and np.array_equal(tensors["blk.1.attn_k.bias"], rope_permute(t["blk.1.attn_k.bias"], 2))
    got = llama_logits(moe, ids, 128)
    assert max_rel(got, ref) <= 1e-3, max_rel(got, ref)
