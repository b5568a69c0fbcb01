"""A RUN's module files as readers take them: safetensors headers checked against the shapes the config implies.

Every module (trunk, expert, pooled router statistics) is checked before any weight is read: present,
header complete and not truncated, every tensor f32 with the shape the config implies, the file the
manifest records. Assembly lays its GGUF out from what this returns; `sync`, the router-stats pass and
the reference forward read the same files through it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from mfgguf.config import DEFAULT_PRESET, ModelConfig, get_preset
from mfgguf.errors import MfggufError
from mfgguf.run import STATS_PREFIX, RunDir, module_name, read_module
from mfgguf.run.records import ModuleMeta
from mfgguf.families import block_extras, family
from mfgguf.gguf.schema import blk


@dataclass
class Entry:
    name: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset of the tensor data in the file
    end: int


@dataclass
class Module:
    index: int
    name: str
    path: Path
    meta: ModuleMeta  # its JSON record, typed
    entries: dict[str, Entry]
    header_len: int  # 8 + JSON header length: bytes before the first tensor
    size: int
    mtime_ns: int = 0  # as planned: a later reader (the merge) checks the file is still the same


def read_header(path: Path, what: str) -> tuple[int, dict[str, Entry]]:
    """Parse a safetensors header; raise a one-line error naming `what` if it is damaged or truncated."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise MfggufError(f"{what} ({path.name}) is truncated (no safetensors header); retrain it")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise MfggufError(f"{what} ({path.name}) is truncated (header runs past the end of the file); retrain it")
        try:
            hdr = json.loads(f.read(n))
        except ValueError:
            raise MfggufError(f"{what} ({path.name}) has a damaged safetensors header; retrain it") from None
    entries, end = {}, 0
    for k, v in hdr.items():
        if k == "__metadata__":
            continue
        if v.get("dtype") != "F32":
            raise MfggufError(f"{what}: tensor {k} is {v.get('dtype')}, expected F32 module weights; retrain it")
        b, e = v["data_offsets"]
        entries[k] = Entry(k, tuple(v["shape"]), 8 + n + b, 8 + n + e)
        end = max(end, 8 + n + e)
    if end != size:
        state = "truncated" if end > size else "longer than its header says"
        raise MfggufError(f"{what} ({path.name}) is {state} ({size} bytes, header says {end}); retrain it")
    return 8 + n, entries


def trunk_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Numpy shape of every trunk tensor by GGUF name (mirrors mfgguf.model.trunk_shapes, torch-free)."""
    hd, C = cfg.head_dim, cfg.dim
    extras = block_extras(family(cfg.family), n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=hd)
    s = {"token_embd.weight": (cfg.vocab_size, C), "output_norm.weight": (C,), "output.weight": (cfg.vocab_size, C)}
    for l in range(cfg.n_layers):
        s.update({f"blk.{l}.{x}": shape for x, shape in extras.items()})
        s.update({
            blk(l, "attn_norm"): (C,), blk(l, "attn_q"): (cfg.n_heads * hd, C), blk(l, "attn_k"): (cfg.n_kv_heads * hd, C),
            blk(l, "attn_v"): (cfg.n_kv_heads * hd, C), blk(l, "attn_output"): (C, cfg.n_heads * hd), blk(l, "ffn_norm"): (C,),
            blk(l, "ffn_gate_shexp"): (cfg.anchor_ff, C), blk(l, "ffn_up_shexp"): (cfg.anchor_ff, C),
            blk(l, "ffn_down_shexp"): (C, cfg.anchor_ff),
        })
        if cfg.seed_expert:  # the seed FFN experts start from; only the trunk-alone (dense) file holds it
            s.update({blk(l, "ffn_gate_seed"): (cfg.expert_ff, C), blk(l, "ffn_up_seed"): (cfg.expert_ff, C),
                      blk(l, "ffn_down_seed"): (C, cfg.expert_ff)})
    return s


def expert_shapes(cfg: ModelConfig, with_stats: bool) -> dict[str, tuple[int, ...]]:
    """An expert file's tensors: FFN weights, + its FFN-input means."""
    s = {}
    for l in range(cfg.n_layers):
        s[blk(l, "ffn_gate")] = (cfg.expert_ff, cfg.dim)
        s[blk(l, "ffn_up")] = (cfg.expert_ff, cfg.dim)
        s[blk(l, "ffn_down")] = (cfg.dim, cfg.expert_ff)
        if with_stats:
            s[f"{STATS_PREFIX}blk.{l}.mean"] = (cfg.dim,)
    return s


def pooled_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {f"{STATS_PREFIX}blk.{l}.second_moment": (cfg.dim, cfg.dim) for l in range(cfg.n_layers)}


def check_shapes(what: str, entries: dict[str, Entry], want: dict[str, tuple[int, ...]], hint: str) -> None:
    for k, shape in want.items():
        if k not in entries:
            raise MfggufError(f"{what} has no tensor {k}; {hint}")
        if entries[k].shape != shape:
            raise MfggufError(f"{what}: tensor {k} has shape {list(entries[k].shape)}, expected {list(shape)}; {hint}")


def load_module(run: RunDir, index: int, manifest: dict) -> Module:
    """Metadata + safetensors header of module `index`, checked against the manifest."""
    name = module_name(index)
    meta = read_module(run, index)
    rec = manifest.get("modules", {}).get(name)
    hint = "retrain it" if index else "retrain the trunk"
    if rec is None:
        raise MfggufError(f"module {name} is not in the run manifest; {hint}")
    if rec.get("sha256") != meta.sha256 or rec.get("blake3") != meta.blake3:
        raise MfggufError(f"module {name}: its metadata hashes differ from the manifest's; {hint}")
    path = run.module_file(index)
    st = path.stat()
    size = st.st_size
    if size != meta.bytes:
        raise MfggufError(f"module {name} ({path.name}) is {size} bytes, {meta.bytes} were recorded: modified or truncated; {hint}")
    header_len, entries = read_header(path, f"module {name}")
    return Module(index, name, path, meta, entries, header_len, size, st.st_mtime_ns)


def model_config(trunk: Module, vocab_size: int) -> ModelConfig:
    if trunk.meta.config is not None:
        cfg = ModelConfig.from_dict(trunk.meta.config)
    else:
        cfg = get_preset(trunk.meta.preset or DEFAULT_PRESET).model
    if cfg.vocab_size != vocab_size:
        raise MfggufError(
            f"the trunk was trained with vocab {cfg.vocab_size} but tokenizer.json has {vocab_size} tokens;"
            " retrain the trunk on this run"
        )
    return cfg
