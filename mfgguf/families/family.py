"""What one model family declares (the registry and its look-ups live in the package's __init__)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.family
    gguf_arch: str  # general.architecture of a dense file: what import reads and assembly writes for the trunk alone
    hf_archs: tuple[str, ...]  # config.json `architectures` read as this family
    rope: str  # "normal": llama.cpp rotates adjacent pairs (Q/K rows permuted from HF); "neox": halves, HF's own order
    # assemble --layout -> general.architecture of the MoE file: granitemoe = the anchor as an always-on shared
    # expert, mixtral = the anchor folded into every routed expert (assemble.py); a family without one refuses it;
    # the first is --layout auto's
    moe_layouts: dict[str, str]
    # per-block tensors beyond llama's, GGUF suffix -> size: "q" = n_heads * head_dim, "kv" = n_kv_heads * head_dim,
    # "head" = head_dim (1-D, kept F32 like norms)
    extras: dict[str, str] = field(default_factory=dict)
    hf_names: dict[str, str] = field(default_factory=dict)  # extra HF per-layer names -> GGUF suffix (with .weight/.bias)
    rope_freqs: bool = False  # a llama3-style `rope_freqs.weight` (per-pair frequency divisors) is computed
    free_head_dim: bool = False  # head_dim may differ from dim / n_heads (GGUF attention.key_length)
