"""Experts that complement the seed (`train-expert --complement`): a two-way MoE of [frozen seed, own FFN].

Real tiny training on the built-in corpus: a trunk with a seed FFN, complementing experts, and the
assembled granitemoe file with the seed as routed expert 0, run by llama.cpp (llama-cpp-python).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from mfgguf.cli.app import app
from mfgguf.config import ModelConfig, get_preset
from mfgguf.converters.assemble import assemble
from mfgguf.train.experts.pooled import pool_router_stats
from mfgguf.converters.routing.complement import LEARNED_ROW
from mfgguf.errors import MfggufError
from mfgguf.options import TrainOptions
from mfgguf.reference import gguf_provenance
from mfgguf.run import RunDir, read_module_meta
from mfgguf.train.experts import complement as cx
from mfgguf.train.experts.expert import build_expert_model, train_expert
from mfgguf.train.engine.loop import load_tokens, run_loop
from mfgguf.train.whole.trunk import train_trunk
from mfgguf.train.engine.weights import read_safetensors

from tests.conftest import TINY_EXPERTS, copy_run
from tests.converters import llama_logits, reference_logits, rel_diff, text_sample

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def seeded_run(prepared_run, tmp_path_factory):
    root = copy_run(prepared_run, tmp_path_factory.mktemp("seeded") / "run")
    train_trunk(root, preset="tiny", options=TrainOptions(tokens=20_000, seed_expert=True), progress=False)
    return root


@pytest.fixture(scope="module")
def complement_run(seeded_run, tmp_path_factory):
    """Every expert trained with --complement (a few hundred steps' worth of tokens: the rows move)."""
    root = copy_run(seeded_run, tmp_path_factory.mktemp("complement") / "run")
    for i in range(1, TINY_EXPERTS + 1):
        train_expert(root, i, options=TrainOptions(tokens=8192, complement=True), progress=False, precision="fp32")
    return root


def _seed(rd: RunDir) -> dict[str, torch.Tensor]:
    return {k: t.clone() for k, t in read_safetensors(rd.module_file(0)) if k.endswith("_seed.weight")}


def _training_model(rd: RunDir, i: int):
    """Expert i's training forward (the two-way MoE) with its trained FFN and row loaded."""
    cfg = ModelConfig.from_dict(read_module_meta(rd, 0)["config"])
    model = cx.two_way(build_expert_model(rd, cfg, 0, CPU, bf16_trunk=False, init="seed"), CPU, bf16_trunk=False)
    cx.load_module(model, dict(read_safetensors(rd.module_file(i))))
    return model.eval()


def _ids(run, n=64):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(run / "tokenizer.json")).encode(text_sample()).ids[:n]


def test_training_keeps_the_seed_and_its_row_frozen(seeded_run, tmp_path):
    rd = RunDir(seeded_run)
    cfg = ModelConfig.from_dict(read_module_meta(rd, 0)["config"])
    seed = _seed(rd)
    model = cx.two_way(build_expert_model(rd, cfg, 0, CPU, bf16_trunk=False, init="seed"), CPU, bf16_trunk=False)
    named = cx.complement_params(model)
    assert not any(".experts.0." in n or n.endswith(".router") for n in named)
    cx.init_rows(model, rd, load_tokens(rd.shard(1), "shard 1"), 2048, CPU, "fp32")
    rows0 = [layer.router_learned.detach().clone() for layer in model.layers]
    assert all(r.abs().sum() > 0 for r in rows0)  # started from the domain's statistics, not zero
    tc = TrainConfig_of(tokens=4096)
    run_loop(model, named, load_tokens(rd.shard(1), "shard 1"), tc, dev=CPU, precision="fp32", route=cx.ROUTE,
             stream=1, ckpt_dir=tmp_path / "ck", ckpt_meta={"test": 1}, progress=False)
    for l, layer in enumerate(model.layers):
        for f in ("gate", "up", "down"):
            frozen = getattr(layer.experts[0], f).weight
            assert torch.equal(frozen, seed[f"blk.{l}.ffn_{f}_seed.weight"])  # bit-identical after training
            assert not torch.equal(getattr(layer.experts[1], f).weight, frozen)  # the expert moved
        assert torch.equal(layer.router, torch.zeros(1, cfg.dim))  # the seed's row: frozen at zero
        assert not torch.equal(layer.router_learned.detach(), rows0[l])  # the expert's row: learned


def TrainConfig_of(**kw):
    return TrainOptions(**kw).train_config(get_preset("tiny").expert)


def test_step_zero_is_the_trunk_alone(seeded_run):
    rd = RunDir(seeded_run)
    cfg = ModelConfig.from_dict(read_module_meta(rd, 0)["config"])
    plain = build_expert_model(rd, cfg, 0, CPU, bf16_trunk=False, init="seed").eval()
    two = cx.two_way(build_expert_model(rd, cfg, 0, CPU, bf16_trunk=False, init="seed"), CPU, bf16_trunk=False)
    cx.init_rows(two, rd, load_tokens(rd.shard(2), "shard 2"), 1024, CPU, "fp32")
    idx = torch.tensor([_ids(seeded_run)])
    with torch.no_grad():
        a, b = plain(idx, route="single"), two.eval()(idx, route=cx.ROUTE)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)  # both slots are the seed: any gate gives the seed


def test_module_file_holds_the_learned_rows(complement_run):
    rd = RunDir(complement_run)
    meta = read_module_meta(rd, 1)
    assert meta["complement"] is True and meta["train"]["complement"] is True
    with safe_open(str(rd.module_file(1)), "np") as f:
        names = set(f.keys())
        row = f.get_tensor(LEARNED_ROW.format(l=0))
    assert {f"blk.0.ffn_{p}.weight" for p in ("gate", "up", "down")} <= names
    assert row.shape == (meta["config"]["dim"],) and np.abs(row).max() > 0


def test_training_forward_equals_llama_cpp(complement_run, tmp_path):
    """Expert 1 alone: the file routes every token to {seed, expert 1} (top-2 of 2), so llama.cpp's logits
    are the training forward's for every token."""
    out = tmp_path / "one.gguf"
    r = assemble(complement_run, out, quant="f32", top_k=2, router="learned", experts=[1], progress=False)
    assert r["top_k"] == 2
    prov = gguf_provenance(out)
    assert prov["complement"] and prov["router_rows"][0].shape[0] == 2
    assert np.array_equal(prov["router_rows"][0][0], np.zeros_like(prov["router_rows"][0][0]))  # the seed's row
    ids = _ids(complement_run)
    want = _training_model(RunDir(complement_run), 1)(torch.tensor([ids]), route=cx.ROUTE)[0].detach().numpy()
    got = llama_logits(out, ids, 64)
    assert rel_diff(got, want) <= 1e-3, rel_diff(got, want)
    # and the trained expert matters: the trunk alone differs from it by far more than that tolerance
    trunk_alone = tmp_path / "trunk.gguf"
    assemble(complement_run, trunk_alone, quant="f32", experts=[], progress=False)
    assert rel_diff(llama_logits(trunk_alone, ids, 64), want) > 1e-2


@pytest.mark.parametrize("router", ["ridge", "ridge+learned"])
def test_seed_is_routed_slot_zero(complement_run, tmp_path, router):
    out = tmp_path / "moe.gguf"
    assemble(complement_run, out, quant="f32", top_k=2, router=router, progress=False, pool_stats=pool_router_stats)
    from gguf import GGUFReader

    r = GGUFReader(str(out))
    assert int(r.fields["granitemoe.expert_count"].parts[-1][0]) == TINY_EXPERTS + 1
    up = {t.name: np.array(t.data) for t in r.tensors}["blk.0.ffn_up_exps.weight"]  # (N + 1, ff, dim)
    seed = _seed(RunDir(complement_run))["blk.0.ffn_up_seed.weight"].numpy()
    assert np.array_equal(up[0], seed)
    with safe_open(str(RunDir(complement_run).module_file(2)), "np") as f:
        assert np.array_equal(up[2], f.get_tensor("blk.0.ffn_up.weight"))
    ids = _ids(complement_run)
    ref, _ = reference_logits(complement_run, out, ids)  # the PyTorch reference of N + 1 routed experts
    assert rel_diff(llama_logits(out, ids, 64), ref) <= 1e-3


def test_assembly_refuses_mixed_or_misrouted_experts(complement_run, seeded_run, tmp_path):
    run = copy_run(complement_run, tmp_path / "run")
    train_expert(run, 3, options=TrainOptions(tokens=1024), progress=False)  # a plain expert beside the others
    with pytest.raises(MfggufError, match="does not complement"):
        assemble(run, tmp_path / "a.gguf", quant="f32", top_k=2, router="learned", progress=False)
    with pytest.raises(MfggufError, match="does not route the seed"):
        assemble(run, tmp_path / "b.gguf", quant="f32", router="centroid", experts=[1, 2], progress=False)
    with pytest.raises(MfggufError, match="--complement"):
        assemble(run, tmp_path / "c.gguf", quant="f32", router="learned", experts=[3], progress=False)
    with pytest.raises(MfggufError, match="granitemoe"):
        assemble(run, tmp_path / "d.gguf", quant="f32", router="learned", layout="mixtral", experts=[1], progress=False)
    assert not list(tmp_path.glob("*.gguf"))


def test_cli_flag(seeded_run, prepared_run, tmp_path):
    assert "--complement" in CliRunner().invoke(app, ["train-experts", "--help"]).output
    assert TrainOptions(complement=True).argv() == ["--complement"]  # what train-experts hands each job
    plain = copy_run(prepared_run, tmp_path / "plain")
    train_trunk(plain, preset="tiny", options=TrainOptions(tokens=1024), progress=False)
    r = CliRunner().invoke(app, ["train-expert", str(plain), "--expert", "1", "--complement", "--tokens", "1024",
                                 "--no-progress"])
    assert r.exit_code == 1 and "--seed-expert" in r.output and "Traceback" not in r.output
    run = copy_run(seeded_run, tmp_path / "run")
    r = CliRunner().invoke(app, ["train-expert", str(run), "--expert", "2", "--complement", "--tokens", "1024",
                                 "--no-progress"])
    assert r.exit_code == 0, r.output
    assert json.loads(RunDir(run).module_meta(2).read_text())["complement"] is True


def test_router_rows():
    from mfgguf.converters.routing.complement import complement_rows
    from mfgguf.converters.routing.router import RouterBuilder

    rng = np.random.default_rng(0)
    D, N = 16, 3
    x = [rng.standard_normal((200, D)) + rng.standard_normal(D) for _ in range(N)]  # three shards' FFN inputs
    allx = np.concatenate(x)
    rb = RouterBuilder("ridge", n_layers=1, dim=D, n_experts=N)
    for p in range(N):
        rb.add_mean(p, 0, x[p].mean(0), len(x[p]))
    rb.add_pooled(0, 0, (allx.T @ allx / len(allx)).astype(np.float32))
    W = rb.finish()  # [(N, D)]
    L = [rng.standard_normal((N, D)).astype(np.float32)]
    learned, ridge, both = (complement_rows(r, ridge=W, learned=L)[0] for r in ("learned", "ridge", "ridge+learned"))
    assert learned.shape == (N + 1, D) and not learned[0].any() and np.array_equal(learned[1:], L[0])
    assert np.allclose(both[1:], W[0] + L[0]) and np.allclose(both[0], ridge[0])
    # the seed's ridge row is ridge regression onto the label every token has (1), at the experts' scale
    G = allx.T @ allx / len(allx)
    lam = 1e-3 * np.trace(G) / D
    ones = np.linalg.solve(G + lam * np.eye(D), allx.mean(0))  # (D,)
    k = ridge[0] @ ones / (ones @ ones)
    assert np.allclose(ridge[0], k * ones, rtol=1e-4, atol=1e-5) and k > 0


def test_assemble_cli_defaults_to_top_2(complement_run, tmp_path):
    out = tmp_path / "m.gguf"
    r = CliRunner().invoke(app, ["assemble", str(complement_run), "-o", str(out), "--quant", "f32",
                                 "--router", "ridge+learned", "--quiet"])
    assert r.exit_code == 0, r.output
    assert f"{TINY_EXPERTS} experts, top-2, router ridge+learned" in r.stdout
    prov = gguf_provenance(out)
    assert prov["top_k"] == 2 and prov["router"] == "ridge+learned" and len(prov["router_rows"][0]) == TINY_EXPERTS + 1
