"""`mfgguf import-base` of Qwen3: per-head Q/K RMSNorm, NEOX RoPE, a head width of its own, no biases.

A small random `Qwen3ForCausalLM` (head_dim 32 with a 64-wide residual and 4 heads, so Q is wider than
the residual; tied embeddings; Q/K norms away from 1), saved by transformers and converted by llama.cpp's
own convert_hf_to_gguf.py. Parity: transformers against the imported trunk in PyTorch, and against
llama.cpp on the assembled `qwen3` trunk and the untrained `qwen3moe` MoE (the anchor folded into every
expert: qwen3moe has no shared expert but renormalises the top-k weights).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.base.test_import_base import (CHAT, cli, converted, ids_of, max_rel, prepared, tokenizer_json,  # noqa: F401
                                         trunk_gguf)
from tests.converters import llama_logits, reference_logits


def save_hf_qwen3(out: Path, tokenizer_json: Path, *, seed: int = 0) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    vocab = json.loads(tokenizer_json.read_text())
    cfg = Qwen3Config(vocab_size=len(vocab["model"]["vocab"]) + 3, hidden_size=64, intermediate_size=160,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                      bos_token_id=0, eos_token_id=0, initializer_range=0.2)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # the Q/K norms too
    model.save_pretrained(out)
    (out / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": None,
        "chat_template": CHAT}))
    return out


def hf_logits(hf: Path, ids: list[int]) -> np.ndarray:
    import torch
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def arch(path: Path) -> str:
    import gguf

    return gguf.GGUFReader(path).get_field("general.architecture").contents()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, tokenizer_json):
    d = tmp_path_factory.mktemp("qwen3")
    hf = save_hf_qwen3(d / "hf", tokenizer_json)
    ids = ids_of(tokenizer_json)
    return hf, converted(hf, d / "base.gguf", "f32"), hf_logits(hf, ids), ids


def test_hf_import_computes_transformers_logits(tmp_path, qwen3):
    hf, _, ref, ids = qwen3
    run = prepared(hf, tmp_path / "run", "--expert-ff", "32")
    assert json.loads((run / "modules" / "trunk.json").read_text())["config"]["attn_head_dim"] == 32
    g = trunk_gguf(run, tmp_path / "trunk.gguf")
    assert arch(g) == "qwen3"
    torch_logits, _ = reference_logits(run, g, ids)
    assert max_rel(torch_logits, ref) <= 1e-4, max_rel(torch_logits, ref)
    got = llama_logits(g, ids, 128)
    assert max_rel(got, ref) <= 1e-3, max_rel(got, ref)


def test_gguf_import_matches_the_base_file(tmp_path, qwen3):
    import gguf

    hf, base, ref, ids = qwen3
    assert arch(base) == "qwen3"
    run = prepared(base, tmp_path / "run")
    g = trunk_gguf(run, tmp_path / "trunk.gguf")
    mine, theirs = {t.name: t for t in gguf.GGUFReader(g).tensors}, {t.name: t for t in gguf.GGUFReader(base).tensors}
    theirs.setdefault("output.weight", theirs["token_embd.weight"])
    assert sorted(mine) == sorted(theirs) and "blk.0.attn_q_norm.weight" in mine
    for name, t in mine.items():
        assert t.tensor_type == theirs[name].tensor_type and np.array_equal(t.data, theirs[name].data), name
    torch_logits, _ = reference_logits(run, g, ids)
    assert max_rel(torch_logits, ref) <= 1e-4, max_rel(torch_logits, ref)
    got = llama_logits(g, ids, 128)
    assert max_rel(got, ref) <= 1e-3, max_rel(got, ref)


def test_untrained_qwen3moe_computes_the_base(tmp_path, qwen3):
    from safetensors.numpy import load_file

    from mfgguf.run import RunDir, write_module

    hf, _, ref, ids = qwen3
    run = prepared(hf, tmp_path / "run", "--expert-ff", "64")
    rd = RunDir(run)
    trunk = json.loads(rd.module_meta(0).read_text())
    t = load_file(str(rd.module_file(0)))
    seed = {f"blk.{l}.ffn_{f}.weight": t[f"blk.{l}.ffn_{f}_seed.weight"] for l in range(2) for f in ("gate", "up", "down")}
    for i in (1, 2):
        write_module(rd, i, seed, {"kind": "expert", "config": trunk["config"], "trunk_sha256": trunk["sha256"]})
    moe = tmp_path / "moe.gguf"
    r = cli("assemble", run, "-o", moe, "--quant", "f32", "--router", "uniform", "-q")  # --layout auto: qwen3moe
    assert r.exit_code == 0, r.output
    assert arch(moe) == "qwen3moe"
    got = llama_logits(moe, ids, 128)
    assert max_rel(got, ref) <= 1e-3, max_rel(got, ref)
    r = cli("assemble", run, "-o", tmp_path / "g.gguf", "--quant", "f32", "--router", "uniform", "--layout", "granitemoe")
    assert r.exit_code == 1 and "--layout mixtral" in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_unsupported_is_one_line(tmp_path, tokenizer_json):
    biased = save_hf_qwen3(tmp_path / "biased", tokenizer_json)
    cfg = json.loads((biased / "config.json").read_text())
    (biased / "config.json").write_text(json.dumps({**cfg, "attention_bias": True}))
    r = cli("import-base", biased, "--out", tmp_path / "out")
    assert r.exit_code == 1 and "attention_bias" in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "out").exists()
