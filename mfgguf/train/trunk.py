"""Train the trunk (module 0) from scratch on the mixed corpus: route "anchor", every parameter trains.

With `seed_expert` the trunk also trains one expert-width FFN beside the anchor (route "single"):
the seed, written to the trunk file, that every expert starts from (BTX: branch from a trained
dense model instead of growing FFNs from random weights next to a frozen trunk).

The dense baselines of `mfgguf eval` are the same call on a copy of the RUN with a wider anchor:
`train_trunk(copy, preset="small", anchor_ff=512 + 512, tokens=...)` (mfgguf/baselines.py).
Every `eval_every` steps the held-out loss is recorded (`heldout_history`): the training curve.
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from ..config import get_preset, with_overrides
from ..flops import trunk_step_flops
from ..errors import MfggufError
from ..model import trunk_model
from ..plots import loss_curve
from ..run import RunDir, module_name, write_module
from . import checkpoint as ckpt_io
from .loop import (check_token_range, heldout_losses, limit_heap_retention, load_tokens, resolve_device,
                   resolve_precision, result_meta, run_loop, split_overrides)

ACTIVATION_BUDGET = 1 << 30  # bytes of saved activations above which blocks are recomputed (auto)


def wants_recompute(cfg, batch_size: int) -> bool:
    """A rough estimate of activation memory for one step; recompute blocks when it exceeds the budget."""
    per_tok_layer = 4 * (12 * cfg.dim + 3 * (cfg.anchor_ff + cfg.expert_ff))  # bytes, bf16/f32 mix
    logits = 4 * 3 * cfg.vocab_size  # f32 logits, log-softmax and its gradient
    return batch_size * cfg.ctx_len * (cfg.n_layers * per_tok_layer + logits) > ACTIVATION_BUDGET


def train_trunk(run: Path, *, preset: str = "small", tokens: int | None = None, device: str = "cpu",
                progress: bool = True, precision: str = "auto", restart: bool = False,
                recompute: bool | None = None, **train_overrides) -> dict:
    """Train the trunk (embeddings, attention, norms, output head and the always-on anchor FFN) on the
    mixed training tokens of RUN; write modules/trunk.safetensors and its metadata. With
    `seed_expert=True` it also trains the seed FFN that experts start from (the trunk alone is then
    a dense model of FFN width anchor_ff + expert_ff).

    Resumes from RUN/checkpoints/trunk if a compatible checkpoint is there (--restart deletes it).
    Precision auto uses bf16 autocast where the CPU/GPU has native bf16, else fp32. Overrides
    accept TrainConfig fields (lr, batch_size, seed, ckpt_every, eval_tokens, ...) and ModelConfig
    fields (anchor_ff, dim, ...). Returns the module metadata (held-out loss per domain included).

    Example:
        >>> train_trunk(Path("RUN"), preset="tiny", tokens=40_000)["heldout_loss_mean"]
    """
    t_start = time.perf_counter()
    rd = RunDir(run)
    info = rd.info()
    p = get_preset(preset)
    t_over, m_over = split_overrides(train_overrides)
    cfg = replace(p.model, vocab_size=int(info["vocab_size"]), n_experts=int(info["n_experts"]), **m_over)
    cfg.validate()
    tc = with_overrides(p.trunk, tokens=tokens, **t_over)
    dev = resolve_device(device)
    prec = resolve_precision(precision, dev)
    data = load_tokens(rd.train_tokens, "the trunk's training tokens")
    check_token_range(data, cfg.vocab_size, str(rd.train_tokens))
    ckpt_dir = rd.checkpoint_dir(0)
    if restart:
        ckpt_io.remove(ckpt_dir)

    rec = wants_recompute(cfg, tc.batch_size) if recompute is None else recompute
    if rec:  # the memory-bound regime: keep freed buffers out of RSS
        limit_heap_retention()
    torch.manual_seed(tc.seed)
    model, route = trunk_model(cfg)
    model.reset_parameters(torch.Generator().manual_seed(tc.seed))  # init depends on the seed only
    model.to(dev)
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}  # not the (unused) router row
    ckpt_meta = {"module": "trunk", "kind": "trunk", "preset": preset, "model": cfg.to_dict(), "train": asdict(tc)}
    curve = lambda: heldout_losses(rd.heldout_dir, model, tc.curve_tokens, route, dev, prec)  # noqa: E731
    res = run_loop(model, named, data, tc, dev=dev, precision=prec, route=route, stream=0, ckpt_dir=ckpt_dir,
                   ckpt_meta=ckpt_meta, recompute=rec, progress=progress, label="trunk", heldout=curve)

    heldout = heldout_losses(rd.heldout_dir, model, tc.eval_tokens, route, dev, prec)
    if not heldout:
        raise MfggufError(f"no held-out tokens in {rd.heldout_dir}; re-create the run with `mfgguf prepare`")
    meta = result_meta(res, kind="trunk", preset=preset, cfg=cfg, tc=tc, info=info, dev=dev, precision=prec,
                       recompute=rec, heldout=heldout, t_start=t_start)
    meta["flops_per_token"] = trunk_step_flops(cfg).total  # mfgguf/flops.py conventions
    meta["train_flops"] = meta["flops_per_token"] * res.tokens_seen
    meta = write_module(rd, 0, model.trunk_tensors(), meta)
    loss_curve(rd.plots / f"loss_{module_name(0)}.png", res.history, heldout=heldout, curve=res.heldout_history,
               title=f"trunk ({preset}, {cfg.n_layers}x{cfg.dim}, {res.tokens_seen:,} tokens)")
    ckpt_io.remove(ckpt_dir)
    return meta
