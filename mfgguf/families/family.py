"""What one model family declares (the registry and its look-ups live in the package's __init__)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Arch:
    """A GGUF architecture mfgguf writes, as its llama.cpp graph sees it: what assembly, the reference forward,
    `calibrate` and `extend` must know of it. Declared by the family file that writes it first."""

    name: str  # general.architecture
    rope: str  # how its graph rotates RoPE pairs: "normal" adjacent pairs, "neox" halves (writers/base.py permutes)
    shared_expert: bool = False  # has `*_shexp` tensors: the anchor is the always-on shared expert
    shexp_gated: bool = False  # the shared expert is scaled by sigmoid(`ffn_gate_inp_shexp` . x) (writers/qwen2moe.py)
    # the graph divides the top-k softmax weights by their sum (llama.cpp's norm_w); False: top-1 is p x expert
    renormalises_topk: bool = True
    # MoE keys beyond the common ones, as (key after `{arch}.`, value type, value: one | shexp_ff | expert_ff | ff,
    # the routed experts' width as written); gguf/schema.model_kv writes them
    moe_keys: tuple[tuple[str, str, str], ...] = ()


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.family
    gguf_arch: str  # general.architecture of a dense file: what import reads and assembly writes for the trunk alone
    hf_archs: tuple[str, ...]  # config.json `architectures` read as this family
    rope: str  # "normal": llama.cpp rotates adjacent pairs (Q/K rows permuted from HF); "neox": halves, HF's own order
    # assemble --layout -> general.architecture of the MoE file: shared-expert = the anchor as an always-on shared
    # expert, folded = the anchor folded into every routed expert (assemble.py); a family without one refuses it;
    # the first is --layout auto's
    moe_layouts: dict[str, str]
    # the architectures this family brings (its dense one, its MoE ones), each declared once; another family may
    # write them too (qwen2's folded layout is llama's `llama`)
    archs: tuple[Arch, ...] = ()
    # per-block tensors beyond llama's, GGUF suffix -> size: "q" = n_heads * head_dim, "kv" = n_kv_heads * head_dim,
    # "head" = head_dim (1-D, kept F32 like norms)
    extras: dict[str, str] = field(default_factory=dict)
    hf_names: dict[str, str] = field(default_factory=dict)  # extra HF per-layer names -> GGUF suffix (with .weight/.bias)
    rope_freqs: bool = False  # a llama3-style `rope_freqs.weight` (per-pair frequency divisors) is computed
    free_head_dim: bool = False  # head_dim may differ from dim / n_heads (GGUF attention.key_length)
