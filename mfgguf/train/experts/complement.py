"""An expert that complements the seed: it trains as a two-way MoE of [frozen seed FFN, its own FFN].

`train-expert --complement` (TrainConfig.complement). Without it, a token routed to expert i
computes anchor + expert_i, and the seed FFN the trunk trained with (ModelConfig.seed_expert) is
gone from the assembled model: a wrongly routed token loses what the seed knew. With it (after
FlexOlmo), per layer the expert job trains

    anchor(x) + w_s(x) seed(x) + w_e(x) expert(x),   (w_s, w_e) = renormalised top-2 of softmax(x @ [s; r].T)

with the seed FFN frozen (slot 0; the trunk's `ffn_*_seed`, bit for bit), the expert's FFN
(slot 1) starting as a copy of the seed, the seed's router row s frozen at zero and the expert's
row r learned. That is model.py's route "router" with two loaded experts and top_k = 2: exactly
how llama.cpp's granitemoe gates (softmax over `ffn_gate_inp` logits, top-k, weights divided by
their sum), so the trained function is what the assembled file computes for a token routed to
{seed, expert i} (converters/routing/complement.py: the seed is routed slot 0, top-k = 2).

Why top-2 of 2 and not top-1: with top-1 the selected weight is exactly 1 whichever wins, so the
router row would get no gradient; top-2 of two is the plain two-way softmax, differentiable, and
gate(x) = w_e = sigmoid(x . r) since s = 0. At step 0 both FFNs are the seed, so the model is
exactly the trunk alone (anchor + seed) whatever the gate; r then gets gradient as the expert's
FFN moves away from the seed.

r starts from the domain's statistics: with mu the mean FFN input over a sample of the expert's
shard and m over the mixed training data (both through the model at step 0, i.e. the trunk),
r = (mu - m) / |mu - m|^2, so the gate's logit at the domain's mean exceeds that at the mixed
mean by 1 nat. It trains with the expert's FFN (AdamW, the matrices' weight decay: toward the
even gate). The module file holds the FFN, r as `complement.blk.{l}.router` (dim,) and
`"complement": true`; router statistics are recorded with this forward.

Example:
    >>> model = two_way(build_expert_model(rd, cfg, 1, dev, bf16_trunk=False, init="seed"), dev, bf16_trunk=False)
    >>> named = complement_params(model)  # expert FFN (slot 1) + learned rows
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
import torch.nn as nn

from mfgguf.config import ModelConfig
from mfgguf.converters.routing.complement import LEARNED_ROW
from mfgguf.errors import MfggufError
from mfgguf.model import SwiGLU, Transformer
from mfgguf.run import RunDir
from mfgguf.train.engine.loop import evaluate, load_tokens
from mfgguf.train.experts.stats import RouterStats

ROUTE = "router"  # the training forward: softmax-top-k over [seed, expert], as the assembled file gates
TOP_K = 2  # both of the two: the gate is differentiable (top-1 would give the router no gradient)
INIT_MARGIN = 1.0  # nats between the gate logit at the domain's mean and at the mixed data's mean


def check_complement(cfg: ModelConfig, tc) -> None:
    """Raise when --complement cannot train with these settings."""
    if not cfg.seed_expert:
        raise MfggufError("--complement needs a trunk trained with a seed FFN; retrain it with"
                          " `mfgguf train-trunk RUN --seed-expert`")
    if tc.expert_init not in ("auto", "seed"):
        raise MfggufError(f"--complement starts the expert from the seed; drop --init {tc.expert_init}")
    if tc.rounds > 1:
        raise MfggufError("--complement trains in one round; drop --rounds (sync recomputes statistics with"
                          " the plain expert forward)")


def two_way(model: Transformer, dev: torch.device, bf16_trunk: bool) -> Transformer:
    """An expert job's model (expert.build_expert_model with init seed: one expert, the seed, trainable)
    made the two-way MoE, in place: top_k 2, a frozen copy of the seed inserted as slot 0 (the trunk's
    dtype for Linear weights), the trainable expert now slot 1, a frozen zero seed row, and a trainable
    row per layer (`router_learned`, (1, dim)), zero until `init_rows` sets it."""
    cfg = model.cfg
    model.cfg = replace(cfg, top_k=TOP_K)
    frozen = torch.bfloat16 if bf16_trunk else torch.float32
    for layer in model.layers:
        layer.cfg = model.cfg
        own = layer.experts[0]
        with torch.device("meta"):
            s = SwiGLU(cfg.dim, cfg.expert_ff)
        for part in ("gate", "up", "down"):
            w = getattr(own, part).weight.detach()  # (expert_ff, dim) or (dim, expert_ff), f32
            getattr(s, part)._parameters["weight"] = nn.Parameter(w.to(frozen).clone(), requires_grad=False)
        layer.experts.insert(0, s)  # slot 0: the seed, slot 1: the expert
        layer.router = nn.Parameter(torch.zeros(1, cfg.dim, device=dev), requires_grad=False)  # the seed's row
        layer.router_learned = nn.Parameter(torch.zeros(1, cfg.dim, device=dev), requires_grad=True)  # the expert's
    return model


def complement_params(model: Transformer) -> dict[str, nn.Parameter]:
    """The trainable parameters of the two-way MoE: slot 1's FFN and the learned router rows."""
    return {n: p for n, p in model.named_parameters() if ".experts.1." in n or n.endswith(".router_learned")}


@torch.no_grad()
def init_rows(model: Transformer, rd: RunDir, shard: np.ndarray, tokens: int, dev, precision: str) -> dict:
    """Set each layer's learned row from the domain's statistics (the module's docstring); returns the
    counts measured. Before training both FFNs are the seed, so these are the trunk's FFN inputs."""
    own, mixed = RouterStats(model.cfg.n_layers, model.cfg.dim), RouterStats(model.cfg.n_layers, model.cfg.dim)
    evaluate(model, shard, tokens, ROUTE, dev, precision, hook=own.hook)
    evaluate(model, load_tokens(rd.train_tokens, "the run's mixed training tokens"), tokens, ROUTE, dev, precision,
             hook=mixed.hook)
    for l, layer in enumerate(model.layers):
        d = own.sum[l] / max(own.count[l], 1) - mixed.sum[l] / max(mixed.count[l], 1)  # (C,) f64
        r = INIT_MARGIN * d / max(float(d @ d), 1e-12)  # (C,)
        layer.router_learned.copy_(r.float().reshape(1, -1))
    return {"complement_init_tokens": [own.n, mixed.n]}


def complement_tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """The module file's model tensors: the expert's FFN (slot 1) under the plain expert names, and its rows."""
    out = model.expert_tensors(1)
    for l, layer in enumerate(model.layers):
        out[LEARNED_ROW.format(l=l)] = layer.router_learned.detach().reshape(-1)  # (dim,)
    return out


@torch.no_grad()
def load_module(model: Transformer, tensors: dict[str, torch.Tensor]) -> None:
    """A complementing expert's module tensors into a `two_way` model: its FFN into slot 1, its rows."""
    model.load_expert(tensors, slot=1)
    for l, layer in enumerate(model.layers):
        layer.router_learned.copy_(tensors[LEARNED_ROW.format(l=l)].reshape(1, -1))
