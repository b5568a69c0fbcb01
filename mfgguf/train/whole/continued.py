"""What a practitioner would do instead of experts: keep training the imported base itself, all of it or a LoRA.

Both start from the base exactly as the experts do (the imported trunk: anchor + seed = the base's
own FFN; on a synced RUN the trunk before the first sync, not the merged one, which holds the experts' own
attention training) and train on the union of the experts' shards, an equal share of each (every shard cut to
the shortest one's length, so no domain weighs more than the experts gave it), with the same
batch, context, precision and loop as an expert (train/engine/loop.py):
  - full:  continued pretraining: every parameter trains (embedding, attention, norms, FFNs, head);
  - lora:  peft's LoRA (rank `rank`, alpha = 2 x rank, every linear layer of every block: q, k, v,
           o, gate, up, down) injected into our own model; only the adapters train, and they are
           merged into the weights at the end, and also written unmerged as a llama.cpp adapter
           (OUT/lora.gguf, train/whole/adapter.py).
The result is a RUN of its own (out/<name>/, sharing the data) whose trunk is the trained base: `mfgguf
assemble OUT --experts none` writes it as a plain dense GGUF of the base's family with the base's
tokenizer, so llama.cpp scores it as it scores the MoE.

Example:
    >>> train_continued(RunDir("RUN"), Path("RUN/eval/continued-flop"), mode="full", tokens=180_224,
    ...                 lr=1e-4, shards=[1, 2, 4, 5])
"""

from __future__ import annotations

import shutil
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from mfgguf.config import DEFAULT_PRESET, ModelConfig, get_preset
from mfgguf.data.masks import union_masks
from mfgguf.errors import MfggufError
from mfgguf.families import family
from mfgguf.machine import startup_s
from mfgguf.modules.lora_adapter import ADAPTER_FILE, write_lora_adapter
from mfgguf.model import Transformer
from mfgguf.run import RunDir, data_view, read_module, write_module
from mfgguf.train.engine import checkpoint as ckpt_io
from mfgguf.train.engine.loop import validation_losses, limit_heap_retention, load_tokens, mean, resolve_device, resolve_precision, run_loop
from mfgguf.train.engine.records import Checkpoints, Drive, StepSetup
from mfgguf.train.whole.trunk import plan_activations
from mfgguf.train.engine.weights import trunk_alone
from mfgguf.train.whole.adapter import adapter_tensors

MODES = ("full", "lora")
CKPT_SECONDS = 600.0  # a killed run resumes losing at most this much training; a save of the whole state (weights
#                       and both AdamW moments, 12 bytes a parameter) takes seconds, not counted in its tokens/s
LORA_TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "gate", "up", "down")  # every linear of a block


def union_tokens(rd: RunDir, shards: list[int]) -> np.ndarray:
    """The shards' tokens, each cut to the shortest one's length, concatenated: (n_shards * shortest,)."""
    parts = [load_tokens(rd.shard(i), f"shard {i}") for i in shards]
    n = min(len(p) for p in parts)
    return np.concatenate([np.asarray(p[:n]) for p in parts])


def resumable(out: Path, ckpt_meta: dict) -> bool:
    """OUT holds the checkpoint of this very training (a `train-base` killed part way): it resumes from it."""
    state = ckpt_io.peek(RunDir(out).checkpoint_dir(0))
    return bool(state) and ckpt_io.mismatch(state, ckpt_meta) is None


def train_continued(rd: RunDir, out: Path, *, mode: str, tokens: int, lr: float, shards: list[int], rank: int = 16,
                    seed: int | None = None, device: str = "cpu", precision: str = "auto", compile: str = "off",
                    progress: bool = False, force: bool = False) -> RunDir:
    """Train the imported base of RUN on its experts' data as a practitioner would instead of experts: continued
    pretraining of every parameter (--mode full) or a peft LoRA on every linear layer (--mode lora, merged at the
    end), on the union of the shards (each cut to the shortest), with an expert's batch, context and precision.
    Writes a RUN at OUT whose trunk is the trained base: `mfgguf assemble OUT --experts none` makes it a GGUF.
    --mode lora also writes OUT/lora.gguf, the same LoRA unmerged as a llama.cpp adapter of the base's own
    dense GGUF (`mfgguf assemble RUN --experts none`), to serve one adapter per domain (`--lora`).
    `mfgguf eval` trains these itself on an imported run (FLOP- and wall-clock-matched, LR from a small grid).
    --seed sets the data order and the LoRA's initialisation (default: the preset's data order). A run killed
    part way resumes from its last checkpoint (one every ten minutes) when the same command runs again; an OUT
    holding anything else is replaced only with --force.

    Example:
        mfgguf train-base RUN -o RUN/lora --mode lora --tokens 65536 --lr 1e-3 --shards 1,2"""
    if mode not in MODES:
        raise MfggufError(f"unknown baseline mode {mode!r}; choose one of {', '.join(MODES)}")
    t_start = time.perf_counter()
    # the trunk before any sync: a synced RUN's modules/ holds the merged trunk, which carries the experts' training
    first, first_meta = rd.first_trunk
    trunk = read_module(rd, 0, at=(first, first_meta))
    if trunk.source != "base":
        raise MfggufError(f"{rd.root}'s trunk was trained here, not imported; continued pretraining starts from a base")
    n = rd.run_info().n_experts
    if not shards or any(not 1 <= i <= n for i in shards):
        raise MfggufError(f"--shards {','.join(map(str, shards))} is out of range; this run has shards 1..{n}")
    cfg = ModelConfig.from_dict(trunk.config)
    dev = resolve_device(device)
    prec = resolve_precision(precision, dev)
    expert_tc = get_preset(trunk.preset or DEFAULT_PRESET).expert
    tc = replace(expert_tc, tokens=int(tokens), lr=float(lr), eval_every=0, eval_tokens=4096, ckpt_every=10**9,
                 compile=compile, shared="none", rounds=1)
    if seed is not None:
        tc = replace(tc, seed=int(seed))
    ckpt_meta = {"module": "continued", "kind": mode, "tokens": tc.tokens, "lr": tc.lr, "shards": list(shards),
                 "seed": tc.seed, "rank": rank if mode == "lora" else None, "from_trunk_sha256": trunk.sha256}
    resume = resumable(out, ckpt_meta)
    if Path(out).exists() and not (force or resume):
        raise MfggufError(f"{out} already exists; pass --force to replace it")
    data = union_tokens(rd, shards)
    view = data_view(rd, out, keep_checkpoints=resume)
    model, route = trunk_alone(first, cfg, dev)  # f32 master weights; bf16 autocast in the loop
    if mode == "lora":
        if seed is not None:  # without one, peft draws from torch's generator as it stands, as before --seed existed
            torch.manual_seed(int(seed))
        named = _inject_lora(model, rank)
    else:
        named = {n: p for n, p in model.named_parameters()}
        for p in named.values():
            p.requires_grad_(True)
    setup = StepSetup(dev, prec, route, *plan_activations(cfg, tc.batch_size))  # (recompute, micro): the fields in order
    if setup.recompute:
        limit_heap_retention()
    mask = union_masks([rd.shard(i) for i in shards], len(data) // len(shards))
    res = run_loop(model, named, data, tc, setup=setup, ckpt=Checkpoints(view.checkpoint_dir(0), ckpt_meta, every_s=CKPT_SECONDS),
                   drive=Drive(stream=0, label=f"base, {mode}", progress=progress, mask=mask))
    fresh = res.tokens_seen - res.resumed_from * tc.batch_size * cfg.ctx_len  # this process's tokens: its speed
    adapter = None
    if mode == "lora":  # llama.cpp's own form of the same LoRA, for serving it unmerged beside the base
        adapter = write_lora_adapter(view.root / ADAPTER_FILE, family(cfg.family).gguf_arch, adapter_tensors(model),
                                     name=f"mfgguf-lora-{'-'.join(map(str, shards))}")
        model = _merged(model, cfg)
    held = validation_losses(view.validation_dir, model, tc.eval_tokens, route, dev, prec)
    tensors = {k: v.detach().float().contiguous() for k, v in model.trunk_tensors().items()}
    meta = {**{k: trunk.to_json()[k] for k in ("kind", "source", "base", "preset", "config")},  # as the base has them
            "train": {**tc.__dict__}, "precision": prec, "steps": res.steps, "tokens_seen": res.tokens_seen,
            "final_loss": res.final_loss, "train_s": res.train_s, "tokens_per_s": fresh / max(res.train_s, 1e-9),
            "resumed_from_step": res.resumed_from, "ckpt_s": round(res.ckpt_s, 2), "epochs": res.epochs,
            "validation_loss": held, "validation_loss_mean": mean(held), "history": res.history,
            # resumed: the killed processes' training seconds too, so the wall is the training's, not its last process's
            "wall_s": time.perf_counter() - t_start + res.train_s_before, "resumed_train_s": res.train_s_before,
            "startup_s": startup_s(t_start),  # this process's start before t_start (imports), which wall_s misses
            "continued": {"mode": mode, "from_trunk_sha256": trunk.sha256, "shards": list(shards), "lr": lr,
                          "seed": seed, "rank": rank if mode == "lora" else None, "micro_batch": setup.micro,
                          "adapter": adapter.name if adapter else None,
                          "trained_params": sum(p.numel() for p in named.values())}}
    write_module(view, 0, tensors, meta)
    shutil.rmtree(view.checkpoint_dir(0), ignore_errors=True)
    return view


def _inject_lora(model: Transformer, rank: int) -> dict[str, torch.nn.Parameter]:
    """peft's LoRA adapters into every block's linear layers of our own model, in place; the adapters' parameters."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise MfggufError("the LoRA baseline needs peft: pip install 'mfgguf[bench]' (or pass --baselines without"
                          " lora)") from None
    for p in model.parameters():
        p.requires_grad_(False)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(LORA_TARGETS), bias="none")
    inject_adapter_in_model(cfg, model)
    named = {n: p for n, p in model.named_parameters() if "lora_" in n}
    for p in named.values():
        p.requires_grad_(True)
    return named


@torch.no_grad()
def _merged(model: Transformer, cfg: ModelConfig) -> Transformer:
    """The LoRA-injected model with its adapters merged into the weights, as a plain Transformer again."""
    from peft.tuners.lora import LoraLayer

    for m in model.modules():
        if isinstance(m, LoraLayer):
            m.merge()
    plain = Transformer(cfg, n_experts=len(model.layers[0].experts))
    sd = {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items() if "lora_" not in k}
    plain.load_state_dict(sd)
    return plain.to(next(model.parameters()).device)
