"""Training FLOPs per token of a trunk (dense) step and of an expert step, from the model shape alone.

Torch-free, so training, the evaluation's baseline budgets (eval/training_flops.py) and the benchmarks count
FLOPs without importing torch.

Conventions (what is counted):
  - Matrix multiplies only: 2 FLOPs per multiply-add. Norms, RoPE, SiLU, softmax, the loss, the
    embedding lookup (and its scatter-add gradient) and the optimizer update are not counted: they
    are O(dim) per token or per parameter (their share: docs/evaluation.md).
  - Every matmul weight W (attn_q/k/v/output, anchor gate/up/down, expert gate/up/down, output head)
    costs 2|W| per token forward. Backward costs 2|W| for the weight gradient, only if W trains, plus
    2|W| for the gradient w.r.t. its input, only if that input depends on a trained tensor (autograd
    skips it otherwise). A trunk step trains everything: the classic 6|W| per token.
  - Attention scores and values: per layer and token, QK^T and AV cost 2*H*hd*k each forward, where
    k is the number of keys a query sees. Causal (the default, honest) k = (T+1)/2, the mean over the
    T positions of a training window; `causal=False` gives k = T, the convention of
    torch.utils.flop_counter, which ignores the mask. Backward is twice the forward (dQ, dK; dA, dV),
    when anything upstream of the attention trains.
  - No activation recomputation: `recompute=True` in training re-runs the forward, but that is a
    memory trade, not extra learning, and a dense model would pay it too.

Expert step: the forward runs the whole network (trunk + anchor + expert). The backward computes
activation gradients from the loss down to the lowest trained tensor -- for `--shared none` that is
the expert FFN of layer 0, so every layer above it (and the output head) carries activation
gradients, and layer 0's attention and anchor none -- and weight gradients only for the expert FFNs
plus the trunk tensors the job trained a private copy of (`shared_tensors` in its metadata).

Example:
    >>> from mfgguf.config import get_preset
    >>> cfg = get_preset("tiny").model
    >>> round(trunk_step_flops(cfg).total / expert_step_flops(cfg).total, 3) > 1
    True
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mfgguf.config import ModelConfig, shared_tensor_names
from mfgguf.run.records import ModuleMeta

@dataclass(frozen=True)
class StepFlops:
    """FLOPs per training token of one step (forward and backward)."""

    forward: float
    backward: float

    @property
    def total(self) -> float:
        return self.forward + self.backward


def _cfg(cfg) -> ModelConfig:
    return cfg if isinstance(cfg, ModelConfig) else ModelConfig.from_dict(cfg)


def _step(cfg: ModelConfig, trained: set[str], with_expert: bool, causal: bool, rank: int = 0) -> StepFlops:
    """Walk the forward graph in order; `live` = the residual stream depends on a trained tensor. `rank` > 0: every
    linear of every block (not the head) carries a trained LoRA of that rank beside its frozen weight."""
    C, L, V, H, KV, hd = cfg.dim, cfg.n_layers, cfg.vocab_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    keys = (cfg.ctx_len + 1) / 2 if causal else cfg.ctx_len  # keys per query, mean over a window
    fwd = bwd = 0.0

    def mm(n_weights: int, weight_trains: bool, input_live: bool, io: tuple[int, int] | None = None) -> bool:
        """One linear (io = (d_in, d_out) where a LoRA adapts it); returns whether its output is live."""
        nonlocal fwd, bwd
        fwd += 2 * n_weights
        bwd += 2 * n_weights * weight_trains + 2 * n_weights * input_live
        if rank and io:  # B(Ax): A and B forward; dB, dA and the gradient through B; through A only to a live input
            d_in, d_out = io
            fwd += 2 * rank * (d_in + d_out)
            bwd += 4 * rank * d_out + 2 * rank * d_in + 2 * rank * d_in * input_live
        return weight_trains or input_live or bool(rank and io)

    def swiglu(ff: int, trains: tuple[bool, bool, bool], f_in: bool) -> bool:
        """gate/up/down on the ffn_norm output; returns whether its output depends on a trained tensor."""
        g, u, d = trains
        hidden = mm(C * ff, g, f_in, (C, ff)) | mm(C * ff, u, f_in, (C, ff))
        return mm(ff * C, d, hidden, (ff, C))

    live = "token_embd.weight" in trained
    for l in range(L):
        t = lambda name: f"blk.{l}.{name}.weight" in trained  # noqa: E731
        a_in = live or t("attn_norm")
        qkv = (mm(C * H * hd, t("attn_q"), a_in, (C, H * hd)) | mm(C * KV * hd, t("attn_k"), a_in, (C, KV * hd))
               | mm(C * KV * hd, t("attn_v"), a_in, (C, KV * hd)))
        fwd += 4 * H * hd * keys  # QK^T and AV
        bwd += 8 * H * hd * keys * qkv
        live = mm(H * hd * C, t("attn_output"), qkv, (H * hd, C)) or live
        f_in = live or t("ffn_norm")
        out = swiglu(cfg.anchor_ff, (t("ffn_gate_shexp"), t("ffn_up_shexp"), t("ffn_down_shexp")), f_in)
        if with_expert or cfg.seed_expert:  # an expert job's expert, or the trunk's seed FFN (trains with it)
            e = not rank  # a LoRA's seed is frozen
            out = swiglu(cfg.expert_ff, (e, e, e), f_in) or out
        live = live or f_in or out
    mm(C * V, "output.weight" in trained, live or "output_norm.weight" in trained)
    return StepFlops(fwd, bwd)


def trunk_step_flops(cfg, *, causal: bool = True) -> StepFlops:
    """FLOPs per token of a trunk (or dense baseline) training step: every parameter trains."""
    cfg = _cfg(cfg)
    return _step(cfg, set(shared_tensor_names(cfg, "all")), False, causal)


def expert_step_flops(cfg, shared_tensors=(), *, causal: bool = True) -> StepFlops:
    """FLOPs per token of an expert job's step: the expert FFNs train, plus private copies of `shared_tensors`."""
    return _step(_cfg(cfg), set(shared_tensors or ()), True, causal)


def continued_step_flops(cfg, mode: str, rank: int = 16, *, causal: bool = True) -> StepFlops:
    """FLOPs per token of training an imported base itself (train/whole/continued.py): every parameter (`full`), or a
    LoRA of rank `rank` on every linear layer of every block (`lora`): the frozen base's forward and activation
    gradients (none into layer 0's attention, whose input no trained tensor reaches), plus each adapter's
    2r(d_in + d_out) forward and 4r d_out + 2r d_in backward, and 2r d_in more where its input is live (torch's own
    count of a real step agrees exactly: tests/test_flops.py)."""
    cfg = _cfg(cfg)
    if mode == "full":
        dense = replace(cfg, anchor_ff=cfg.anchor_ff + (cfg.expert_ff if cfg.seed_expert else 0), seed_expert=False)
        return trunk_step_flops(dense, causal=causal)
    # the anchor and the seed are adapted apart (peft wraps each module), so the seed FFN stays a module of its own;
    # layer 0's attention input is frozen, so neither its weights nor its adapters' A pass a gradient to it
    return _step(cfg, set(), False, causal, rank=rank)


def module_step_flops(meta: ModuleMeta | dict, *, causal: bool = True) -> StepFlops:
    """Per-token step FLOPs of a trained module from its record (kind, config, shared_tensors)."""
    m = ModuleMeta.of(meta)
    if m.continued:  # an imported base trained further (a baseline)
        return continued_step_flops(m.config, m.continued["mode"], m.continued.get("rank") or 16, causal=causal)
    if m.kind == "expert":
        return expert_step_flops(m.config, m.shared_tensors, causal=causal)
    return trunk_step_flops(m.config, causal=causal)


def module_flops(meta: ModuleMeta | dict, *, causal: bool = True) -> float:
    """Training FLOPs a module spent: tokens_seen * its per-token step FLOPs, plus the forward passes a sync's
    restat ran on it (router statistics and validation scoring on the merged trunk: `restat_tokens`)."""
    m = ModuleMeta.of(meta)
    step = module_step_flops(m, causal=causal)
    return m.tokens_seen * step.total + m.restat_tokens * step.forward


def served_flops(cfg, *, ffns: int = 1, routed: int = 0, rank: int = 0, causal: bool = True) -> float:
    """Forward FLOPs a token of a served model, by the conventions above (a token at a training window's mean
    position): the anchor with `ffns` FFNs of expert_ff units beside it (the base, or an MoE at top-1: 1; top-2: 2),
    a router of `routed` rows a layer, and a LoRA of `rank` on every block linear applied unmerged, as peft runs it
    and llama.cpp serves an adapter (0: none, or merged into the weights)."""
    c = _cfg(cfg)
    c = replace(c, expert_ff=c.expert_ff * ffns, seed_expert=ffns > 0)
    return _step(c, set(), False, causal, rank=rank).forward + 2 * c.dim * routed * c.n_layers


def served_params(cfg, *, ffns: int = 1, routed: int = 0, rank: int = 0, adapters: int = 0) -> int:
    """Non-embedding parameters of a served model (the embeddings and head are every method's alike): attention,
    norms, the anchor and `ffns` FFNs of expert_ff units (the base: 1; an MoE: its routed experts), a router of
    `routed` rows a layer, and `adapters` LoRAs of `rank` on every block linear (the anchor's and the seed's apart,
    as they train: train/whole/adapter.py)."""
    c = _cfg(cfg)
    own = c.non_embedding_params() - (c.expert_params() if c.seed_expert else 0)  # without the seed
    hd = c.n_heads * c.head_dim
    kv = c.n_kv_heads * c.head_dim
    ffn_io = 3 * (c.dim + c.anchor_ff) + 3 * (c.dim + c.expert_ff)  # gate, up, down of the anchor and the seed
    lora = c.n_layers * rank * (2 * (c.dim + hd) + 2 * (c.dim + kv) + ffn_io)
    return own + ffns * c.expert_params() + routed * c.dim * c.n_layers + adapters * lora


__all__ = ["StepFlops", "trunk_step_flops", "expert_step_flops", "continued_step_flops",
           "module_step_flops", "module_flops", "served_flops", "served_params"]
