"""Perplexity by llama.cpp: windowing as llama-perplexity, per-domain figures, the PyTorch reference."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.errors import MfggufError
from mfgguf.run import RunDir
from mfgguf.runtime.llm import loaded, read_header
from mfgguf.runtime.perplexity import perplexity, perplexity_by_domain


def _test_tokens(run, n=None) -> dict:
    rd = RunDir(run)
    names = sorted(p.stem for p in rd.test_dir.glob("*.npy"))
    return {d: np.load(rd.test(d), allow_pickle=False)[:n].astype(np.int64) for d in names}


def _log_softmax(x):  # x: (T, V) float64
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_windowing_matches_numpy_recomputation(tiny_gguf, trained_run):
    ctx = 32
    toks = next(iter(_test_tokens(trained_run).values()))[: 3 * ctx + 11]  # 3 windows and a tail that is dropped
    r = perplexity(tiny_gguf, toks, ctx=ctx)
    assert (r["n_windows"], r["ctx"], r["n_input_tokens"]) == (3, ctx, len(toks))
    assert r["n_tokens"] == 3 * (ctx - 1 - ctx // 2)
    nll, n = 0.0, 0
    for w in range(3):  # every window in a model of its own: nothing can carry over
        ids = toks[w * ctx : (w + 1) * ctx]
        with loaded(tiny_gguf, n_ctx=ctx, logits_all=True, flash_attn=True) as llm:  # as perplexity opens it
            first = ids.tolist()
            if llm._model.add_bos_token():
                first[0] = llm.token_bos()
            llm.eval(first)
            logp = _log_softmax(np.array(llm.scores[:ctx], dtype=np.float64))  # (ctx, V) all positions
        pos = np.arange(ctx // 2, ctx - 1)  # positions whose prediction is scored
        nll -= logp[pos, ids[pos + 1]].sum()
        n += len(pos)
    assert n == r["n_tokens"]
    assert r["nll"] == pytest.approx(nll / n, rel=1e-6)
    assert r["ppl"] == pytest.approx(math.exp(nll / n), rel=1e-6)
    assert r["ppl"] < read_header(tiny_gguf)["n_vocab"]  # a trained model beats uniform guessing


def test_a_window_longer_than_the_batch_scores_the_same(tiny_gguf, trained_run):
    """Windows go through llama.cpp in batches, each asking only for its scored positions' logits."""
    toks = next(iter(_test_tokens(trained_run).values()))[: 2 * 64]
    whole = perplexity(tiny_gguf, toks, ctx=64)  # one batch a window
    for batch in (8, 24, 40):  # batch edges before, at and across the scored half's start (32)
        r = perplexity(tiny_gguf, toks, ctx=64, batch=batch)
        assert r["n_tokens"] == whole["n_tokens"] and r["nll"] == pytest.approx(whole["nll"], rel=1e-4)


def test_by_domain_is_token_weighted(tiny_gguf, trained_run):
    doms = _test_tokens(trained_run, 400)
    r = perplexity_by_domain(tiny_gguf, doms, ctx=64)
    assert set(r["domains"]) == set(doms)
    for d, v in r["domains"].items():
        assert v == {**perplexity(tiny_gguf, doms[d], ctx=64), "tokens_per_s": v["tokens_per_s"]}
    n = sum(v["n_tokens"] for v in r["domains"].values())
    nll = sum(v["nll"] * v["n_tokens"] for v in r["domains"].values()) / n
    assert r["overall"]["n_tokens"] == n and r["overall"]["ppl"] == pytest.approx(math.exp(nll))


def test_too_little_data_says_how_much(tiny_gguf):
    with pytest.raises(MfggufError, match="needs at least 64"):
        perplexity(tiny_gguf, np.arange(50), ctx=64)
    with pytest.raises(MfggufError, match="different tokenizer"):
        perplexity(tiny_gguf, np.full(200, 10**6), ctx=64)


def test_agrees_with_pytorch_reference(tiny_gguf, trained_run):
    """llama.cpp on the f32 GGUF vs mfgguf.model in PyTorch, same windows: within 0.5%."""
    import gguf
    import torch
    from safetensors.torch import load_file

    from mfgguf.config import ModelConfig
    from mfgguf.model import Transformer
    from mfgguf.run import read_module_meta

    rd = RunDir(trained_run)
    n_exp = rd.info()["n_experts"]
    cfg = ModelConfig.from_dict({**read_module_meta(rd, 0)["config"], "n_experts": n_exp, "top_k": 1})
    model = Transformer(cfg, n_experts=n_exp).eval()
    model.load_trunk(load_file(rd.module_file(0)))
    for i in range(1, n_exp + 1):
        model.load_expert(load_file(rd.module_file(i)), slot=i - 1)
    reader = gguf.GGUFReader(str(tiny_gguf))
    routers = {t.name: np.array(t.data) for t in reader.tensors if t.name.endswith("ffn_gate_inp.weight")}
    model.set_router([routers[f"blk.{l}.ffn_gate_inp.weight"].reshape(n_exp, cfg.dim) for l in range(cfg.n_layers)])

    ctx = cfg.ctx_len
    toks = np.concatenate(list(_test_tokens(trained_run, 4 * ctx).values()))
    r = perplexity(tiny_gguf, toks, ctx=ctx)
    with loaded(tiny_gguf) as llm:
        bos = llm.token_bos() if llm._model.add_bos_token() else None
    n_win = len(toks) // ctx
    x = torch.from_numpy(toks[: n_win * ctx].reshape(n_win, ctx).copy())  # (W, ctx)
    if bos is not None:
        x[:, 0] = bos
    with torch.no_grad():
        logp = torch.log_softmax(model(x, route="router").double(), -1)  # (W, ctx, V)
    first = ctx // 2
    tgt = x[:, first + 1 :]  # (W, ctx-1-first)
    ref_nll = -logp[:, first : ctx - 1].gather(-1, tgt.unsqueeze(-1)).mean().item()
    assert r["n_tokens"] == tgt.numel()
    assert r["ppl"] == pytest.approx(math.exp(ref_nll), rel=5e-3)


def test_cli_run_table_and_json(tiny_gguf, trained_run, tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["perplexity", str(tiny_gguf), "--run", str(trained_run), "--ctx", "64", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert set(res["domains"]) == set(_test_tokens(trained_run)) and res["overall"]["ctx"] == 64
    r = runner.invoke(app, ["perplexity", str(tiny_gguf), "--run", str(trained_run), "--ctx", "64"], terminal_width=160)
    assert r.exit_code == 0, r.output
    for d, v in res["domains"].items():
        assert d in r.stdout and f"{v['ppl']:.3f}" in r.stdout and f"{v['n_tokens']:,}" in r.stdout
    assert "overall" in r.stdout
    # --data: text tokenized by the GGUF's own tokenizer (llama.cpp)
    d = next(iter(res["domains"]))
    src = RunDir(trained_run).test_text(d)
    if src.is_file():
        f = tmp_path / f"{d}.txt"
        f.write_text(src.read_text()[:20_000])
        r = runner.invoke(app, ["perplexity", str(tiny_gguf), "--data", str(f), "--ctx", "64", "--json"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["domains"][d]["n_tokens"] > 0


def test_documents_split_at_eos_add_up_to_the_domain(tiny_gguf, trained_run):
    """With `eos`, each scored token is credited to the document it belongs to (an EOS to the one it ends), and
    the documents' sums are the domain's: what eval/spread.py resamples."""
    eos = int(RunDir(trained_run).run_info().eos_id)
    toks = next(iter(_test_tokens(trained_run).values()))[: 4 * 64].copy()
    toks[[20, 40, 100, 101, 170, 255]] = eos  # documents: in a window's unscored half, across windows, one empty
    r = perplexity_by_domain(tiny_gguf, {"d": toks}, ctx=64, eos=eos)["domains"]["d"]
    docs = np.array(r["documents"])  # (documents scored, 2)
    assert docs[:, 1].sum() == r["n_tokens"] and docs[:, 0].sum() / r["n_tokens"] == pytest.approx(r["nll"], rel=1e-9)
    # recount by hand: the documents that own the scored targets of each window's second half
    doc_of = np.concatenate([[0], np.cumsum(toks == eos)])
    targets = np.concatenate([np.arange(s + 32 + 1, s + 64) for s in range(0, len(toks) - 63, 64)])
    assert docs[:, 1].tolist() == np.bincount(doc_of[targets])[np.unique(doc_of[targets])].tolist()
    assert "documents" not in perplexity_by_domain(tiny_gguf, {"d": toks}, ctx=64)["domains"]["d"]


def test_chunks_scores_each_domains_first_windows(tiny_gguf, trained_run):
    runner = CliRunner()
    r = runner.invoke(app, ["perplexity", str(tiny_gguf), "--run", str(trained_run), "--ctx", "64", "--chunks", "2", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    for d, toks in _test_tokens(trained_run).items():
        assert len(toks) >= 3 * 64  # the cap binds on every domain, so the test tells a cap from none
        assert res["domains"][d] == {**perplexity(tiny_gguf, toks[: 2 * 64], ctx=64), "tokens_per_s": res["domains"][d]["tokens_per_s"]}
        assert res["domains"][d]["n_windows"] == 2
    r = runner.invoke(app, ["perplexity", str(tiny_gguf), "--run", str(trained_run), "--chunks", "0"])
    assert r.exit_code == 1 and "--chunks 0" in r.output and "Traceback" not in r.output


def test_a_mask_scores_only_the_tokens_it_counts(tiny_gguf, trained_run):
    """A conversation's domain is scored on the targets its loss mask counts (its assistant turns), as trained."""
    ctx = 32
    toks = next(iter(_test_tokens(trained_run).values()))[: 2 * ctx]
    mask = (np.random.default_rng(0).random(len(toks)) < 0.5).astype(np.uint8)  # (T,) 1: the token counts
    r = perplexity(tiny_gguf, toks, ctx=ctx, mask=mask)
    nll, n = 0.0, 0
    for w in range(2):
        ids = toks[w * ctx: (w + 1) * ctx]
        with loaded(tiny_gguf, n_ctx=ctx, logits_all=True, flash_attn=True) as llm:
            first = ids.tolist()
            if llm._model.add_bos_token():
                first[0] = llm.token_bos()
            llm.eval(first)
            logp = _log_softmax(np.array(llm.scores[:ctx], dtype=np.float64))  # (ctx, V)
        pos = np.arange(ctx // 2, ctx - 1)
        pos = pos[mask[w * ctx + pos + 1] == 1]  # predictions of counted targets only
        nll -= logp[pos, ids[pos + 1]].sum()
        n += len(pos)
    assert 0 < n < 2 * (ctx - 1 - ctx // 2) and r["n_tokens"] == n
    assert r["nll"] == pytest.approx(nll / n, rel=1e-6)
    assert perplexity(tiny_gguf, toks, ctx=ctx, mask=np.ones(len(toks), np.uint8)) == {
        **perplexity(tiny_gguf, toks, ctx=ctx), "tokens_per_s": pytest.approx(0, abs=1e12)}
    with pytest.raises(MfggufError, match="counts none of the scored tokens"):
        perplexity(tiny_gguf, toks, ctx=ctx, mask=np.zeros(len(toks), np.uint8))
