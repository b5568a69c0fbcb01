"""What every output architecture of `export-hf` shares: the Hugging Face tensors as pieces of GGUF tensors, the
llama-style trunk (embedding, norms, attention, head) and the common config.json keys.

An output tensor is the rows of one or more GGUF tensors, in order (`Piece`): a stacked expert tensor
`ffn_gate_exps` (experts, ff, dim) gives expert e's rows e*ff .. (e+1)*ff, Granite's fused `input_linear`
is expert e's gate rows then its up rows. A file whose graph rotates adjacent RoPE pairs (llama.cpp's
"normal" rope: `llama`, `granitemoe`) holds Q and K rows permuted from Hugging Face's rotate-half order
(convert_hf_to_gguf.py's permute); those pieces are un-permuted on the way out. A subclass per output
architecture (one file each, as mergekit's architecture definitions) adds its MoE block and config keys.

Example:
    >>> t = GraniteMoeShared(src)
    >>> t.tensors()[0]
    HFTensor(name='model.embed_tokens.weight', shape=(512, 64), pieces=(Piece('token_embd.weight', 0, 512),))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mfgguf.converters.hf.source import GGUFSource
from mfgguf.errors import MfggufError
from mfgguf.gguf.schema import ARCH_ROPE, blk

ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's per-pair RoPE frequency divisors (Llama 3.x)


@dataclass(frozen=True)
class Piece:
    tensor: str  # GGUF tensor name
    r0: int  # first row (of the tensor seen as rows: numpy's last dimension is the row)
    r1: int  # one past the last row
    heads: int = 0  # > 0: the rows are RoPE-permuted over this many heads (the whole tensor); un-permute them


@dataclass(frozen=True)
class HFTensor:
    name: str  # the Hugging Face checkpoint's name
    shape: tuple[int, ...]  # numpy / torch shape
    pieces: tuple[Piece, ...]  # their rows, in order, are this tensor's


@dataclass(frozen=True)
class Shape:
    """A GGUF's model shape, from its keys and tensors."""

    dim: int  # hidden_size
    n_layers: int  # num_hidden_layers
    n_heads: int  # num_attention_heads
    n_kv_heads: int  # num_key_value_heads
    head_dim: int  # attention.key_length, else dim / n_heads
    vocab: int  # token_embd's rows
    n_experts: int  # routed experts
    top_k: int  # experts used per token
    ctx: int  # context_length
    rope_theta: float  # rope.freq_base
    eps: float  # RMSNorm epsilon
    tied: bool  # no output.weight: the head is the embedding

    @classmethod
    def read(cls, src: GGUFSource) -> "Shape":
        a = src.arch
        n_heads, dim = int(src.kv(f"{a}.attention.head_count")), int(src.kv(f"{a}.embedding_length"))
        hd = int(src.kv(f"{a}.attention.key_length", dim // n_heads))
        return cls(dim=dim, n_layers=int(src.kv(f"{a}.block_count")), n_heads=n_heads,
                   n_kv_heads=int(src.kv(f"{a}.attention.head_count_kv", n_heads)), head_dim=hd,
                   vocab=src.shape("token_embd.weight")[0], n_experts=int(src.kv(f"{a}.expert_count", 0)),
                   top_k=int(src.kv(f"{a}.expert_used_count", 0)), ctx=int(src.kv(f"{a}.context_length")),
                   rope_theta=float(src.kv(f"{a}.rope.freq_base", 10000.0)),
                   eps=float(src.kv(f"{a}.attention.layer_norm_rms_epsilon")), tied=not src.has("output.weight"))


def whole(src: GGUFSource, name: str, heads: int = 0) -> Piece:
    return Piece(name, 0, src.n_rows(name), heads)


def expert_rows(src: GGUFSource, name: str, e: int) -> Piece:
    """Expert e's rows of a stacked `_exps` tensor (experts, rows, cols)."""
    n = src.shape(name)[1]
    return Piece(name, e * n, (e + 1) * n)


class Target:
    """One Hugging Face architecture that computes what llama.cpp computes for GGUF architecture `arch`."""

    arch = ""  # general.architecture read
    hf_class = ""  # config.json `architectures`
    model_type = ""  # config.json `model_type`
    scales = False  # the class has Granite's multipliers (attention, embedding, residual, logits)

    def __init__(self, src: GGUFSource):
        self.src = src
        self.s = Shape.read(src)
        self._check()

    def _check(self) -> None:
        """Refuse what the class does not compute: rope scaling, partial rotary, a custom attention scale."""
        src, a, s = self.src, self.src.arch, self.s
        what = f"{src.path} ({a})"
        if str(src.kv(f"{a}.rope.scaling.type", "none")) not in ("none", ""):
            raise MfggufError(f"{what} uses rope scaling, which export-hf does not write; export a file without it")
        if int(src.kv(f"{a}.rope.dimension_count", s.head_dim)) != s.head_dim:
            raise MfggufError(f"{what} rotates part of each head (partial RoPE), which {self.hf_class} does not compute")
        if not s.n_experts:
            raise MfggufError(f"{what} is dense (no experts); export-hf takes an assembled MoE")
        if src.kv(f"{a}.attention.scale", None) is not None and not self.scales:
            raise MfggufError(f"{what} sets its own attention scale, which {self.hf_class} does not compute")

    @property
    def permuted(self) -> bool:
        """Q/K rows in llama.cpp's adjacent-pair order, to be put back in rotate-half order."""
        return ARCH_ROPE.get(self.src.arch) == "normal"

    def _t(self, name: str, *pieces: Piece, shape: tuple[int, ...] | None = None) -> HFTensor:
        """The tensor made of `pieces`: (rows, cols), a 1-D tensor's (cols,), or `shape` (same size) if given."""
        rows, src_shape = sum(p.r1 - p.r0 for p in pieces), self.src.shape(pieces[0].tensor)
        natural = (rows, src_shape[-1]) if len(src_shape) > 1 or rows > 1 else (src_shape[-1],)
        if shape is not None:
            assert math.prod(shape) == math.prod(natural), (name, shape, natural)
        return HFTensor(name, shape or natural, pieces)

    def tensors(self) -> list[HFTensor]:
        src, s = self.src, self.s
        out = [self._t("model.embed_tokens.weight", whole(src, "token_embd.weight")),
               self._t("model.norm.weight", whole(src, "output_norm.weight"))]
        if not s.tied:
            out.append(self._t("lm_head.weight", whole(src, "output.weight")))
        for l in range(s.n_layers):
            p = f"model.layers.{l}."
            q_heads, k_heads = (s.n_heads, s.n_kv_heads) if self.permuted else (0, 0)
            out += [self._t(p + "input_layernorm.weight", whole(src, blk(l, "attn_norm"))),
                    self._t(p + "post_attention_layernorm.weight", whole(src, blk(l, "ffn_norm"))),
                    self._t(p + "self_attn.q_proj.weight", whole(src, blk(l, "attn_q"), q_heads)),
                    self._t(p + "self_attn.k_proj.weight", whole(src, blk(l, "attn_k"), k_heads)),
                    self._t(p + "self_attn.v_proj.weight", whole(src, blk(l, "attn_v"))),
                    self._t(p + "self_attn.o_proj.weight", whole(src, blk(l, "attn_output")))]
            out += self.attention_extras(l) + self.moe(l)
        return out

    def attention_extras(self, l: int) -> list[HFTensor]:
        """Per-layer attention tensors beyond llama's (Qwen2's biases, Qwen3's Q/K norms)."""
        return []

    def moe(self, l: int) -> list[HFTensor]:
        raise NotImplementedError

    def config(self, dtype: str) -> dict:
        """config.json: the keys every architecture here has, then the subclass's."""
        src, s = self.src, self.s
        tok = {k: int(v) for k in ("bos", "eos", "padding")
               if (v := src.kv(f"tokenizer.ggml.{k}_token_id", None)) is not None}
        return {
            "architectures": [self.hf_class], "model_type": self.model_type,
            "vocab_size": s.vocab, "hidden_size": s.dim, "num_hidden_layers": s.n_layers,
            "num_attention_heads": s.n_heads, "num_key_value_heads": s.n_kv_heads, "hidden_act": "silu",
            "max_position_embeddings": s.ctx, "rms_norm_eps": s.eps, "rope_theta": s.rope_theta,
            "rope_parameters": self.rope(), **self.rope_scaling(),
            "tie_word_embeddings": s.tied, "bos_token_id": tok.get("bos"), "eos_token_id": tok.get("eos"),
            "pad_token_id": tok.get("padding"), "torch_dtype": {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[dtype],
            "use_cache": True, "attention_dropout": 0.0, "initializer_range": 0.02, "output_router_logits": False,
            "router_aux_loss_coef": 0.001, "num_experts_per_tok": s.top_k, **self.moe_config(),
        }

    def moe_config(self) -> dict:
        raise NotImplementedError

    def config_tensors(self) -> set[str]:
        """Tensors the config holds instead of the checkpoint: Llama 3.x's RoPE factors."""
        return {ROPE_FREQS} if self.src.has(ROPE_FREQS) else set()

    def rope(self) -> dict:
        """transformers' `rope_parameters`: the default rotation, or a file's `rope_freqs` factors (Llama 3.x, llama.cpp
        divides each pair's frequency by them) as the `llama3` parameters that give the same factors."""
        from mfgguf.families.llama import llama3_params

        s = self.s
        if not self.src.has(ROPE_FREQS):
            return {"rope_type": "default", "rope_theta": s.rope_theta}
        factors = self.src.rows(ROPE_FREQS, 0, 1)[0]  # (head_dim / 2,)
        p = llama3_params(factors, s.head_dim, s.rope_theta)
        if p is None:
            raise MfggufError(f"{self.src.path}: its {ROPE_FREQS} factors are not those of any llama3 rope scaling,"
                              f" the one {self.hf_class} computes; export-hf cannot write this file")
        return {**p, "rope_theta": s.rope_theta}

    def rope_scaling(self) -> dict:
        """The same for transformers before rope_parameters (its `rope_scaling` key); nothing for the default."""
        p = self.rope()
        return {} if p["rope_type"] == "default" else {"rope_scaling": {k: v for k, v in p.items() if k != "rope_theta"}}


def routed_experts(t: Target, l: int, prefix: str, names: dict[str, str]) -> list[HFTensor]:
    """The router `{prefix}gate` and one `{prefix}experts.{e}.{names[f]}` per expert and projection f (gate, up,
    down): how Mixtral (`block_sparse_moe.`, w1/w3/w2) and Qwen-MoE (`mlp.`, gate_proj/up_proj/down_proj) name them."""
    src = t.src
    out = [t._t(prefix + "gate.weight", whole(src, blk(l, "ffn_gate_inp")))]
    for e in range(t.s.n_experts):
        for f in ("gate", "up", "down"):
            out.append(t._t(f"{prefix}experts.{e}.{names[f]}.weight", expert_rows(src, blk(l, f"ffn_{f}_exps"), e)))
    return out


QWEN_NAMES = {f: f"{f}_proj" for f in ("gate", "up", "down")}


def qwen_experts(t: Target, l: int) -> list[HFTensor]:
    """Qwen-MoE checkpoint names: `mlp.gate` (the router) and `mlp.experts.{e}.{gate,up,down}_proj`, one per expert."""
    return routed_experts(t, l, f"model.layers.{l}.mlp.", QWEN_NAMES)
