"""llama: Llama 1-3.x, SmolLM, mfgguf's own trunks.

Llama 3.x's `llama3` rope scaling divides each RoPE pair's frequency by a factor: 1 for short
wavelengths, `factor` for long ones, a smooth blend between. llama.cpp reads the factors from the
tensor `rope_freqs.weight`; `llama3_factors` computes them from config.json as its converter does
(convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors, in f32), which is transformers'
`_compute_llama3_parameters` written as divisors.
"""

from __future__ import annotations

import math

import numpy as np

from mfgguf.families.family import Arch, Family

FAMILY = Family(
    name="llama", gguf_arch="llama", hf_archs=("LlamaForCausalLM",), rope="normal",
    moe_layouts={"granitemoe": "granitemoe", "mixtral": "llama"}, rope_freqs=True,
    archs=(
        Arch("llama", rope="normal"),  # the trunk alone, and the mixtral layout (experts with the anchor folded in)
        # granitemoe's logit_scale is required by llama.cpp's granite loader; 1.0 (and no residual, embedding or
        # attention scales) makes the graph plain llama
        Arch("granitemoe", rope="normal", shared_expert=True,
             moe_keys=(("logit_scale", "FLOAT32", "one"), ("expert_shared_feed_forward_length", "UINT32", "shexp_ff"))),
    ),
)


def llama3_factors(params: dict, head_dim: int, theta: float) -> tuple[float, ...]:
    """(head_dim / 2,) f32 frequency divisors of a `rope_type: llama3` rope_scaling / rope_parameters dict."""
    freqs = (1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))))
    factor = float(params.get("factor", 8.0))
    low, high = float(params.get("low_freq_factor", 1.0)), float(params.get("high_freq_factor", 4.0))
    old = float(params.get("original_max_position_embeddings", 8192))
    out = []
    for f in freqs.astype(np.float32):
        wavelen = np.float32(2 * math.pi) / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (np.float32(old) / wavelen - np.float32(low)) / np.float32(high - low)
            out.append(1 / ((1 - smooth) / np.float32(factor) + smooth))
    return tuple(float(np.float32(x)) for x in out)
