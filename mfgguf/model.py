"""A llama-style decoder whose FFN is anchor + top-k routed experts: the `granitemoe` graph.

One class serves three uses, picked by `route` in `forward`:
  - "anchor": trunk alone (anchor FFN only) -- trunk training and the trunk-alone baseline;
  - "single": anchor + the one loaded expert -- expert training, and exactly what the assembled
    model computes for a token routed to that expert (top-1 weight is exactly 1);
  - "router": anchor + softmax-top-k over all loaded experts with renormalised weights -- the
    PyTorch reference forward of an assembled model, which parity tests compare llama.cpp with.

RoPE uses llama.cpp's "normal" rotation of adjacent pairs (x[2i], x[2i+1]), so Q and K are
written to GGUF without any row permutation; a family whose llama.cpp graph rotates halves (NEOX:
Qwen2) rotates (x[i], x[i + hd/2]) instead, again in the file's own row order. A family's extra
per-block tensors (Qwen2's Q/K/V biases) are parameters named as in GGUF (mfgguf/families/).

Module files use GGUF tensor names (see `trunk_name_map`), so the assembler only adds `_exps` stacking.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from mfgguf.config import ModelConfig
from mfgguf.families import block_extras, family
from mfgguf.head_loss import head_cross_entropy


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # x: (B, T, C)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); llama.cpp's LLM_FFN_SILU with a parallel gate."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        with warnings.catch_warnings():  # hidden = 0 is an empty anchor (the seed took the base's whole FFN)
            warnings.filterwarnings("ignore", "Initializing zero-element tensors is a no-op")
            self.gate = nn.Linear(dim, hidden, bias=False)  # weight: (hidden, dim) = ggml {dim, hidden}
            self.up = nn.Linear(dim, hidden, bias=False)
            self.down = nn.Linear(hidden, dim, bias=False)  # weight: (dim, hidden)

    def forward(self, x):  # (..., dim) -> (..., dim)
        return self.down(F.silu(self.gate(x)) * self.up(x))


def rope_tables(head_dim: int, T: int, theta: float, device=None, factors: tuple[float, ...] = ()):
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)  # (hd/2,)
    if factors:  # llama3 scaling as llama.cpp applies rope_freqs.weight: each pair's frequency divided by its factor
        inv = inv / torch.tensor(factors, dtype=torch.float32, device=device)
    ang = torch.arange(T, dtype=torch.float32, device=device)[:, None] * inv[None, :]  # (T, hd/2)
    return ang.cos(), ang.sin()


def rope_for(cfg: ModelConfig, T: int, device=None):
    """cos, sin (T, hd/2) of a model's RoPE: its base frequency and, for Llama 3.x, its frequency factors."""
    return rope_tables(cfg.head_dim, T, cfg.rope_theta, device, cfg.rope_freq_factors)


def apply_rope_neox(x, cos, sin):  # x: (B, H, T, hd); rotate (x[i], x[i + hd/2]) like llama.cpp's NEOX mode
    h = x.shape[-1] // 2
    a, b = x[..., :h].float(), x[..., h:].float()
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).type_as(x)


def apply_rope(x, cos, sin):  # x: (B, H, T, hd); rotate adjacent pairs like llama.cpp's normal mode
    # (x[2i] + i x[2i+1]) * (cos + i sin) is the rotation, in one complex multiply: the same products and
    # sums as writing it out, bit for bit, in fewer operations (a `small` bf16 training step measurably faster: docs/benchmarks.md)
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (B, H, T, hd/2) complex
    return torch.view_as_real(xc * torch.complex(cos, sin)).flatten(-2).type_as(x)  # (B, H, T, hd)


class HeadEmbedding(nn.Module):
    """The token embedding read from the frozen output head's weight and returned in f32: a tied base whose values
    the head's bf16 holds exactly gets the same lookup as from its f32 table, which it no longer keeps (vocab x dim x
    4 bytes: a gigabyte at Llama-3.2-1B's shape). The head is held out of the module tree (not a second parameter)."""

    def __init__(self, head: nn.Linear):
        super().__init__()
        self._head = (head,)

    @property
    def weight(self) -> torch.Tensor:  # (V, C) bf16, the head's own
        return self._head[0].weight

    def forward(self, idx):  # idx: (B, T) int64 -> (B, T, C) f32
        return F.embedding(idx, self.weight).float()


def share_tied_embedding(model: "Transformer", rows: int = 8192) -> bool:
    """Make the embedding a HeadEmbedding where that computes the same: both frozen, the head bf16, the table f32,
    and every row of the table equal to the head's row in bf16 and back (checked `rows` rows at a time). Returns
    whether it did; a base whose embedding is not exactly its bf16 head (untied, or values bf16 rounds) keeps it."""
    emb, head = model.tok_embd.weight, model.output.weight
    if (emb.requires_grad or head.requires_grad or emb.dtype != torch.float32 or head.dtype != torch.bfloat16
            or emb.shape != head.shape):
        return False
    for r in range(0, emb.shape[0], rows):
        if not torch.equal(head[r: r + rows].float(), emb[r: r + rows]):  # (rows, C) f32
            return False
    model.tok_embd = HeadEmbedding(model.output)
    return True


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, n_experts: int):
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        fam = family(cfg.family)
        self.rope = apply_rope_neox if fam.rope == "neox" else apply_rope
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn_q = nn.Linear(cfg.dim, cfg.n_heads * hd, bias="attn_q.bias" in fam.extras)
        self.attn_k = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias="attn_k.bias" in fam.extras)
        self.attn_v = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias="attn_v.bias" in fam.extras)
        # Qwen3: an RMSNorm over each Q and K head before RoPE (llama.cpp's attn_q_norm / attn_k_norm)
        self.attn_q_norm = RMSNorm(hd, cfg.norm_eps) if "attn_q_norm.weight" in fam.extras else None
        self.attn_k_norm = RMSNorm(hd, cfg.norm_eps) if "attn_k_norm.weight" in fam.extras else None
        self.attn_output = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.anchor = SwiGLU(cfg.dim, cfg.anchor_ff)
        self.experts = nn.ModuleList(SwiGLU(cfg.dim, cfg.expert_ff) for _ in range(n_experts))
        # Router rows, one per expert: logits = x @ router.T, as llama.cpp's ffn_gate_inp.
        self.router = nn.Parameter(torch.zeros(n_experts, cfg.dim), requires_grad=False) if n_experts else None
        # Divide the selected gates by their sum held constant: the same forward, and a gradient for the
        # router under top-1, whose renormalised weight is exactly 1 (train/whole/router_tune.py).
        self.straight_through_gates = False
        # The selected gates as they are, not renormalised: the reference of a file whose graph does not
        # renormalise them (schema.UNNORMALISED_TOPK: qwen2moe).
        self.renormalise_topk = True

    def attention(self, x, cos, sin):  # x: (B, T, C)
        B, T, _ = x.shape
        H, KV, hd = self.cfg.n_heads, self.cfg.n_kv_heads, self.cfg.head_dim
        q = self.attn_q(x).view(B, T, H, hd).transpose(1, 2)  # (B, H, T, hd)
        k = self.attn_k(x).view(B, T, KV, hd).transpose(1, 2)  # (B, KV, T, hd)
        v = self.attn_v(x).view(B, T, KV, hd).transpose(1, 2)
        if self.attn_q_norm is not None:
            q, k = self.attn_q_norm(q), self.attn_k_norm(k)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        # enable_gqa: query head h reads kv head h // (H // KV), as in llama.cpp, without copying k, v.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=KV != H)  # (B, H, T, hd)
        return self.attn_output(y.transpose(1, 2).reshape(B, T, H * hd))

    def moe(self, x, route: str):  # x: (B, T, C) after ffn_norm
        if route == "anchor" or not len(self.experts):
            return 0
        if route == "single":
            assert len(self.experts) == 1, "route='single' needs exactly one loaded expert"
            return self.experts[0](x)
        k = min(self.cfg.top_k, len(self.experts))
        probs = F.softmax(x.float() @ self.router.float().T, dim=-1)  # (B, T, E)
        w, idx = probs.topk(k, dim=-1)  # (B, T, k)
        s = w.sum(-1, keepdim=True)  # (B, T, 1)
        if self.renormalise_topk:
            w = w / (s.detach() if self.straight_through_gates else s)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            sel = (idx == e)  # (B, T, k)
            if sel.any():
                we = (w * sel).sum(-1, keepdim=True).type_as(x)  # (B, T, 1)
                mask = sel.any(-1)
                out[mask] += (we[mask] * expert(x[mask]))
        return out

    def forward(self, x, cos, sin, route: str, hook=None, layer: int = 0):
        h, n = self.ffn_input(x, cos, sin)
        if hook is not None:
            hook(layer, n)
        return h + self.anchor(n) + self.moe(n, route)

    def ffn_input(self, x, cos, sin):  # x: (B, T, C) -> h, n: (B, T, C), (B, T, C)
        """(the residual after attention, its ffn_norm: the vector the router and all FFNs see); the forward's first
        half, which a pass that only measures the FFN inputs (train/experts/stats_pass.py) stops after."""
        h = x + self.attention(self.attn_norm(x), cos, sin)
        return h, self.ffn_norm(h)


class Transformer(nn.Module):
    """Trunk + anchor + `n_experts` loaded experts (0 for the trunk, 1 for expert training)."""

    def __init__(self, cfg: ModelConfig, n_experts: int = 0):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.tok_embd = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, n_experts) for _ in range(cfg.n_layers))
        self.output_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None):
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 2 and ".router" not in name:
                # Residual-output projections get the GPT-2 depth scaling.
                s = std / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("attn_output.weight", "down.weight")) else std
                p.normal_(0.0, s, generator=generator)
            elif name.endswith(".bias"):
                p.zero_()

    def forward(self, idx, targets=None, route: str = "anchor", hook: Callable | None = None):
        """idx: (B, T) int64 -> logits (B, T, V), or the mean cross-entropy when targets are given."""
        x = self.output_norm(self.hidden(idx, route, hook))  # (B, T, C)
        if targets is None:
            return self.output(x)  # (B, T, V)
        return head_cross_entropy(x, self.output.weight, targets)  # the (B, T, V) logits never whole (head_loss.py)

    def hidden(self, idx, route: str = "anchor", hook: Callable | None = None):
        """idx: (B, T) int64 -> the last block's output (B, T, C), before the final norm and the head."""
        B, T = idx.shape
        cos, sin = rope_for(self.cfg, T, idx.device)
        x = self.tok_embd(idx)  # (B, T, C)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, route, hook, i)
        return x

    # ---- module files: GGUF tensor names <-> parameters -----------------------------------------

    def trunk_tensors(self) -> dict[str, torch.Tensor]:
        """The trunk module's tensors under their GGUF names (anchor = shared expert; the seed FFN,
        loaded as expert 0, when the config has one)."""
        sd = self.state_dict()
        names = trunk_name_map(self.cfg.n_layers, self.cfg.family) | (seed_name_map(self.cfg.n_layers) if self.cfg.seed_expert else {})
        return {gguf: sd[name] for name, gguf in names.items()}

    def expert_tensors(self, slot: int = 0) -> dict[str, torch.Tensor]:
        """Loaded expert `slot`'s tensors as `blk.{l}.ffn_{gate,up,down}.weight`."""
        out = {}
        for l, layer in enumerate(self.layers):
            e = layer.experts[slot]
            out[f"blk.{l}.ffn_gate.weight"] = e.gate.weight.detach()  # (expert_ff, dim)
            out[f"blk.{l}.ffn_up.weight"] = e.up.weight.detach()  # (expert_ff, dim)
            out[f"blk.{l}.ffn_down.weight"] = e.down.weight.detach()  # (dim, expert_ff)
        return out

    @torch.no_grad()
    def load_trunk(self, tensors: dict[str, torch.Tensor]) -> None:
        sd = {name: tensors[gguf] for name, gguf in trunk_name_map(self.cfg.n_layers, self.cfg.family).items()}
        missing, _ = self.load_state_dict(sd, strict=False)
        missing = [m for m in missing if ".experts." not in m and ".router" not in m]
        assert not missing, f"trunk tensors missing: {missing}"

    @torch.no_grad()
    def load_seed(self, tensors: dict[str, torch.Tensor]) -> None:
        """The trunk's seed FFN (`blk.{l}.ffn_*_seed.weight`) into expert slot 0."""
        for name, gguf in seed_name_map(self.cfg.n_layers).items():
            self.get_parameter(name).copy_(tensors[gguf])

    @torch.no_grad()
    def load_expert(self, tensors: dict[str, torch.Tensor], slot: int = 0) -> None:
        for l, layer in enumerate(self.layers):
            e = layer.experts[slot]
            e.gate.weight.copy_(tensors[f"blk.{l}.ffn_gate.weight"])
            e.up.weight.copy_(tensors[f"blk.{l}.ffn_up.weight"])
            e.down.weight.copy_(tensors[f"blk.{l}.ffn_down.weight"])

    @torch.no_grad()
    def set_router(self, layer_weights: list[torch.Tensor]) -> None:
        """layer_weights[l]: (n_experts, dim) router rows for layer l."""
        for layer, w in zip(self.layers, layer_weights):
            layer.router.copy_(torch.as_tensor(w, dtype=torch.float32))


def trunk_name_map(n_layers: int, family_name: str = "llama") -> dict[str, str]:
    """Torch parameter name (dots) -> GGUF name, for every trunk tensor (a family's extras are named alike)."""
    m = {"tok_embd.weight": "token_embd.weight", "output_norm.weight": "output_norm.weight", "output.weight": "output.weight"}
    per = {
        "attn_norm.weight": "attn_norm.weight", "attn_q.weight": "attn_q.weight", "attn_k.weight": "attn_k.weight",
        "attn_v.weight": "attn_v.weight", "attn_output.weight": "attn_output.weight", "ffn_norm.weight": "ffn_norm.weight",
        "anchor.gate.weight": "ffn_gate_shexp.weight", "anchor.up.weight": "ffn_up_shexp.weight",
        "anchor.down.weight": "ffn_down_shexp.weight",
    } | {x: x for x in family(family_name).extras}
    for l in range(n_layers):
        for a, b in per.items():
            m[f"layers.{l}.{a}"] = f"blk.{l}.{b}"
    return m


SEED_FFN = "blk.{l}.ffn_{f}_seed.weight"  # the trunk's seed FFN (ModelConfig.seed_expert), f = gate|up|down


def seed_name_map(n_layers: int) -> dict[str, str]:
    """Torch parameter name of the seed (trained as expert slot 0 of the trunk) -> its name in the trunk file."""
    return {f"layers.{l}.experts.0.{f}.weight": SEED_FFN.format(l=l, f=f) for l in range(n_layers) for f in ("gate", "up", "down")}


def trunk_model(cfg: ModelConfig) -> tuple["Transformer", str]:
    """(the trunk as it trains and runs alone, its route): anchor only, or anchor + seed as expert 0."""
    return (Transformer(cfg, n_experts=1), "single") if cfg.seed_expert else (Transformer(cfg, n_experts=0), "anchor")


def trunk_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Torch-layout (row-major) shape of every trunk tensor, by GGUF name; the assembler's layout source."""
    hd, C = cfg.head_dim, cfg.dim
    extras = block_extras(family(cfg.family), n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=hd)
    s = {"token_embd.weight": (cfg.vocab_size, C), "output_norm.weight": (C,), "output.weight": (cfg.vocab_size, C)}
    for l in range(cfg.n_layers):
        s.update({
            f"blk.{l}.attn_norm.weight": (C,),
            f"blk.{l}.attn_q.weight": (cfg.n_heads * hd, C),
            f"blk.{l}.attn_k.weight": (cfg.n_kv_heads * hd, C),
            f"blk.{l}.attn_v.weight": (cfg.n_kv_heads * hd, C),
            f"blk.{l}.attn_output.weight": (C, cfg.n_heads * hd),
            f"blk.{l}.ffn_norm.weight": (C,),
            f"blk.{l}.ffn_gate_shexp.weight": (cfg.anchor_ff, C),
            f"blk.{l}.ffn_up_shexp.weight": (cfg.anchor_ff, C),
            f"blk.{l}.ffn_down_shexp.weight": (C, cfg.anchor_ff),
        })
        s.update({f"blk.{l}.{x}": shape for x, shape in extras.items()})
        if cfg.seed_expert:
            s.update({SEED_FFN.format(l=l, f="gate"): (cfg.expert_ff, C), SEED_FFN.format(l=l, f="up"): (cfg.expert_ff, C),
                      SEED_FFN.format(l=l, f="down"): (C, cfg.expert_ff)})
    return s


def expert_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Torch-layout shape of every expert tensor, by module-file name."""
    s = {}
    for l in range(cfg.n_layers):
        s[f"blk.{l}.ffn_gate.weight"] = (cfg.expert_ff, cfg.dim)
        s[f"blk.{l}.ffn_up.weight"] = (cfg.expert_ff, cfg.dim)
        s[f"blk.{l}.ffn_down.weight"] = (cfg.dim, cfg.expert_ff)
    return s
