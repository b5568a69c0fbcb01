"""The layer-streamed router-statistics pass equals the in-memory one, and never holds the trunk.

Reference: trunk + expert built as one model (expert.build_expert_model)
scored by loop.evaluate with RouterStats' hook, the pass pooled.py ran before. Both run the same windows in the
same batches, the same weights in the same dtypes under the same autocast, so the statistics agree to float
rounding (f64 sums of f32 batch products: compared at rtol 1e-5), and so does the ridge router solved from them.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from mfgguf.config import ModelConfig
from mfgguf.converters.routing.router import RouterBuilder
from mfgguf.run import STATS_PREFIX, RunDir, read_module_meta
from mfgguf.train.engine.loop import evaluate, load_tokens
from mfgguf.train.engine.weights import read_safetensors
from mfgguf.train.experts.expert import build_expert_model
from mfgguf.train.experts.stats import RouterStats
from mfgguf.train.experts.stats_pass import stream_stats, to_bf16

from tests.conftest import TINY_EXPERTS

CPU = torch.device("cpu")
RTOL = 1e-5  # the two passes' statistics: equal up to the order of float additions


def _cfg(rd: RunDir) -> ModelConfig:
    return ModelConfig.from_dict(read_module_meta(rd, 0)["config"])


def _same(a: RouterStats, b: RouterStats) -> None:
    assert a.count == b.count and a.n > 0
    for l in range(len(a.count)):
        np.testing.assert_allclose(a.sum[l].numpy(), b.sum[l].numpy(), rtol=RTOL, atol=RTOL * float(b.sum[l].abs().max()))
        np.testing.assert_allclose(a.sq[l].numpy(), b.sq[l].numpy(), rtol=RTOL, atol=RTOL * float(b.sq[l].abs().max()))


def _in_memory(rd: RunDir, cfg: ModelConfig, i: int, n: int, precision: str) -> RouterStats:
    model = build_expert_model(rd, cfg, 0, CPU, bf16_trunk=precision == "bf16", trunk_path=rd.module_file(0))
    model.load_expert({k: t for k, t in read_safetensors(rd.module_file(i)) if k.startswith("blk.")})
    st = RouterStats(cfg.n_layers, cfg.dim, second_moment=True)
    evaluate(model, load_tokens(rd.shard(i), "shard"), n, "single", CPU, precision, hook=st.hook)
    return st


def _streamed(rd: RunDir, cfg: ModelConfig, i: int, n: int, precision: str, **kw) -> RouterStats:
    st = RouterStats(cfg.n_layers, cfg.dim, second_moment=True)
    got = stream_stats(cfg, rd.module_file(0), load_tokens(rd.shard(i), "shard"), n, st.hook,
                       expert_path=rd.module_file(i), precision=precision, **kw)
    assert got == st.n
    return st


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_streamed_equals_in_memory_and_so_does_the_ridge_router(trained_run, precision):
    rd = RunDir(trained_run)
    cfg = _cfg(rd)
    n = 3000  # windows over the shard in more than one batch
    old = [_in_memory(rd, cfg, i, n, precision) for i in range(1, TINY_EXPERTS + 1)]
    new = [_streamed(rd, cfg, i, n, precision) for i in range(1, TINY_EXPERTS + 1)]
    for a, b in zip(new, old):
        _same(a, b)
    routers = []
    for stats in (old, new):  # the ridge router as assembly solves it: the experts' means, the pooled G
        pooled = RouterStats(cfg.n_layers, cfg.dim, second_moment=True)
        for s in stats:
            pooled.add(s)
        G = pooled.tensors()
        rb = RouterBuilder("ridge", n_layers=cfg.n_layers, dim=cfg.dim, n_experts=TINY_EXPERTS,
                           pooled=lambda l: G[f"{STATS_PREFIX}blk.{l}.second_moment"].numpy())
        for p in range(TINY_EXPERTS):
            own = load_file(rd.module_file(p + 1))
            for l in range(cfg.n_layers):
                rb.add_mean(p, l, own[f"{STATS_PREFIX}blk.{l}.mean"], read_module_meta(rd, p + 1)["router_stats_count"])
        routers.append(rb.finish())
    for a, b in zip(*routers):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.abs(b).max()))


def test_a_sample_larger_than_the_budget_runs_in_chunks_with_the_same_statistics(trained_run):
    rd = RunDir(trained_run)
    cfg = _cfg(rd)
    whole = _streamed(rd, cfg, 2, 3000, "fp32")
    chunked = _streamed(rd, cfg, 2, 3000, "fp32", hidden_bytes=1)  # one batch of hidden states at a time
    assert chunked.count == whole.count
    for l in range(cfg.n_layers):
        assert torch.equal(chunked.sq[l], whole.sq[l]) and torch.equal(chunked.sum[l], whole.sum[l])


def _tensors() -> list[torch.Tensor]:
    """Every tensor the garbage collector tracks; by type(), since isinstance() on a dead weak proxy raises."""
    return [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]


def test_it_holds_one_layer_never_the_trunk(trained_run):
    """At every hook call, the weights the pass holds (every float tensor born since it started, but the sample's
    activations and the statistics' own sums) add up to one layer of trunk + expert: never the trunk. The same
    measure sees the in-memory pass hold all of it. Tensors other tests of the session keep alive are not the
    pass's: they are held here (so no new tensor takes one's id) and left out."""
    rd = RunDir(trained_run)
    cfg = _cfg(rd)
    trunk_bytes = sum(4 * t.numel() for _, t in read_safetensors(rd.module_file(0)))
    layer_bytes = sum(4 * t.numel() for f in (0, 1) for k, t in read_safetensors(rd.module_file(f)) if k.startswith("blk.0."))
    st = RouterStats(cfg.n_layers, cfg.dim, second_moment=True)
    before = _tensors()
    own = {id(t) for t in [*st.sum, *st.sq, *before]}
    peak = {"streamed": 0, "in memory": 0}

    def watching(name):
        def h(layer, n):  # n: (b, win, C), the shape every activation starts with
            st.hook(layer, n)
            live = {id(t): t for t in _tensors() if t.is_floating_point()
                    and not t.is_meta and id(t) not in own and tuple(t.shape[:2]) != tuple(n.shape[:2])}
            peak[name] = max(peak[name], sum(t.untyped_storage().nbytes() for t in live.values()))
        return h

    stream_stats(cfg, rd.module_file(0), load_tokens(rd.shard(1), "shard"), 1000, watching("streamed"),
                 expert_path=rd.module_file(1), precision="fp32")
    model = build_expert_model(rd, cfg, 0, CPU, bf16_trunk=False, trunk_path=rd.module_file(0))
    evaluate(model, load_tokens(rd.shard(1), "shard"), 1000, "single", CPU, "fp32", hook=watching("in memory"))
    del model
    assert peak["in memory"] >= trunk_bytes, (peak, trunk_bytes)  # the measure sees a whole trunk where one is held
    assert peak["streamed"] <= layer_bytes + 8192, (peak, layer_bytes)  # + RoPE's tables


def test_bf16_rounding_is_torchs_bit_for_bit():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)  # every kind of f32: subnormal, inf, NaN
    a = np.concatenate([bits.view(np.float32), rng.standard_normal(200_000).astype(np.float32),
                        np.array([np.inf, -np.inf, 3.4e38, -0.0, 0.0, 1e-45], np.float32)])
    want, got = torch.from_numpy(a).to(torch.bfloat16), to_bf16(a)
    nan = torch.from_numpy(np.isnan(a))
    assert nan.any() and torch.isnan(got[nan].float()).all()
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
