"""`import-base --expert-ff <the base's whole FFN>`: no anchor, experts as wide as the base's FFN (BTX's build).

The trunk keeps its anchor tensors with no units, so every stage reads them as before; the files written from
it hold no shared expert: granitemoe without `_shexp` tensors (llama.cpp's Granite MoE makes them only for a
shared width above 0), mixtral's slots exactly the expert's width. A random `LlamaForCausalLM` (FFN 160 units)
is the base; two experts train over two sync rounds against it; llama.cpp, mfgguf's PyTorch model and
transformers (on the Hugging Face export) compute the same function.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.base.family_cases import one_line, seed_as_experts
from tests.base.test_import_base import (cli, hf_logits, ids_of, max_rel, prepared, save_hf_llama, tokenizer_json,  # noqa: F401
                                         trunk_gguf)
from tests.converters import llama_logits, reference_logits

FF = 160  # save_hf_llama's intermediate_size


def tensors_of(path: Path) -> dict[str, tuple[int, ...]]:
    import gguf

    return {t.name: tuple(int(d) for d in t.shape) for t in gguf.GGUFReader(path).tensors}


def kv_of(path: Path, key: str):
    import gguf

    return gguf.GGUFReader(path).fields[key].contents()


@pytest.fixture(scope="module")
def whole(tmp_path_factory, tokenizer_json):  # noqa: F811
    """(HF base, RUN imported with the whole FFN as the seed, its two experts trained over two sync rounds)."""
    tmp = tmp_path_factory.mktemp("whole")
    hf = save_hf_llama(tmp / "hf", tokenizer_json, tied=False, seed=2)
    run = prepared(hf, tmp / "run", "--expert-ff", str(FF), "--preset", "tiny")
    for _ in (1, 2):
        for i in ("1", "2"):
            r = cli("train-expert", run, "--expert", i, "--tokens", "4096", "--eval-tokens", "512", "--shared", "attn",
                    "--rounds", "2", "--no-progress")
            assert r.exit_code == 0, r.output
        r = cli("sync", run, "--no-progress")
        assert r.exit_code == 0, r.output
    return hf, run


def test_the_trunk_alone_is_the_base_with_an_anchor_of_no_units(tmp_path, tokenizer_json):  # noqa: F811
    from safetensors.numpy import load_file

    hf = save_hf_llama(tmp_path / "hf", tokenizer_json, tied=False, seed=3)
    run = prepared(hf, tmp_path / "run", "--expert-ff", str(FF))
    cfg = json.loads((run / "modules" / "trunk.json").read_text())["config"]
    assert (cfg["anchor_ff"], cfg["expert_ff"], cfg["seed_expert"]) == (0, FF, True)
    t = load_file(str(run / "modules" / "trunk.safetensors"))
    assert t["blk.0.ffn_gate_shexp.weight"].shape == (0, 64) and t["blk.1.ffn_down_shexp.weight"].shape == (64, 0)
    assert t["blk.0.ffn_up_seed.weight"].shape == (FF, 64)
    g = trunk_gguf(run, tmp_path / "trunk.gguf")  # dense: FFN = anchor (none) + seed = the base's FFN
    assert tensors_of(g)["blk.0.ffn_gate.weight"] == (64, FF)
    ids = ids_of(tokenizer_json)
    assert max_rel(llama_logits(g, ids, 128), hf_logits(hf, ids)) < 1e-3


@pytest.mark.parametrize("layout", ["shared-expert", "folded"])
def test_trained_experts_assemble_without_a_shared_expert_and_compute_what_they_trained(tmp_path, whole, layout,
                                                                                          tokenizer_json):  # noqa: F811
    hf, run = whole
    ids = ids_of(tokenizer_json)
    for k in ("1", "2"):
        moe = tmp_path / f"moe-{k}.gguf"
        r = cli("assemble", run, "-o", moe, "--quant", "f32", "--layout", layout, "--top-k", k, "-q")
        assert r.exit_code == 0, r.output
        names = tensors_of(moe)
        assert not [n for n in names if "shexp" in n]
        assert names["blk.0.ffn_gate_exps.weight"] == (64, FF, 2)  # ggml order: (dim, expert width, experts)
        got, (want, _) = llama_logits(moe, ids, 128), reference_logits(run, moe, ids)
        assert max_rel(got, want) <= 1e-3 < max_rel(got, hf_logits(hf, ids)), max_rel(got, want)
    if layout == "shared-expert":
        assert kv_of(moe, "granitemoe.expert_shared_feed_forward_length") == 0


def test_the_hf_export_of_a_file_without_a_shared_expert_computes_it(tmp_path, whole, tokenizer_json):  # noqa: F811
    import torch
    from transformers import AutoModelForCausalLM

    _, run = whole
    moe = tmp_path / "moe.gguf"
    assert cli("assemble", run, "-o", moe, "--quant", "f32", "--top-k", "2", "-q").exit_code == 0
    r = cli("export-hf", moe, "-o", tmp_path / "hf-out")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "hf-out" / "config.json").read_text())["shared_intermediate_size"] == 0
    ids = ids_of(tokenizer_json)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf-out", dtype=torch.float32).eval()
    with torch.no_grad():
        hf = model(torch.tensor([ids])).logits[0].numpy()
    assert max_rel(hf, llama_logits(moe, ids, 128)) < 1e-3


def test_a_wider_seed_than_the_base_has_and_qwen2moe_without_an_anchor_are_one_line(tmp_path, tokenizer_json):  # noqa: F811
    from tests.base.test_import_qwen2 import save_hf_qwen2

    hf = save_hf_llama(tmp_path / "hf", tokenizer_json, tied=False, seed=4)
    one_line(cli("import-base", hf, "--out", tmp_path / "wide", "--expert-ff", str(FF + 1)),
             f"must be between 1 and the base's FFN width {FF}")
    assert not (tmp_path / "wide").exists()
    q = save_hf_qwen2(tmp_path / "qwen2", tokenizer_json)
    run = prepared(q, tmp_path / "run", "--expert-ff", str(FF))
    seed_as_experts(run)
    one_line(cli("assemble", run, "-o", tmp_path / "q.gguf", "--quant", "f32", "--router", "uniform", "-q"),
             "needs a shared expert; pass --layout folded")
    assert not (tmp_path / "q.gguf").exists()
    r = cli("assemble", run, "-o", tmp_path / "q.gguf", "--quant", "f32", "--router", "uniform", "--layout", "folded", "-q")
    assert r.exit_code == 0, r.output
    import torch
    from transformers import Qwen2ForCausalLM

    ids = ids_of(tokenizer_json)
    with torch.no_grad():
        ref = Qwen2ForCausalLM.from_pretrained(q, dtype=torch.float32).eval()(torch.tensor([ids])).logits[0].numpy()
    assert max_rel(llama_logits(tmp_path / "q.gguf", ids, 128), ref) < 1e-3  # two copies of the seed: the base
