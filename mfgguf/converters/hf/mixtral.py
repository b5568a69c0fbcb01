"""The folded layout (`llama` with experts, the anchor folded into every expert) -> MixtralForCausalLM.

llama.cpp's llama graph with experts and transformers' modeling_mixtral.py both take the softmax
over all router logits, keep the top-k and divide them by their sum; each expert is one SwiGLU
(w1 gate, w3 up, w2 down). A qwen2 trunk written in this layout keeps its Q/K/V biases, which Mixtral
has no place for: it is refused (its shared-expert layout, qwen2moe, exports as Qwen2-MoE).

Example:
    >>> Mixtral(src).tensors()[-1].name
    'model.layers.1.block_sparse_moe.experts.2.w2.weight'
"""

from __future__ import annotations

from mfgguf.converters.hf.target import HFTensor, Target, routed_experts
from mfgguf.errors import MfggufError
from mfgguf.gguf.schema import blk

W = {"gate": "w1", "up": "w3", "down": "w2"}  # Mixtral's expert names


class Mixtral(Target):
    arch = "llama"
    hf_class = "MixtralForCausalLM"
    model_type = "mixtral"

    def _check(self) -> None:
        super()._check()
        if self.src.has("blk.0.attn_q.bias"):
            raise MfggufError(f"{self.src.path} is the folded layout of a qwen2 trunk (llama with Q/K/V biases), which"
                              " no transformers class computes; assemble it with --layout shared-expert (qwen2moe) to export it")

    def moe(self, l: int) -> list[HFTensor]:
        return routed_experts(self, l, f"model.layers.{l}.block_sparse_moe.", W)

    def moe_config(self) -> dict:
        return {"intermediate_size": self.src.shape(blk(0, "ffn_gate_exps"))[1], "num_local_experts": self.s.n_experts,
                "head_dim": self.s.head_dim, "sliding_window": None, "router_jitter_noise": 0.0}
