"""peft's LoRA of our model as the pairs of a llama.cpp adapter for the base's dense GGUF.

The dense file (`assemble --experts none`) holds one SwiGLU a block: the anchor's rows and then the
seed's (the imported base's own FFN, split in two for the experts), the down columns likewise. peft
adapted the anchor's and the seed's linears separately, each of rank r, so the file's FFN tensor gets
one pair of rank 2r that computes both exactly:
  gate/up: A = [A_anchor; A_seed]          (2r, dim),  B = blockdiag(B_anchor, B_seed)  (ff, 2r)
  down:    A = blockdiag(A_anchor, A_seed) (2r, ff),   B = [B_anchor, B_seed]           (dim, 2r)
Attention linears map one to one. peft's scale (alpha / r) is folded into B (gguf/lora.py).

Example:
    >>> tensors = adapter_tensors(model)   # model: _inject_lora'd and trained, before merging
"""

from __future__ import annotations

import numpy as np
import torch

ATTENTION = ("attn_q", "attn_k", "attn_v", "attn_output")


def _pair(linear) -> tuple[np.ndarray, np.ndarray]:
    """(A (r, in), B * scale (out, r)) of one peft LoRA linear, float32."""
    a = linear.lora_A["default"].weight.detach().float()  # (r, in)
    b = linear.lora_B["default"].weight.detach().float() * float(linear.scaling["default"])  # (out, r)
    return a.numpy(), b.numpy()


def _block_diag(*ms: np.ndarray) -> np.ndarray:
    return torch.block_diag(*map(torch.from_numpy, ms)).numpy()


def _ffn_pairs(parts: list) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The joined anchor (+ seed) FFN's pair per projection, as the dense file lays the SwiGLU out."""
    out = {}
    for f in ("gate", "up"):  # rows stacked: each part's B fills its own rows
        ab = [_pair(getattr(p, f)) for p in parts]
        out[f] = (np.concatenate([a for a, _ in ab], 0), _block_diag(*[b for _, b in ab]))
    ab = [_pair(p.down) for p in parts]  # columns joined: each part's A reads its own columns
    out["down"] = (_block_diag(*[a for a, _ in ab]), np.concatenate([b for _, b in ab], 1))
    return out


@torch.no_grad()
def adapter_tensors(model) -> dict[str, np.ndarray]:
    """GGUF adapter tensors `blk.{l}.<tensor>.weight.lora_a/.lora_b` of a LoRA-injected trunk (not merged)."""
    t: dict[str, np.ndarray] = {}
    for l, layer in enumerate(model.layers):
        pairs = {name: _pair(getattr(layer, name)) for name in ATTENTION}
        parts = [layer.anchor] + list(layer.experts[:1])  # the seed, where the trunk has one, is expert 0
        pairs |= {f"ffn_{f}": ab for f, ab in _ffn_pairs(parts).items()}
        for name, (a, b) in pairs.items():
            t[f"blk.{l}.{name}.weight.lora_a"] = np.ascontiguousarray(a)
            t[f"blk.{l}.{name}.weight.lora_b"] = np.ascontiguousarray(b)
    return t
