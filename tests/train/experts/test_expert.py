"""Expert training: frozen trunk, the exact routed function, router statistics, own-domain gain."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from mfgguf.config import ModelConfig, get_preset
from mfgguf.errors import MfggufError
from mfgguf.model import Transformer
from mfgguf.run import STATS_PREFIX, RunDir
from mfgguf.train.experts.expert import build_expert_model, expert_params, train_expert
from mfgguf.train.engine.driver import get_batch
from mfgguf.train.engine.loop import forward_loss, load_tokens, make_optimizer
from tests.conftest import TINY_EXPERTS, copy_run


def _cfg(rd: RunDir) -> ModelConfig:
    return ModelConfig.from_dict(json.loads(rd.module_meta(0).read_text())["config"])



def two_training_steps(model, opt, rd, cfg) -> set[int]:
    """Two bf16 steps of expert 1's route on its shard; returns the ids of the optimizer's parameters."""
    x, y = get_batch(load_tokens(rd.shard(1), "shard"), 0, 1, 0, 2, cfg.ctx_len)
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            forward_loss(model, x, y, "single").backward()
        opt.step()
    return {id(p) for g in opt.param_groups for p in g["params"]}

def test_only_the_expert_trains(trained_run):
    rd = RunDir(trained_run)
    cfg = _cfg(rd)
    model = build_expert_model(rd, cfg, seed=0, dev=torch.device("cpu"), bf16_trunk=True)
    named = expert_params(model)
    assert len(named) == 3 * cfg.n_layers
    opt = make_optimizer(named, get_preset("tiny").expert)
    opt_params = two_training_steps(model, opt, rd, cfg)
    for name, p in model.named_parameters():
        if name in named:
            assert p.requires_grad and p.grad is not None and id(p) in opt_params and p in opt.state
        else:
            assert not p.requires_grad and p.grad is None and id(p) not in opt_params and p not in opt.state
            # frozen Linear weights are held in bf16; norms and the embedding stay f32
            linear = isinstance(model.get_submodule(name.rpartition(".")[0]), torch.nn.Linear)
            assert p.dtype == (torch.bfloat16 if linear else torch.float32), name
    assert model.tok_embd.weight.dtype == torch.float32


def test_step_zero_is_exactly_the_trunk(trained_run):
    rd = RunDir(trained_run)
    cfg = _cfg(rd)
    trunk = Transformer(cfg)
    trunk.load_trunk(load_file(rd.module_file(0)))
    model = build_expert_model(rd, cfg, seed=0, dev=torch.device("cpu"), bf16_trunk=False)
    x, _ = get_batch(load_tokens(rd.shard(1), "shard"), 0, 1, 0, 2, cfg.ctx_len)
    with torch.no_grad():
        assert torch.equal(model(x, route="single"), trunk(x, route="anchor"))
        model.layers[0].experts[0].down.weight.fill_(0.01)  # a non-zero expert does change the output
        assert not torch.equal(model(x, route="single"), trunk(x, route="anchor"))


def test_expert_modules_meta_and_router_stats(trained_run):
    rd = RunDir(trained_run)
    info = rd.info()
    trunk = json.loads(rd.module_meta(0).read_text())
    trunk_t = load_file(rd.module_file(0))
    cfg = _cfg(rd)
    for i in range(1, TINY_EXPERTS + 1):
        meta = json.loads(rd.module_meta(i).read_text())
        assert meta["kind"] == "expert" and meta["index"] == i == meta["shard"]
        assert meta["trunk_sha256"] == trunk["sha256"] and meta["trunk_validation_loss"] == trunk["validation_loss"]
        assert meta["shard_domains"] == info["shards"][i - 1]["domains"]
        assert meta["router_stats_count"] == 4 * meta["train"]["eval_tokens"]
        assert meta["epochs"] == round(meta["tokens_seen"] / len(load_tokens(rd.shard(i), "shard")), 3) > 0
        # The expert lowers the held-out loss of the domain it was trained on, below the trunk alone.
        (own,) = meta["shard_domains"]
        assert meta["validation_loss"][own] < trunk["validation_loss"][own] - 0.01, (i, own)
        t = load_file(rd.module_file(i))
        weights = {k for k in t if not k.startswith(STATS_PREFIX)}
        assert weights == {f"blk.{l}.ffn_{w}.weight" for l in range(cfg.n_layers) for w in ("gate", "up", "down")}
        assert t["blk.0.ffn_down.weight"].abs().max() > 0  # the zero-initialised down-projection trained
        assert set(t) - weights == {f"{STATS_PREFIX}blk.{l}.mean" for l in range(cfg.n_layers)}  # no dim x dim
        for l in range(cfg.n_layers):
            mu, w = t[f"{STATS_PREFIX}blk.{l}.mean"], trunk_t[f"blk.{l}.ffn_norm.weight"]
            # After RMSNorm with weight w every token has sum_c (n_c / w_c)^2 = dim, so the mean at most that.
            assert mu.shape == (cfg.dim,) and 0 < ((mu / w) ** 2).sum().item() <= cfg.dim * 1.01
        assert (rd.plots / f"loss_expert_{i:03d}.png").is_file()
    # The router's second moment, pooled once (`router-stats`: trunk + each expert over its shard sample).
    pooled = json.loads(rd.router_stats_meta.read_text())
    counts = [json.loads(rd.module_meta(i).read_text())["router_stats_count"] for i in range(1, TINY_EXPERTS + 1)]
    assert pooled["trunk_sha256"] == trunk["sha256"] and pooled["router_stats_count"] == sum(counts)
    g = load_file(rd.router_stats)
    for l in range(cfg.n_layers):
        m2, w = g[f"{STATS_PREFIX}blk.{l}.second_moment"], trunk_t[f"blk.{l}.ffn_norm.weight"]
        assert m2.shape == (cfg.dim, cfg.dim) and torch.allclose(m2, m2.T)
        assert (m2.diagonal() / w**2).sum().item() == pytest.approx(cfg.dim, rel=2e-2)


def test_changed_trunk_is_refused(trained_run, tmp_path):
    run = copy_run(trained_run, tmp_path / "run")
    rd = RunDir(run)
    before = rd.module_file(1).read_bytes()
    t = load_file(rd.module_file(0))
    t["output_norm.weight"] += 1.0
    from safetensors.torch import save_file

    save_file(t, str(rd.module_file(0)))
    with pytest.raises(MfggufError, match="does not match its recorded sha256"):
        train_expert(run, 1, progress=False)
    shutil.rmtree(rd.modules)
    with pytest.raises(MfggufError, match="mfgguf train-trunk"):
        train_expert(run, 1, progress=False)
    with pytest.raises(MfggufError, match="out of range"):
        train_expert(run, TINY_EXPERTS + 1, progress=False)
    assert before  # the expert file existed before; nothing else to compare once modules/ is gone


def test_anchor_init_starts_from_the_anchor_and_still_computes_the_trunk(trained_run):
    """init='anchor': gate/up rows are the anchor's, down is zero, so step 0 is exactly the trunk."""
    import numpy as np

    from mfgguf.run import read_module_meta

    rd = RunDir(trained_run)
    cfg = ModelConfig.from_dict(read_module_meta(rd, 0)["config"])
    model = build_expert_model(rd, cfg, seed=0, dev=torch.device("cpu"), bf16_trunk=False, init="anchor")
    for layer in model.layers:
        e = layer.experts[0]
        assert torch.equal(e.gate.weight, layer.anchor.gate.weight[: cfg.expert_ff])
        assert torch.equal(e.up.weight, layer.anchor.up.weight[: cfg.expert_ff])
        assert not e.down.weight.any()
    idx = torch.as_tensor(np.load(rd.test(rd.info()["domains"][0]))[:32].astype(np.int64))[None]
    with torch.no_grad():
        assert torch.equal(model(idx, route="single"), model(idx, route="anchor"))


def test_final_score_is_the_curves_last_point_when_it_scored_the_same_tokens(trained_run, tmp_path):
    """With curve_tokens >= eval_tokens the end of training is scored once, not twice; the times are recorded."""
    from mfgguf.options import TrainOptions

    run = copy_run(trained_run, tmp_path / "run")
    meta = train_expert(run, 1, options=TrainOptions(tokens=4096, eval_tokens=1024, curve_tokens=1024), progress=False,
                        restart=True)
    assert meta["validation_loss"] == meta["validation_history"][-1][2]
    clock = meta["wall_breakdown_s"]
    assert clock["validation"] < 0.05 and clock["train"] > 0 and clock["stats"] < 0.05  # gathered by the last steps
    assert meta["router_stats_count"] == 4 * 1024  # stats_tokens 0: 4 x eval_tokens
    other = train_expert(run, 1, options=TrainOptions(tokens=4096, eval_tokens=1024, curve_tokens=1024,
                                                      stats_tokens=2048), progress=False, restart=True)
    assert other["router_stats_count"] == 2048
