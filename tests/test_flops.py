"""Training FLOPs per token (mfgguf/flops.py): hand counts for `tiny`, then torch's own count of real steps."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mfgguf.config import SHARED_CHOICES, ModelConfig, get_preset, shared_tensor_names
from mfgguf.errors import MfggufError
from mfgguf.eval.baselines.scratch import plan_baselines
from mfgguf.eval.baselines.sides import parse_baselines
from mfgguf.eval.training_flops import run_flops, tokens_for_flops
from mfgguf.flops import expert_step_flops, trunk_step_flops
from mfgguf.model import Transformer, trunk_model, trunk_name_map
from mfgguf.run import ModuleMeta, RunDir, read_module_meta
from mfgguf.train.experts.expert import build_expert_model, expert_params
from mfgguf.train.engine.driver import get_batch
from mfgguf.train.engine.loop import forward_loss, load_tokens, make_optimizer

TINY = replace(get_preset("tiny").model, vocab_size=512)  # dim 64, 2 layers, 4 heads (hd 16), 2 kv heads, ff 128, T 64


def test_hand_counts_tiny():
    C, L, V, T, ff = 64, 2, 512, 64, 128
    attn_w = C * C + 2 * C * 32 + C * C  # q, k, v (2 kv heads x 16), output: 12288
    layer_w = attn_w + 3 * C * ff  # + anchor gate/up/down: 36864
    head = C * V  # 32768; the embedding lookup is no matmul
    scores = 4 * 4 * 16 * (T + 1) / 2  # QK^T + AV per token per layer, causal: 2080
    t = trunk_step_flops(TINY)
    assert t.forward == 2 * (L * layer_w + head) + L * scores == 229_632
    assert t.backward == 4 * (L * layer_w + head) + 2 * L * scores == 459_264
    e_w = 3 * C * ff  # one expert FFN per layer: 24576
    e = expert_step_flops(TINY)  # shared none
    assert e.forward == 2 * (L * (layer_w + e_w) + head) + L * scores == 327_936
    # backward: weight grads of both expert FFNs; activation grads through the head, all of layer 1,
    # and layer 0's expert down-projection input (layer 0's attention and anchor see no trained input)
    assert e.backward == 2 * L * e_w + 2 * (head + (layer_w + e_w) + C * ff) + 2 * scores == 319_744
    # norms: everything from layer 0's attn_norm up carries activation gradients; norms are no matmul
    n = expert_step_flops(TINY, shared_tensor_names(TINY, "norms"))
    assert n.backward == 2 * L * e_w + 2 * (head + L * (layer_w + e_w)) + 2 * L * scores
    # all: the trunk trains too, so the step is a trunk step plus the expert FFNs at 6 FLOPs per weight
    a = expert_step_flops(TINY, shared_tensor_names(TINY, "all"))
    assert a.total == t.total + 6 * L * e_w
    assert trunk_step_flops(TINY, causal=False).total - t.total == 12 * 16 * 4 * L * (T - (T + 1) / 2)


def _measured_step(model, named, batch, route: str) -> float:
    """torch's count of one real training step (forward, backward, AdamW), per token, attention unfused."""
    x, y = batch
    opt = make_optimizer(named, get_preset("tiny").trunk)
    fc = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), fc:  # the fused CPU kernel is not counted by FlopCounterMode at all
        forward_loss(model, x, y, route).backward()
        opt.step()
    return fc.get_total_flops() / x.numel()


def test_trunk_step_matches_torch_count(prepared_run):
    data = load_tokens(RunDir(prepared_run).train_tokens, "train")
    model = Transformer(TINY)
    measured = _measured_step(model, dict(model.named_parameters()), get_batch(data, 0, 0, 0, 8, TINY.ctx_len), "anchor")
    # FlopCounterMode ignores the causal mask (k = T keys per query): the same count exactly
    assert measured == trunk_step_flops(TINY, causal=False).total
    # the honest causal count is lower by about half the attention: 7% of a step at tiny and small, 2% at 1b
    assert measured / trunk_step_flops(TINY).total == pytest.approx(1.0702, abs=1e-4)


@pytest.mark.parametrize("shared", SHARED_CHOICES)
def test_expert_step_matches_torch_count(trained_run, shared):
    rd = RunDir(trained_run)
    cfg = ModelConfig.from_dict(read_module_meta(rd, 0)["config"])
    model = build_expert_model(rd, cfg, seed=1, dev=torch.device("cpu"), bf16_trunk=False)
    names = set(shared_tensor_names(cfg, shared))
    by_gguf = trunk_name_map(cfg.n_layers)
    named = expert_params(model)
    for n, p in model.named_parameters():  # a private copy of the shared trunk tensors trains too
        if by_gguf.get(n) in names:
            named[n] = p.requires_grad_(True)
    batch = get_batch(load_tokens(rd.shard(1), "shard"), 0, 1, 0, 8, cfg.ctx_len)
    measured = _measured_step(model, named, batch, "single")
    assert measured == expert_step_flops(cfg, sorted(names), causal=False).total


def _meta(kind: str, cfg: ModelConfig, tokens: int, **kw) -> ModuleMeta:
    return ModuleMeta.from_json({"kind": kind, "config": cfg.to_dict(), "tokens_seen": tokens, "preset": "small",
                                 "train": {"batch_size": 16, "lr": 2e-3, "seed": 1, "eval_tokens": 65536}, **kw})


def test_budgets_of_the_small_demo_shape():
    cfg = replace(get_preset("small").model, vocab_size=4096, n_experts=3)  # the demo: trunk 1.5M, 3 x 400k
    metas = {0: _meta("trunk", cfg, 1_500_000), **{i: _meta("expert", cfg, 400_000) for i in (1, 2, 3)}}
    fl = run_flops(metas)
    e = expert_step_flops(cfg).total
    assert fl["total"] == 1_500_000 * trunk_step_flops(cfg).total + 3 * 400_000 * e
    assert fl["critical_path"] == 1_500_000 * trunk_step_flops(cfg).total + 400_000 * e and fl["rounds"] == 1
    plans = {p.key: p for p in plan_baselines(metas)}
    assert set(plans) == {"flop", "wallclock", "total"}  # 512 + 3 x 512 = 4 x 512: total is in by default
    step = 16 * 256
    for p, budget in ((plans["flop"], fl["total"]), (plans["wallclock"], fl["critical_path"]), (plans["total"], fl["total"])):
        assert p.tokens % step == 0 and abs(p.tokens * p.flops_per_token - budget) <= p.flops_per_token * step / 2
    assert plans["flop"].anchor_ff == 1024 and plans["total"].anchor_ff == 2048
    assert plans["wallclock"].tokens < plans["flop"].tokens < 2_700_000  # fewer than the old token-matched 2.7M
    # 1b (100 experts of 256 beside a 6144 anchor): the total-parameter model is off by default
    big = get_preset("1b").model
    m1b = {0: _meta("trunk", big, 1000), **{i: _meta("expert", big, 1000) for i in range(1, 101)}}
    assert [p.key for p in plan_baselines(m1b)] == ["flop", "wallclock"]
    # a `rounds` key: R rounds back to back of the longest expert's per-round job
    assert run_flops({**metas, 0: ModuleMeta.from_json({**metas[0].to_json(), "rounds": 2})})["rounds"] == 2
    assert tokens_for_flops(1.0, cfg, step) == step  # at least one step


def test_parse_baselines():
    assert parse_baselines("auto") is None and parse_baselines("none") == () and parse_baselines("") == ()
    assert parse_baselines("flop, wallclock") == ("flop", "wallclock")
    with pytest.raises(MfggufError, match="unknown baseline 'tokens'"):
        parse_baselines("flop,tokens")


@pytest.mark.parametrize("seed_expert", [False, True])
def test_lora_step_matches_torch_count(prepared_run, seed_expert):
    """The LoRA baseline's step as train-base runs it (peft adapters of rank 4 on every linear of every block, the
    base frozen): torch's count of one real step equals continued_step_flops(..., "lora")."""
    from mfgguf.flops import continued_step_flops
    from mfgguf.train.whole.continued import _inject_lora

    cfg = replace(TINY, seed_expert=seed_expert)
    model, route = trunk_model(cfg)  # an imported base: anchor + seed (its FFN split in two), as train-base loads it
    named = _inject_lora(model, rank=4)
    data = load_tokens(RunDir(prepared_run).train_tokens, "train")
    measured = _measured_step(model, named, get_batch(data, 0, 0, 0, 8, cfg.ctx_len), route)
    assert measured == continued_step_flops(cfg, "lora", rank=4, causal=False).total


def test_served_model_matches_torch_count():
    """What a method costs to serve: torch's count of an imported base's forward with a rank-4 LoRA on every block
    linear (as peft runs it, and llama.cpp an unmerged adapter) and its parameters; an MoE's extra FFN and router
    rows by hand."""
    from mfgguf.flops import served_flops, served_params
    from mfgguf.train.whole.continued import _inject_lora

    cfg = replace(TINY, seed_expert=True)
    model, route = trunk_model(cfg)  # anchor + seed: the base's FFN split in two
    # the trunk's one-expert router rows do not run (its route is the anchor and the seed)
    plain = sum(p.numel() for n, p in model.named_parameters()
                if n not in ("tok_embd.weight", "output.weight") and not n.endswith(".router"))
    named = _inject_lora(model, rank=4)
    x = torch.randint(0, cfg.vocab_size, (1, cfg.ctx_len))
    fc = FlopCounterMode(display=False)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), fc:
        model(x, route=route)
    assert fc.get_total_flops() / x.numel() == served_flops(cfg, rank=4, causal=False)
    assert plain == served_params(cfg)  # the base: the anchor and one FFN of expert_ff beside it
    assert sum(p.numel() for p in named.values()) == served_params(cfg, rank=4, adapters=1) - served_params(cfg)
    C, L, e_w = cfg.dim, cfg.n_layers, 3 * cfg.dim * cfg.expert_ff
    assert served_flops(cfg, ffns=2, routed=5) - served_flops(cfg) == L * (2 * e_w + 2 * C * 5)  # top-2 of 5
    assert served_params(cfg, ffns=5, routed=5) - served_params(cfg) == L * (4 * e_w + C * 5)
