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
    moe_layouts={"shared-expert": "granitemoe", "folded": "llama"}, rope_freqs=True,
    archs=(
        Arch("llama", rope="normal"),  # the trunk alone, and the folded layout (experts with the anchor folded in)
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


def llama3_params(factors, head_dim: int, theta: float) -> dict | None:
    """A `rope_type: llama3` parameter dict whose `llama3_factors` are `factors` (a file's rope_freqs tensor), or
    None where no such dict gives them. The factors fix `factor` and the two wavelengths between which they blend
    (original_max_position_embeddings / low_freq_factor and / high_freq_factor), not the three numbers apart:
    low_freq_factor is taken as 1 (Llama 3's own), so original_max_position_embeddings is the long wavelength."""
    r = np.asarray(factors, dtype=np.float64)  # (head_dim / 2,)
    freqs = 1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))
    w = (np.float32(2 * math.pi) / freqs.astype(np.float32)).astype(np.float64)  # wavelengths, shortest first
    factor = float(r.max())
    if factor <= 1.0:
        return None
    mid = (r > 1 + 1e-6) & (r < factor * (1 - 1e-6))  # in the blend: smooth = (old / w - low) / (high - low)
    smooth = (1 / r[mid] - 1 / factor) / (1 - 1 / factor)
    short, long_ = w[r <= 1 + 1e-6], w[r >= factor * (1 - 1e-6)]
    if mid.sum() >= 2:  # smooth is linear in 1 / w: its two ends are the blend's wavelengths
        a, b = np.polyfit(1 / w[mid], smooth, 1)
        w_high, w_low = 1 / ((1 - b) / a), 1 / (-b / a)  # smooth 1 and smooth 0
    else:  # the blend holds one pair or none: wavelengths between the neighbours, in Llama 3's ratio of 4
        lo = short.max() if short.size else w.min() / 2
        hi = long_.min() if long_.size else w.max() * 2
        if mid.sum() == 1:
            s, x = float(smooth[0]), 1 / float(w[mid][0])  # x = (1 - s) / w_low + s / w_high, w_low = 4 w_high
            w_high = (0.25 * (1 - s) + s) / x
            w_low = 4 * w_high
        else:
            w_high, w_low = lo * 1.0001, hi * 0.9999
    old = max(1, int(round(w_low)))
    snap = lambda x: float(round(x)) if abs(x - round(x)) < 1e-5 else float(x)  # noqa: E731  (fit noise off 1, 4)
    params = {"rope_type": "llama3", "factor": snap(factor), "low_freq_factor": snap(old / w_low),
              "high_freq_factor": snap(old / w_high), "original_max_position_embeddings": old}
    back = np.asarray(llama3_factors(params, head_dim, theta))
    return params if np.abs(back - r).max() <= 1e-4 * factor else None
