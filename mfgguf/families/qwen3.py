"""qwen3: Qwen3 (dense). Qwen2 without biases, plus an RMSNorm over each Q and K head before RoPE, and a head
width of its own (Q is n_heads x head_dim wide, not the residual width).

llama.cpp's `qwen3moe` has no shared expert, so its MoE is the folded layout: the anchor folded into
every routed expert, exact because qwen3moe renormalises the top-k weights (norm_w = true).
"""

from mfgguf.families.family import Arch, Family

FAMILY = Family(
    name="qwen3", gguf_arch="qwen3", hf_archs=("Qwen3ForCausalLM",), rope="neox",
    moe_layouts={"folded": "qwen3moe"},
    archs=(
        Arch("qwen3", rope="neox"),
        Arch("qwen3moe", rope="neox", moe_keys=(("expert_feed_forward_length", "UINT32", "ff"),)),  # the folded width
    ),
    extras={"attn_q_norm.weight": "head", "attn_k_norm.weight": "head"},
    hf_names={"self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"},
    free_head_dim=True,
)
