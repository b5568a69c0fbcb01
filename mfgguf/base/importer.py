"""`import-base`: a pretrained model of a known family (GGUF or Hugging Face directory) becomes a RUN's trunk.

Families (mfgguf/families/): llama (Llama 3.x rope scaling included), qwen2 (Qwen2 / Qwen2.5), qwen3.

The trunk module is the base itself: embeddings, attention, norms, output head (token_embd's copy
when tied), and the base's FFN split by hidden units into the always-on anchor (units [0, ff - e))
and the seed FFN experts branch from (units [ff - e, ff)). A SwiGLU is a sum over its hidden units,
so anchor + seed is the base's FFN exactly: the trunk alone computes the base, and an expert
initialised from the seed starts as exactly those units (top-1 weight is 1), so an MoE whose
experts equal the seed computes the base too. Splitting costs no parameters and leaves the expert
width free; the other exact choice, two copies of the whole FFN with `down` halved, would force
experts as wide as the base's FFN. With `seed=False` the anchor is the whole FFN and experts start
from scratch (or the anchor's rows) beside it.

The RUN written holds modules/trunk.* (+ manifest), and RUN/base/: base.json, vocab.gguf (the
base's key-values, no tensors: what the assembled GGUF copies its tokenizer keys from, and what
llama.cpp tokenizes with for a GGUF-only base) and, for a Hugging Face base, its tokenizer.json.
`mfgguf prepare CORPUS --out RUN` then tokenizes the corpus with that tokenizer (runbase.py).
Streaming: one tensor of the base in memory at a time (plus the slice being written).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from mfgguf.config import DEFAULT_PRESET, ModelConfig, get_preset
from mfgguf.errors import MfggufError
from mfgguf.run import RunDir, swap_dir_into_place, write_json, write_module_streamed
from mfgguf.base.gguf_source import GGUFBase
from mfgguf.base.hf_source import HFBase
from mfgguf.base.known import resolve_base
from mfgguf.base.runbase import BASE_FORMAT, BaseFiles
from mfgguf.base.source import BaseShape

SEED_SHARE = 8  # default seed width: the base's FFN width / this, rounded down to a multiple of 32


def open_base(src: Path) -> GGUFBase | HFBase:
    """The reader for SRC: a directory is a Hugging Face checkpoint, a file must be a GGUF, and a known
    base's name (`smollm2`, fetched by `make smollm2`) is its cached GGUF."""
    p = resolve_base(src)
    if p.is_dir():
        return HFBase(p)
    if not p.is_file():
        raise MfggufError(f"base {p} does not exist; pass a .gguf file or a Hugging Face model directory")
    with open(p, "rb") as f:
        if f.read(4) != b"GGUF":
            raise MfggufError(f"{p} is not a GGUF file; pass a .gguf file or a Hugging Face model directory")
    return GGUFBase(p)


def default_expert_ff(ff: int) -> int:
    return max(32, ff // SEED_SHARE // 32 * 32)


def import_base(src: Path, out: Path, *, expert_ff: int | None = None, seed: bool = True, preset: str = DEFAULT_PRESET,
                ctx_len: int | None = None, force: bool = False) -> dict:
    """Import a pretrained model of a known family (mfgguf/families/) as the trunk of a new RUN directory.

    SRC is a GGUF (llama, qwen2 or qwen3 architecture; any weight type gguf-py dequantizes: f32, f16,
    bf16, q4_0 ... q8_0, K-quants), a Hugging Face LlamaForCausalLM / Qwen2ForCausalLM /
    Qwen3ForCausalLM directory (config.json,
    safetensors, tokenizer.json), or the name of a base fetched into the cache (`smollm2`,
    by `make smollm2`). The base's FFN is split
    by hidden units into the anchor and a seed FFN of `expert_ff` units that experts start from
    (default: an eighth of the FFN), so the trunk alone computes the base exactly. `expert_ff` equal to the
    base's FFN width leaves the anchor empty: experts are whole copies of the base's FFN, as BTX builds them. Then run
    `mfgguf prepare CORPUS --out RUN --experts N`: it tokenizes the corpus with the base's tokenizer.
    `ctx_len` is the training context (default: the preset's, at most the base's). Returns the
    trunk module's metadata.

    Example:
        >>> import_base(Path("model.gguf"), Path("RUN"))["config"]["anchor_ff"]
    """
    from mfgguf.model import trunk_shapes  # torch: imported here so that the CLI starts without it

    t0 = time.perf_counter()
    out = Path(out)
    base = open_base(src)
    s = base.shape
    if out.exists() and not out.is_dir():
        raise MfggufError(f"{out} exists and is not a directory; choose another --out")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise MfggufError(f"{out} already exists and is not empty; choose another --out or pass --force to replace it")
    p = get_preset(preset)
    cfg = trunk_config(s, expert_ff=expert_ff, seed=seed, preset=preset, ctx_len=ctx_len)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    try:
        files = BaseFiles(tmp)
        files.root.mkdir()
        base.write_vocab(files.vocab)
        if base.tokenizer_json is not None:
            shutil.copyfile(base.tokenizer_json, files.tokenizer_json)
        eos = files.special_id("eos")
        if eos is None:
            raise MfggufError(f"base {base.path.name} names no EOS token; mfgguf ends every document with it")
        info = {"format": BASE_FORMAT, "source": str(base.path.resolve()), "kind": base.kind, "shape": asdict(s),
                "eos_id": eos, "eos_token": files.token(eos), "tokenizer": "tokenizer.json" if base.tokenizer_json else "vocab.gguf",
                "seed": {"split": "hidden units", "anchor_units": [0, cfg.anchor_ff], "seed_units": [cfg.anchor_ff, s.ff]}
                if seed else None}
        write_json(files.info, info)
        meta = {"kind": "trunk", "source": "base", "base": {k: info[k] for k in ("source", "kind", "tokenizer")},
                "preset": preset, "config": cfg.to_dict(), "train": asdict(p.trunk), "precision": "fp32",
                "steps": 0, "tokens_seen": 0}
        meta = {**write_module_streamed(RunDir(tmp), 0, trunk_shapes(cfg), _reader(base, cfg), meta),
                "import_seconds": round(time.perf_counter() - t0, 2)}  # what the CLI reports, not recorded
        swap_dir_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def trunk_config(s: BaseShape, *, expert_ff: int | None = None, seed: bool = True, preset: str = DEFAULT_PRESET,
                 ctx_len: int | None = None) -> ModelConfig:
    """The trunk's ModelConfig that `import_base` gives a base of shape `s` (what a plan can read without importing)."""
    e = default_expert_ff(s.ff) if expert_ff is None else int(expert_ff)
    if seed and not 0 < e <= s.ff:
        raise MfggufError(f"--expert-ff {e} must be between 1 and the base's FFN width {s.ff} (the seed is a slice of it)")
    if e < 1:
        raise MfggufError(f"--expert-ff {e} must be at least 1")
    ctx = min(s.ctx_len, ctx_len or get_preset(preset).model.ctx_len)
    cfg = ModelConfig(vocab_size=s.vocab_size, dim=s.dim, n_layers=s.n_layers, n_heads=s.n_heads, n_kv_heads=s.n_kv_heads,
                      anchor_ff=s.ff - e if seed else s.ff, expert_ff=e, n_experts=0, ctx_len=ctx,
                      rope_theta=s.rope_theta, norm_eps=s.norm_eps, seed_expert=seed, family=s.family,
                      rope_freq_factors=s.rope_freq_factors, attn_head_dim=s.head_dim)
    cfg.validate()
    return cfg


def _reader(base, cfg: ModelConfig):
    """read(trunk tensor name) -> f32 array, from the base one tensor at a time.

    The anchor and the seed are two slices of one base FFN tensor; write_module_streamed asks for
    tensors in sorted name order, which puts ffn_X_seed next to ffn_X_shexp, so the last base
    tensor read is kept and each is read once.
    """
    last: dict[str, np.ndarray] = {}
    a = cfg.anchor_ff

    def get(name: str) -> np.ndarray:
        if name not in last:
            last.clear()
            last[name] = base.tensor(name)
        return last[name]

    def read(name: str) -> np.ndarray:
        for f in ("gate", "up", "down"):
            for part in ("shexp", "seed"):
                if name.endswith(f"ffn_{f}_{part}.weight"):
                    w = get(name.replace(f"ffn_{f}_{part}", f"ffn_{f}"))  # (ff, dim), down: (dim, ff)
                    cut = slice(0, a) if part == "shexp" else slice(a, None)
                    return w[:, cut] if f == "down" else w[cut]
        last.clear()
        return base.tensor(name)

    return read


