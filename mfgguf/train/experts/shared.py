"""Experts that also train shared parameters: `train-expert --shared norms|attn|all`.

Against a frozen trunk an expert's tokens can only buy what new FFN features fix. With `--shared`
the expert job also trains its own private copy of some trunk tensors (`config.shared_tensor_names`:
the norms, + attention, or the whole trunk). The copies are f32 parameters with gradients and
AdamW state in their own optimizer groups (peak LR = lr * shared_lr_scale, same schedule); every
other trunk tensor stays frozen, without gradient or optimizer state. The module file stores each
trained copy as `shared.<trunk GGUF name>` (run.SHARED_PREFIX) with the trunk tensor's shape, and
assembly merges the experts' copies back into one trunk.

Memory: a shared parameter costs 16 bytes (f32 weight, gradient, two AdamW moments) instead of
the 2 bytes of a frozen bf16 weight. On `1b`, attention is ~31M parameters: ~0.5 GB more.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from mfgguf.config import ModelConfig, TrainConfig, shared_tensor_names
from mfgguf.errors import MfggufError
from mfgguf.model import Transformer, trunk_name_map
from mfgguf.run import SHARED_PREFIX


def shared_names(cfg: ModelConfig, choice: str) -> dict[str, str]:
    """{torch parameter name: trunk GGUF name} of the tensors `--shared choice` trains, in file order.

    Raises MfggufError for an unknown choice.

    Example:
        >>> list(shared_names(get_preset("tiny").model, "norms").items())[0]
        ('layers.0.attn_norm.weight', 'blk.0.attn_norm.weight')
    """
    by_gguf = {g: n for n, g in trunk_name_map(cfg.n_layers, cfg.family).items()}
    return {by_gguf[g]: g for g in shared_tensor_names(cfg, choice)}


def check_shared(tc: TrainConfig) -> None:
    """A clear error for a bad --shared choice or --shared-lr-scale before anything is loaded."""
    shared_tensor_names(ModelConfig(), tc.shared)  # raises for an unknown choice
    if not (math.isfinite(tc.shared_lr_scale) and tc.shared_lr_scale > 0):
        raise MfggufError(f"--shared-lr-scale must be a positive number, got {tc.shared_lr_scale}")


def shared_params(model: Transformer, choice: str) -> dict[str, nn.Parameter]:
    """The expert's private trunk copies: trainable f32 parameters (build_expert_model made them so)."""
    out = {}
    for name in shared_names(model.cfg, choice):
        p = model.get_parameter(name)
        assert p.requires_grad and p.dtype == torch.float32, f"{name} must be a trainable f32 copy"
        out[name] = p
    return out


def lr_scales(model: Transformer, tc: TrainConfig) -> dict[str, float]:
    """{parameter name: LR factor} for the shared copies (make_optimizer's separate groups)."""
    return {name: tc.shared_lr_scale for name in shared_names(model.cfg, tc.shared)}


def shared_module_tensors(model: Transformer, choice: str) -> dict[str, torch.Tensor]:
    """`shared.<trunk GGUF name>` -> the trained copy (trunk shape), for the expert's module file."""
    return {SHARED_PREFIX + g: model.get_parameter(n).detach() for n, g in shared_names(model.cfg, choice).items()}


def shared_meta(cfg: ModelConfig, choice: str) -> dict:
    """The expert JSON's record of what it shares: the choice and the trunk GGUF names, in file order."""
    return {"shared": choice, "shared_tensors": shared_tensor_names(cfg, choice)}
