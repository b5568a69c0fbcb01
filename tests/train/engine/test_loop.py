"""The loop's building blocks: history-free batches, the schedule, router statistics, checkpoint I/O."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from mfgguf.config import TrainConfig
from mfgguf.errors import MfggufError
from mfgguf.train.engine import checkpoint as ckpt_io
from mfgguf.train.engine.driver import get_batch, lr_at
from mfgguf.train.engine.loop import make_optimizer
from mfgguf.train.experts.stats import RouterStats


def test_batch_depends_only_on_seed_stream_step():
    toks = np.arange(10_000, dtype=np.uint16) % 500
    x1, y1 = get_batch(toks, 7, 1, 42, 4, 16)
    get_batch(toks, 7, 1, 41, 4, 16)  # drawing other steps in between changes nothing
    x2, y2 = get_batch(toks, 7, 1, 42, 4, 16)
    assert x1.shape == (4, 16) and x1.dtype == torch.int64
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are inputs shifted by one
    assert not torch.equal(x1, get_batch(toks, 7, 2, 42, 4, 16)[0])  # another expert's stream differs
    with pytest.raises(MfggufError, match="fewer than one context"):
        get_batch(toks[:10], 7, 1, 0, 4, 16)


def test_lr_schedule_warms_up_then_decays_to_min():
    tc = TrainConfig(lr=1e-3, min_lr_frac=0.1, warmup_frac=0.1)
    lrs = [lr_at(s, 100, tc) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))  # monotone decay after warm-up
    assert lrs[-1] == pytest.approx(1e-4, rel=0.01)


def test_weight_decay_only_on_matrices():
    named = {"w": torch.nn.Parameter(torch.zeros(3, 3)), "norm": torch.nn.Parameter(torch.ones(3))}
    opt = make_optimizer(named, TrainConfig(weight_decay=0.1))
    (g_decay, g_other) = opt.param_groups
    assert g_decay["weight_decay"] == 0.1 and g_decay["params"] == [named["w"]]
    assert g_other["weight_decay"] == 0.0 and g_other["params"] == [named["norm"]]


def test_router_stats_match_a_direct_computation():
    torch.manual_seed(0)
    a, b = torch.randn(2, 5, 8), torch.randn(3, 7, 8)  # two batches (B, T, C) of FFN inputs
    st = RouterStats(n_layers=1, dim=8, second_moment=True)
    st.hook(0, a)
    st.hook(0, b)
    means_only = RouterStats(n_layers=1, dim=8)  # what experts record (module format 2)
    means_only.hook(0, a)
    assert set(means_only.tensors()) == {"router_stats.blk.0.mean"}
    x = torch.cat([a.reshape(-1, 8), b.reshape(-1, 8)]).double()  # (31, 8)
    t = st.tensors()
    assert st.n == 31
    assert torch.allclose(t["router_stats.blk.0.mean"].double(), x.mean(0), atol=1e-6)
    assert torch.allclose(t["router_stats.blk.0.second_moment"].double(), x.T @ x / 31, atol=1e-5)


def test_checkpoint_roundtrip_and_rejections(tmp_path):
    p = {"w": torch.nn.Parameter(torch.randn(4, 3))}
    opt = make_optimizer(p, TrainConfig())
    p["w"].sum().backward()
    opt.step()
    meta = {"module": "expert_001", "train": {"tokens": 10}, "trunk_sha256": "aa"}
    ckpt_io.save(tmp_path, p, opt, {**meta, "step": 3, "history": [[1, 8, 2.0]]})
    saved = p["w"].detach().clone()
    q = {"w": torch.nn.Parameter(torch.zeros(4, 3))}
    opt2 = make_optimizer(q, TrainConfig())
    state = ckpt_io.load(tmp_path, q, opt2, meta)
    assert state["step"] == 3 and torch.equal(q["w"], saved)
    assert torch.equal(opt2.state[q["w"]]["exp_avg"], opt.state[p["w"]]["exp_avg"])
    assert torch.equal(opt2.state[q["w"]]["step"], opt.state[p["w"]]["step"])
    with pytest.raises(MfggufError, match="different trunk_sha256.*--restart"):
        ckpt_io.load(tmp_path, q, opt2, {**meta, "trunk_sha256": "bb"})
    with pytest.raises(MfggufError, match="different train"):
        ckpt_io.load(tmp_path, q, opt2, {**meta, "train": {"tokens": 11}})
    # a TrainConfig field added after the save matches it at its default, and only there
    assert ckpt_io.load(tmp_path, q, opt2, {**meta, "train": {"tokens": 10, "cooldown": 0.2}})["step"] == 3
    with pytest.raises(MfggufError, match="different train"):
        ckpt_io.load(tmp_path, q, opt2, {**meta, "train": {"tokens": 10, "cooldown": 0.5}})
    # a field removed since matches at its off value; at another, the removal's one line
    ckpt_io.save(tmp_path, p, opt, {**meta, "train": {"tokens": 10, "complement": False}, "step": 3})
    assert ckpt_io.load(tmp_path, q, opt2, meta)["step"] == 3
    ckpt_io.save(tmp_path, p, opt, {**meta, "train": {"tokens": 10, "ffn_rounds": 1}, "step": 3})
    with pytest.raises(MfggufError, match="--ffn-rounds, which mfgguf removed.*2a0bd6e"):
        ckpt_io.load(tmp_path, q, opt2, meta)
    ckpt_io.save(tmp_path, p, opt, {**meta, "step": 3, "history": [[1, 8, 2.0]]})
    (tmp_path / "state.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(MfggufError, match="corrupted or unreadable.*--restart"):
        ckpt_io.load(tmp_path, q, opt2, meta)
    assert ckpt_io.load(tmp_path / "none", q, opt2, meta) is None


def test_micro_batches_take_the_whole_batch_step(tmp_path):
    """Gradients accumulated over micro-batches of 2 sequences: the whole batch's gradient (8 sequences)."""
    from mfgguf.config import get_preset
    from mfgguf.model import Transformer
    from mfgguf.train.engine.loop import InMemorySteps
    from mfgguf.train.engine.records import Checkpoints, StepSetup
    from mfgguf.train.whole.trunk import EXPERT_STEP_BUDGET, plan_activations, step_bytes

    cfg = get_preset("tiny").model
    tc = TrainConfig(batch_size=8, compile="off")
    x = torch.randint(0, cfg.vocab_size, (8, cfg.ctx_len + 1))
    after = []
    for micro in (None, 2):
        torch.manual_seed(0)
        model = Transformer(cfg)
        named = {k: v for k, v in model.named_parameters() if v.requires_grad}
        impl = InMemorySteps(model, named, tc, StepSetup(torch.device("cpu"), "fp32", "anchor", micro=micro),
                             Checkpoints(tmp_path / str(micro), {}))
        impl.resume()
        loss = impl._forward_backward(x[:, :-1], x[:, 1:])  # the step's gradient, before clipping and AdamW
        after.append((float(loss), {k: v.grad.clone() for k, v in named.items()}))
    assert after[0][0] == pytest.approx(after[1][0], rel=1e-5)
    assert all(torch.allclose(after[0][1][k], after[1][1][k], rtol=1e-4, atol=1e-7) for k in after[0][1])
    smol = cfg.__class__(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, anchor_ff=1344, expert_ff=192,
                         ctx_len=256, seed_expert=True)
    assert plan_activations(smol, 16) == (False, 2) and plan_activations(cfg, 8) == (False, 8)
    assert plan_activations(get_preset("1b").model, get_preset("1b").expert.batch_size)[0]  # recompute keeps 1b small
    assert plan_activations(replace(smol, ctx_len=512), 8) == (False, 1)  # two sequences no longer fit: one at a time
    assert plan_activations(replace(smol, ctx_len=1024), 4) == (True, 4)  # not even one
    qwen25 = cfg.__class__(vocab_size=151936, dim=896, n_layers=24, n_heads=14, n_kv_heads=2, anchor_ff=4256,
                           expert_ff=608, ctx_len=256, seed_expert=True, family="qwen2")
    assert plan_activations(qwen25, 16) == (False, 2)  # a large base: micro-batches of 2 (1.65x recompute's speed)
    qwen3 = cfg.__class__(vocab_size=151936, dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, anchor_ff=2688,
                          expert_ff=384, ctx_len=256, seed_expert=True, family="qwen3", attn_head_dim=128)
    assert plan_activations(qwen3, 16) == (False, 2)
    llama1b = cfg.__class__(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, anchor_ff=7168,
                            expert_ff=1024, ctx_len=256, seed_expert=True)
    # two sequences would take the step past EXPERT_STEP_BUDGET (6.6 GB measured): one at a time
    assert step_bytes(llama1b, 2) > EXPERT_STEP_BUDGET >= step_bytes(llama1b, 1)
    assert plan_activations(llama1b, 16) == (False, 1)


def test_scoring_in_batches_gives_the_per_window_loss(monkeypatch):
    """evaluate() runs many windows per forward and the head in chunks: the loss of one window at a time."""
    from mfgguf.config import get_preset
    from mfgguf.model import Transformer
    from mfgguf.train.engine import loop
    cfg = get_preset("tiny").model
    torch.manual_seed(0)
    model = Transformer(cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 40 * cfg.ctx_len + 1)
    results = []
    for rows, chunks in ((cfg.ctx_len, 1), (4096, 8), (5 * cfg.ctx_len, 1)):  # one window; many; a ragged last batch
        monkeypatch.setattr(loop, "EVAL_ROWS", rows)
        monkeypatch.setattr(loop, "EVAL_HEAD_CHUNKS", chunks)
        results.append(loop.evaluate(model, tokens, 32 * cfg.ctx_len, "anchor", torch.device("cpu"), "fp32"))
    n = results[0][1]
    assert n == 32 * cfg.ctx_len and all(r[1] == n for r in results)
    with torch.no_grad():
        starts, win = loop.eval_windows(tokens, cfg.ctx_len, 32 * cfg.ctx_len)
        w = torch.from_numpy(np.stack([tokens[s : s + win + 1] for s in starts]).astype(np.int64))
        direct = float(model(w[:, :-1], w[:, 1:], route="anchor"))
    assert all(r[0] == pytest.approx(direct, rel=1e-5) for r in results)


def test_auto_compiles_long_schedules_only():
    """auto decides by the whole schedule's matmul work: the tiny preset's runs (the demo) stay eager, a SmolLM2
    expert of 65,536 tokens (the README's recipe) compiles, recompute never does, on/off are what they say."""
    from mfgguf.config import ModelConfig, get_preset
    from mfgguf.model import Transformer
    from mfgguf.train.engine.loop import matmul_work, wants_compile

    with torch.device("meta"):
        tiny = Transformer(get_preset("tiny").model, n_experts=1)
        smol = Transformer(ModelConfig(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ctx_len=256,
                                       anchor_ff=1344, expert_ff=768, seed_expert=True), n_experts=1)
    tc = get_preset("tiny").expert
    demo = matmul_work(tiny, tc.tokens // (tc.batch_size * 128), tc.batch_size * 128)
    recipe = matmul_work(smol, 16, 16 * 256)
    assert not wants_compile("auto", demo, recompute=False)
    assert wants_compile("auto", recipe, recompute=False) and not wants_compile("auto", recipe, recompute=True)
    assert not wants_compile("auto", recipe / 4, recompute=False)  # 16,384 tokens: too short to repay a compile
    assert wants_compile("on", demo, recompute=False) and not wants_compile("off", recipe, recompute=False)


def test_bf16_step_casts_each_weight_once(tmp_path):
    """Under bf16 autocast the step casts each trainable weight once, not once a micro-batch, and its
    gradient is bit for bit the one of an autocast region per micro-batch (what the step did before)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from mfgguf.config import get_preset
    from mfgguf.model import Transformer
    from mfgguf.train.engine.loop import InMemorySteps, autocast
    from mfgguf.train.engine.records import Checkpoints, StepSetup

    class Casts(TorchDispatchMode):
        def __init__(self, ptrs):
            super().__init__()
            self.ptrs, self.n = ptrs, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.ptrs:
                self.n += kwargs.get("dtype") == torch.bfloat16
            return func(*args, **kwargs)

    cfg = get_preset("tiny").model
    tc = TrainConfig(batch_size=8, compile="off")
    x = torch.randint(0, cfg.vocab_size, (8, cfg.ctx_len + 1))
    grads = []
    for form in ("step", "micro"):
        torch.manual_seed(0)
        model = Transformer(cfg)
        named = {k: v for k, v in model.named_parameters() if v.requires_grad}
        impl = InMemorySteps(model, named, tc, StepSetup(torch.device("cpu"), "bf16", "anchor", micro=2),
                             Checkpoints(tmp_path / form, {}))
        impl.resume()
        if form == "step":
            mode = Casts({v.data_ptr() for v in named.values() if v.dim() == 2})
            with mode:
                impl._forward_backward(x[:, :-1], x[:, 1:])
            matrices = sum(v.dim() == 2 for v in named.values())
            assert 0 < mode.n <= matrices  # once a step (the tied head's matrix may be cast in its own kernel)
        else:
            for s in range(0, 8, 2):
                with autocast("bf16", torch.device("cpu")):
                    loss = model(x[s : s + 2, :-1], x[s : s + 2, 1:], route="anchor")
                (loss * 0.25).backward()
        grads.append({k: v.grad.clone() for k, v in named.items()})
    assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])
