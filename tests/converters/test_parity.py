"""Parity: llama.cpp's logits for an assembled f32 GGUF == the PyTorch reference of the same MoE.

Both layouts, top-1 and top-2, and the dense trunk-alone file; q8_0 perplexity within 1% of f32;
llama.cpp's tokenization == tokenizer.json. Run on the real trained tiny pipeline (`trained_run`)
and on a synthetic run with order-one random weights (which does not depend on training).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from mfgguf.converters.assemble import assemble

from . import llama_logits, llama_tokenize, nll, reference_logits, rel_diff, synthetic_run, text_sample

CASES = [("shared-expert", 1, None), ("shared-expert", 2, None), ("folded", 1, None), ("folded", 2, None),
         ("shared-expert", 1, [])]


@pytest.fixture(scope="module")
def syn_run(tmp_path_factory):
    return synthetic_run(tmp_path_factory.mktemp("syn") / "run", preset="tiny", n_experts=3, vocab=512)


@pytest.fixture(scope="module", params=["trained", "synthetic"])
def any_run(request):
    return request.getfixturevalue("trained_run" if request.param == "trained" else "syn_run")


def _ids(run, n):
    tok = Tokenizer.from_file(str(run / "tokenizer.json"))
    return tok.encode(text_sample()).ids[:n]


def _routes(model, ids):
    """Expert chosen first per token and layer, from the reference's own router."""
    chosen = []

    def hook(layer, n):  # n: (1, T, C) after ffn_norm
        chosen.append((n[0] @ model.layers[layer].router.T).argmax(-1))

    with torch.no_grad():
        model(torch.tensor([ids]), route="router", hook=hook)
    return torch.cat(chosen)


@pytest.mark.parametrize("layout,top_k,experts", CASES, ids=[f"{a}-top{k}-{'dense' if e == [] else 'moe'}" for a, k, e in CASES])
def test_llama_cpp_logits_match_reference(any_run, tmp_path, layout, top_k, experts):
    out = tmp_path / "m.gguf"
    assemble(any_run, out, quant="f32", top_k=top_k, layout=layout, experts=experts, progress=False)
    ctx = 64  # the tiny preset's context
    ids = _ids(any_run, ctx)
    got = llama_logits(out, ids, ctx)
    ref, model = reference_logits(any_run, out, ids)
    assert got.shape == ref.shape
    assert rel_diff(got, ref) <= 1e-3, rel_diff(got, ref)
    if experts is None:
        assert len(torch.unique(_routes(model, ids))) > 1  # the router really routes


def test_q8_0_perplexity_within_1pct_of_f32(any_run, tmp_path):
    ids = _ids(any_run, 64)
    res = {}
    for q in ("f32", "q8_0"):
        assemble(any_run, tmp_path / f"{q}.gguf", quant=q, progress=False)
        res[q] = np.exp(nll(llama_logits(tmp_path / f"{q}.gguf", ids, 64), ids))
    assert abs(res["q8_0"] / res["f32"] - 1) <= 0.01, res


def test_llama_cpp_tokenizes_like_tokenizer_json(any_run, tmp_path):
    out = tmp_path / "m.gguf"
    assemble(any_run, out, quant="q8_0", experts=[], progress=False)
    text = text_sample(20_000) + "\n\tdef f(x):\n        return x ** 2  # ünïcödé, 日本語 😀\n"
    tok = Tokenizer.from_file(str(any_run / "tokenizer.json"))
    assert llama_tokenize(out, text) == tok.encode(text).ids
