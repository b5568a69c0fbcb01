"""qwen3moe (a qwen3 trunk, the anchor folded into every expert) -> Qwen3MoeForCausalLM.

llama.cpp's qwen3moe graph and transformers' modeling_qwen3_moe.py both divide the top-k softmax
weights by their sum (norm_w = true, norm_topk_prob = True), which is what makes the folded anchor exact
at any top-k; each head's Q and K pass an RMSNorm of their own before NEOX RoPE (no permutation), and a
head may be wider than dim / n_heads (`attention.key_length`, config `head_dim`).

Example:
    >>> Qwen3Moe(src).config("f32")["norm_topk_prob"]
    True
"""

from __future__ import annotations

from mfgguf.converters.hf.target import HFTensor, Target, qwen_experts, whole
from mfgguf.gguf.schema import blk


class Qwen3Moe(Target):
    arch = "qwen3moe"
    hf_class = "Qwen3MoeForCausalLM"
    model_type = "qwen3_moe"

    def attention_extras(self, l: int) -> list[HFTensor]:
        src, p = self.src, f"model.layers.{l}.self_attn."
        return [self._t(f"{p}{x}_norm.weight", whole(src, blk(l, f"attn_{x}_norm"))) for x in "qk"]

    def moe(self, l: int) -> list[HFTensor]:
        return qwen_experts(self, l)

    def moe_config(self) -> dict:
        ff = self.src.shape(blk(0, "ffn_gate_exps"))[1]
        return {"intermediate_size": ff, "moe_intermediate_size": ff, "num_experts": self.s.n_experts,
                "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "head_dim": self.s.head_dim,
                "attention_bias": False, "use_sliding_window": False, "sliding_window": None}
