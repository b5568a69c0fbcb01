"""granitemoe -> GraniteMoeSharedForCausalLM: the anchor as the always-on shared MLP, the experts routed beside it.

llama.cpp's granite graph and transformers' modeling_granitemoeshared.py compute the same function:
softmax over the top-k router logits (transformers) is llama.cpp's softmax over all of them, top-k,
divided by their sum (norm_w); the shared MLP is added ungated; Granite's four multipliers are the
file's keys where it has them (`embedding_scale`, `residual_scale`, `attention.scale`, `logit_scale`,
which transformers divides the logits by as llama.cpp does), else llama.cpp's defaults: 1, none,
1/sqrt(head_dim), 1. mfgguf writes only logit_scale = 1, so its files are a plain llama trunk.
The checkpoint uses Granite's published names: `block_sparse_moe.input_linear` (experts, 2 ff, dim),
each expert's gate rows then its up rows, `output_linear` (experts, dim, ff), `router.layer`,
`shared_mlp.input_linear` (gate rows, then up) and `shared_mlp.output_linear`.

Example:
    >>> GraniteMoeShared(src).config("f32")["shared_intermediate_size"]
"""

from __future__ import annotations

import math

from mfgguf.converters.hf.target import HFTensor, Target, expert_rows, whole
from mfgguf.gguf.schema import blk


class GraniteMoeShared(Target):
    arch = "granitemoe"
    hf_class = "GraniteMoeSharedForCausalLM"
    model_type = "granitemoeshared"
    scales = True

    def moe(self, l: int) -> list[HFTensor]:
        src, s, p = self.src, self.s, f"model.layers.{l}."
        ff, E = src.shape(blk(l, "ffn_gate_exps"))[1], s.n_experts
        gate_up = [x for e in range(E) for x in (expert_rows(src, blk(l, "ffn_gate_exps"), e),
                                                 expert_rows(src, blk(l, "ffn_up_exps"), e))]
        out = [self._t(p + "block_sparse_moe.router.layer.weight", whole(src, blk(l, "ffn_gate_inp"))),
               self._t(p + "block_sparse_moe.input_linear.weight", *gate_up, shape=(E, 2 * ff, s.dim)),
               self._t(p + "block_sparse_moe.output_linear.weight", whole(src, blk(l, "ffn_down_exps")),
                       shape=(E, s.dim, ff))]
        if self.shared_ff:
            out += [self._t(p + "shared_mlp.input_linear.weight", whole(src, blk(l, "ffn_gate_shexp")),
                            whole(src, blk(l, "ffn_up_shexp"))),
                    self._t(p + "shared_mlp.output_linear.weight", whole(src, blk(l, "ffn_down_shexp")))]
        return out

    @property
    def shared_ff(self) -> int:
        """The shared expert's width; 0: none (a GraniteMoe file without one)."""
        return self.src.shape(blk(0, "ffn_gate_shexp"))[0] if self.src.has(blk(0, "ffn_gate_shexp")) else 0

    def moe_config(self) -> dict:
        src, a = self.src, self.src.arch
        return {"intermediate_size": src.shape(blk(0, "ffn_gate_exps"))[1], "shared_intermediate_size": self.shared_ff,
                "num_local_experts": self.s.n_experts, "attention_bias": False,
                "embedding_multiplier": float(src.kv(f"{a}.embedding_scale", 1.0)),
                "residual_multiplier": float(src.kv(f"{a}.residual_scale", 1.0) or 1.0),  # llama.cpp: 0 = none
                "attention_multiplier": float(src.kv(f"{a}.attention.scale", 0.0) or 1 / math.sqrt(self.s.head_dim)),
                "logits_scaling": float(src.kv(f"{a}.logit_scale", 1.0))}
