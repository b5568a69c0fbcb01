"""qwen2moe -> Qwen2MoeForCausalLM: Q/K/V biases, NEOX RoPE (no permutation), the gated shared expert.

llama.cpp's qwen2moe graph and transformers' modeling_qwen2_moe.py both weight the top-k experts by
their softmax probabilities as they are (norm_w = false, norm_topk_prob = False) and multiply the
shared expert by sigmoid(shared_expert_gate . x). mfgguf's gate row (2^-64 everywhere,
converters/writers/qwen2moe.py) makes that sigmoid 0.5 in both, its doubled down projection undoes
it; the tensors are copied as they are, so the exported model computes what the file does.

Example:
    >>> Qwen2Moe(src).config("f32")["norm_topk_prob"]
    False
"""

from __future__ import annotations

from mfgguf.converters.hf.target import HFTensor, Target, qwen_experts, whole
from mfgguf.gguf.schema import blk


class Qwen2Moe(Target):
    arch = "qwen2moe"
    hf_class = "Qwen2MoeForCausalLM"
    model_type = "qwen2_moe"

    def attention_extras(self, l: int) -> list[HFTensor]:
        src, p = self.src, f"model.layers.{l}.self_attn."
        return [self._t(f"{p}{x}_proj.bias", whole(src, f"blk.{l}.attn_{x}.bias")) for x in "qkv"]

    def moe(self, l: int) -> list[HFTensor]:
        src, p = self.src, f"model.layers.{l}.mlp."
        return qwen_experts(self, l) + [
            self._t(f"{p}shared_expert.{f}_proj.weight", whole(src, blk(l, f"ffn_{f}_shexp"))) for f in ("gate", "up", "down")
        ] + [self._t(p + "shared_expert_gate.weight", whole(src, blk(l, "ffn_gate_inp_shexp")), shape=(1, self.s.dim))]

    def moe_config(self) -> dict:
        src = self.src
        ff, shared = src.shape(blk(0, "ffn_gate_exps"))[1], src.shape(blk(0, "ffn_gate_shexp"))[0]
        return {"intermediate_size": shared, "moe_intermediate_size": ff, "shared_expert_intermediate_size": shared,
                "num_experts": self.s.n_experts, "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
                "qkv_bias": True, "use_sliding_window": False, "sliding_window": None, "max_window_layers": self.s.n_layers}
