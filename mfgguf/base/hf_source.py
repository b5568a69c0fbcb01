"""A Hugging Face causal-LM directory of a known family (families/: LlamaForCausalLM, Qwen2ForCausalLM) as a base.

config.json, safetensors shards, tokenizer.json. Tensors are read from the shards with `pread`
after parsing each shard's header (f32, f16 or bf16), renamed to GGUF names, and, for a family
llama.cpp rotates in adjacent pairs (llama), Q/K rows permuted from rotate-half exactly as
convert_hf_to_gguf.py does. Llama 3.x's `llama3` rope scaling becomes per-pair frequency factors.
Refused with one line: another architecture or activation, llama biases, other rope scaling,
sliding-window attention, a head_dim other than hidden_size / heads (Qwen3 excepted), a missing tokenizer.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from mfgguf.errors import MfggufError
from mfgguf.families import by_hf_arch, family, hf_archs
from mfgguf.families.llama import llama3_factors
from mfgguf.base.source import BaseShape, bf16_to_f32, pread_exact, rope_permute

DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}  # safetensors dtype -> numpy storage
IGNORED = ("rotary_emb.inv_freq",)  # buffers some checkpoints carry; recomputed from rope_theta
HF_NAMES = {  # Hugging Face name (per layer: after `model.layers.{l}.`) -> GGUF suffix; a family adds its own
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def _rope(cfg: dict) -> tuple[str | None, dict]:
    """The rope variant config.json asks for (rope_scaling, or transformers 5's rope_parameters; None = plain)
    and its parameters."""
    for key in ("rope_scaling", "rope_parameters"):
        r = cfg.get(key)
        if isinstance(r, dict):
            t = r.get("rope_type", r.get("type"))
            if t not in (None, "default"):
                return str(t), r
    return None, {}


class HFBase:
    """A base model in a Hugging Face directory (a known family's causal LM, safetensors)."""

    kind = "hf"

    def __init__(self, path: Path):
        self.path = Path(path)
        what = f"base {self.path.name}"
        cfg_path = self.path / "config.json"
        try:
            cfg = json.loads(cfg_path.read_text())
        except FileNotFoundError:
            raise MfggufError(f"{self.path} has no config.json; import-base reads a GGUF file or a Hugging Face directory") from None
        except (OSError, ValueError) as e:
            raise MfggufError(f"{cfg_path} is unreadable ({e})") from None
        archs = cfg.get("architectures") or []
        fam = by_hf_arch(archs)
        if fam is None:
            raise MfggufError(f"{what} is {', '.join(archs) or cfg.get('model_type', 'an unknown model')};"
                              f" import-base reads {', '.join(hf_archs())} checkpoints")
        self.family = fam
        hd = cfg.get("head_dim")
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key):
                raise MfggufError(f"{what} has {key}=true; mfgguf's model has no biases")
        if cfg.get("hidden_act", "silu") != "silu":
            raise MfggufError(f"{what} uses activation {cfg['hidden_act']!r}; mfgguf's SwiGLU uses silu")
        rt, rope = _rope(cfg)
        if rt is not None and not (rt == "llama3" and fam.rope_freqs):
            raise MfggufError(f"{what} uses rope scaling {rt!r}, which mfgguf's model does not compute")
        if cfg.get("use_sliding_window"):
            raise MfggufError(f"{what} uses sliding-window attention, which mfgguf's model does not compute")
        if not (self.path / "tokenizer.json").is_file():
            raise MfggufError(f"{what} has no tokenizer.json; import-base needs the base's own tokenizer")
        dim, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        self.config = cfg
        factors = llama3_factors(rope, dim // heads, float(theta)) if rt == "llama3" else ()
        self.shape = BaseShape(
            dim=dim, n_layers=int(cfg["num_hidden_layers"]), n_heads=heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or heads), ff=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]), rope_theta=float(theta), norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            ctx_len=int(cfg.get("max_position_embeddings", 2048)), tied=bool(cfg.get("tie_word_embeddings", False)),
            family=fam.name, rope_freq_factors=factors,
            head_dim=int(hd) if hd is not None and fam.free_head_dim and int(hd) != dim // heads else 0)
        self.shape.check(what)
        if hd is not None and int(hd) != dim // heads and not fam.free_head_dim:
            raise MfggufError(f"{what}: head_dim {hd} is not hidden_size / num_attention_heads = {dim // heads};"
                              " mfgguf's model cannot compute it")
        self.entries = self._index(what)  # GGUF name -> (shard, dtype, shape, begin, end)
        want = self.shape.expected_shapes()
        for name, (_, _, shape, _, _) in self.entries.items():
            if shape != want[name]:
                raise MfggufError(f"{what}: tensor {name} has shape {list(shape)}, expected {list(want[name])}")
        missing = [n for n in want if n not in self.entries and not (n == "output.weight" and self.shape.tied)]
        if missing:
            raise MfggufError(f"{what} has no tensor for {missing[0]}")

    def _index(self, what: str) -> dict[str, tuple[Path, str, tuple[int, ...], int, int]]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (self.path / "model.safetensors").is_file():
            shards = ["model.safetensors"]
        else:
            raise MfggufError(f"{what} has no model.safetensors (or its index); import-base reads safetensors weights")
        out = {}
        for shard in shards:
            p = self.path / shard
            with open(p, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                hdr = json.loads(f.read(n))
            for k, v in hdr.items():
                if k == "__metadata__" or k.endswith(IGNORED):
                    continue
                name = self._gguf_name(k, what)
                if v["dtype"] not in DTYPES:
                    raise MfggufError(f"{what}: tensor {k} is {v['dtype']}; import-base reads F32, F16 and BF16 weights")
                b, e = v["data_offsets"]
                out[name] = (p, v["dtype"], tuple(v["shape"]), 8 + n + b, 8 + n + e)
        return out

    def _gguf_name(self, k: str, what: str) -> str:
        if k == "model.embed_tokens.weight":
            return "token_embd.weight"
        if k == "model.norm.weight":
            return "output_norm.weight"
        if k == "lm_head.weight":
            return "output.weight"
        parts = k.split(".", 3)  # model, layers, l, rest
        names = HF_NAMES | self.family.hf_names
        if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in names and parts[2].isdigit():
            return f"blk.{parts[2]}.{names[parts[3]]}"
        if k.endswith(".bias"):
            raise MfggufError(f"{what} has bias {k}; mfgguf's model has no biases")
        raise MfggufError(f"{what} has tensor {k}, which mfgguf's model has no place for")

    @property
    def tokenizer_json(self) -> Path:
        return self.path / "tokenizer.json"

    def tensor(self, name: str) -> np.ndarray:
        """One f32 tensor under its GGUF name (Q/K in llama.cpp's row order), read from its shard now."""
        if name == "output.weight" and "output.weight" not in self.entries:
            name = "token_embd.weight"  # tied embeddings
        p, dt, shape, b, e = self.entries[name]
        fd = os.open(p, os.O_RDONLY)
        try:
            raw = np.frombuffer(pread_exact(fd, e - b, b, f"base shard {p.name}"), DTYPES[dt])
        finally:
            os.close(fd)
        a = bf16_to_f32(raw) if dt == "BF16" else raw.astype(np.float32, copy=False)
        a = a.reshape(shape)
        if self.family.rope != "normal":
            return a  # llama.cpp rotates halves too (NEOX): Hugging Face's own row order
        if name.endswith("attn_q.weight"):
            a = rope_permute(a, self.shape.n_heads)
        elif name.endswith("attn_k.weight"):
            a = rope_permute(a, self.shape.n_kv_heads)
        return a

    def write_vocab(self, path: Path) -> None:
        """A vocab-only GGUF of the base's tokenizer, as llama.cpp's convert_hf_to_gguf.py writes it (hf_vocab.py)."""
        from mfgguf.base.hf_vocab import write_vocab_gguf

        write_vocab_gguf(self, path)
