"""qwen2: Qwen2 / Qwen2.5. Llama plus Q/K/V biases and NEOX RoPE (rotated halves, so no Q/K row permutation).

Its MoE is llama.cpp's `qwen2moe`: the anchor is the shared expert, whose output llama.cpp multiplies by
a sigmoid gate (writers/qwen2moe.py says how the anchor stays exact); qwen2moe does not renormalise the
top-k weights. The folded layout writes it as `llama` instead (Q/K rows permuted to adjacent pairs,
writers/base.py), exact at any top-k.
"""

from mfgguf.families.family import Arch, Family

FAMILY = Family(
    name="qwen2", gguf_arch="qwen2", hf_archs=("Qwen2ForCausalLM",), rope="neox",
    moe_layouts={"shared-expert": "qwen2moe", "folded": "llama"},
    archs=(
        Arch("qwen2", rope="neox"),
        Arch("qwen2moe", rope="neox", shared_expert=True, shexp_gated=True, renormalises_topk=False,
             moe_keys=(("expert_feed_forward_length", "UINT32", "expert_ff"),
                       ("expert_shared_feed_forward_length", "UINT32", "shexp_ff"))),
    ),
    extras={"attn_q.bias": "q", "attn_k.bias": "kv", "attn_v.bias": "kv"},
    hf_names={"self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
              "self_attn.v_proj.bias": "attn_v.bias"},
)
