"""Validate the modules and compute the whole GGUF file from metadata alone, before reading any weight.

`plan(...)` checks every module (present, recorded hashes agree with the manifest, safetensors
header complete and not truncated, every tensor f32 with the shape the config implies, every
expert trained against this trunk, no duplicates, every `shared.*` copy of a trunk tensor
listed in the expert's metadata and shaped like the trunk's), reads the tokenizer, and returns a
`Plan`: the key-values, every tensor's type/shape/offset, the serialized header (runs of bytes
around the holes the router statistics fill later), the total size,
and which trunk tensors are merged from which experts' copies (merge.py). The writer then only
fills the slots.

Module contents are hashed while they stream (one read, not two); a mismatch aborts assembly
before anything reaches the destination. Non-finite weights are caught the same way.

Example:
    >>> p = plan(RunDir("RUN"), quant="q8_0", top_k=1, router="ridge", layout="granitemoe", experts=None)
    >>> p.slot("blk.0.ffn_up_exps.weight").expert_bytes
    >>> p.total_size
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mfgguf import __version__
from mfgguf.config import ModelConfig, get_preset
from mfgguf.base.runbase import imported
from mfgguf.errors import MfggufError
from mfgguf.run import STATS_PREFIX, RunDir, module_name, read_manifest, read_module_meta, router_stats_stale
from mfgguf.converters.routing import complement as cp
from mfgguf.converters.routing import stats as routerstats
from mfgguf.gguf import schema
from mfgguf.converters.merge import DEFAULT_DENSITY, merge_plan
from mfgguf.converters.routing.router import needs_stats
from mfgguf.gguf.fileio import pwrite_all
from mfgguf.gguf.header import kv_value
from mfgguf.families import block_extras, family, resolve_layout
from mfgguf.gguf.schema import ALIGNMENT, FFN, VType, blk


# ---- module files --------------------------------------------------------------------------------


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
    meta: dict
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


def expert_shapes(cfg: ModelConfig, with_stats: bool, second_moment: bool = False) -> dict[str, tuple[int, ...]]:
    """An expert file's tensors: FFN weights, + its FFN-input means (+ second moments: module format 1)."""
    s = {}
    for l in range(cfg.n_layers):
        s[blk(l, "ffn_gate")] = (cfg.expert_ff, cfg.dim)
        s[blk(l, "ffn_up")] = (cfg.expert_ff, cfg.dim)
        s[blk(l, "ffn_down")] = (cfg.dim, cfg.expert_ff)
        if with_stats:
            s[f"{STATS_PREFIX}blk.{l}.mean"] = (cfg.dim,)
        if second_moment:
            s[f"{STATS_PREFIX}blk.{l}.second_moment"] = (cfg.dim, cfg.dim)
    return s


def pooled_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {f"{STATS_PREFIX}blk.{l}.second_moment": (cfg.dim, cfg.dim) for l in range(cfg.n_layers)}


class PooledStatsNeeded(MfggufError):
    """The pooled router statistics are missing or stale: the router-stats pass would fix it (ensure_stats.py)."""

    def __init__(self, message: str, why: str):
        super().__init__(message)
        self.why = why  # "are missing", or router_stats_stale's reason


def load_pooled_stats(run: RunDir, manifest: dict, trunk: Module, experts: list[Module]) -> Module:
    """The pooled router statistics (train/experts/pooled.py) of this trunk and these experts, checked against the manifest."""
    redo = f"compute them with `mfgguf router-stats {run.root}`"
    if not run.router_stats_meta.is_file() or not run.router_stats.is_file():
        raise PooledStatsNeeded(f"{run.root} has no pooled router statistics (modules/{run.router_stats.name}); {redo}",
                                "are missing")
    meta = json.loads(run.router_stats_meta.read_text())
    rec = manifest.get("router_stats") or {}
    if rec.get("blake3") != meta.get("blake3") or not meta.get("blake3"):
        raise MfggufError(f"the pooled router statistics' metadata differs from the manifest's; {redo}")
    if why := router_stats_stale(meta, trunk.meta["sha256"], {m.name: m.meta["sha256"] for m in experts}):
        raise PooledStatsNeeded(f"the pooled router statistics {why}; {redo}", why)
    st = run.router_stats.stat()
    if st.st_size != meta.get("bytes"):
        raise MfggufError(f"{run.router_stats.name} is {st.st_size} bytes, {meta.get('bytes')} were recorded: modified"
                          f" or truncated; {redo}")
    header_len, entries = read_header(run.router_stats, "the pooled router statistics")
    return Module(-1, "router_stats", run.router_stats, meta, entries, header_len, st.st_size, st.st_mtime_ns)


def _check_shapes(what: str, entries: dict[str, Entry], want: dict[str, tuple[int, ...]], hint: str) -> None:
    for k, shape in want.items():
        if k not in entries:
            raise MfggufError(f"{what} has no tensor {k}; {hint}")
        if entries[k].shape != shape:
            raise MfggufError(f"{what}: tensor {k} has shape {list(entries[k].shape)}, expected {list(shape)}; {hint}")


def load_module(run: RunDir, index: int, manifest: dict) -> Module:
    """Metadata + safetensors header of module `index`, checked against the manifest."""
    name = module_name(index)
    meta = read_module_meta(run, index)
    rec = manifest.get("modules", {}).get(name)
    hint = "retrain it" if index else "retrain the trunk"
    if rec is None:
        raise MfggufError(f"module {name} is not in the run manifest; {hint}")
    if rec.get("sha256") != meta.get("sha256") or rec.get("blake3") != meta.get("blake3"):
        raise MfggufError(f"module {name}: its metadata hashes differ from the manifest's; {hint}")
    path = run.module_file(index)
    st = path.stat()
    size = st.st_size
    if size != meta.get("bytes"):
        raise MfggufError(f"module {name} ({path.name}) is {size} bytes, {meta.get('bytes')} were recorded: modified or truncated; {hint}")
    header_len, entries = read_header(path, f"module {name}")
    return Module(index, name, path, meta, entries, header_len, size, st.st_mtime_ns)


# ---- the plan ------------------------------------------------------------------------------------


@dataclass
class Slot:
    name: str  # GGUF tensor name
    shape: tuple[int, ...]  # numpy order (slowest first); ggml dims are reversed
    qtype: str
    why: str | None  # why the type differs from the requested one
    offset: int = 0  # relative to the start of the data section
    nbytes: int = 0
    n_expert: int = 0  # stacked expert tensor: expert p's bytes at offset + p * expert_bytes
    written: int = 0  # bytes written so far (the writer's own accounting)

    @property
    def expert_bytes(self) -> int:
        return self.nbytes // self.n_expert if self.n_expert else 0

    @property
    def row_bytes(self) -> int:
        return schema.QTYPES[self.qtype].row_bytes(self.shape[-1])


@dataclass
class Plan:
    run: RunDir
    cfg: ModelConfig
    arch: str
    layout: str  # granitemoe | mixtral | dense
    quant: str
    top_k: int
    router: str
    experts: list[int]  # expert ids in slot order
    trunk: Module
    expert_modules: list[Module]  # headers only; streaming reopens each file in turn
    pooled: Module | None  # the router's pooled second moments (None: not needed, or format-1 experts hold them)
    kv: list[tuple[str, str, object]]
    slots: list[Slot]
    merge: str = "none"  # how the experts' copies of trunk tensors are merged (merge.py)
    density: float = DEFAULT_DENSITY  # ties: share of each delta row kept
    merged: dict[str, list[int]] = field(default_factory=dict)  # trunk tensor -> expert positions holding a copy
    complement: bool = False  # the experts complement the seed: it is routed slot 0 (converters/routing/complement.py)
    constants: dict[str, np.ndarray] = field(default_factory=dict)  # tensors no module holds, from the config alone
    header: bytes = b""  # header_bytes: key-values and tensor infos, not padded
    data_offset: int = 0
    total_size: int = 0
    by_name: dict[str, Slot] = field(default_factory=dict)
    stats: routerstats.StatsBlock | None = None  # the router statistics' block after the tensor data, if any

    def slot(self, name: str) -> Slot:
        return self.by_name[name]

    @property
    def input_bytes(self) -> int:
        return self.trunk.size + sum(m.size for m in self.expert_modules) + (self.pooled.size if self.pooled else 0)

    @property
    def modules(self) -> list[Module]:
        """Every file assembly reads, in stream order: trunk, pooled statistics, experts."""
        return [self.trunk, *([self.pooled] if self.pooled else []), *self.expert_modules]


def model_config(trunk: Module, vocab_size: int) -> ModelConfig:
    if "config" in trunk.meta:
        cfg = ModelConfig.from_dict(trunk.meta["config"])
    else:
        cfg = get_preset(trunk.meta.get("preset", "small")).model
    if cfg.vocab_size != vocab_size:
        raise MfggufError(
            f"the trunk was trained with vocab {cfg.vocab_size} but tokenizer.json has {vocab_size} tokens;"
            " retrain the trunk on this run"
        )
    return cfg


def plan(run: RunDir, *, quant: str, top_k: int | None, router: str, layout: str, experts: list[int] | None,
         merge: str = "mean", density: float = DEFAULT_DENSITY) -> Plan:
    """Validate everything and lay the file out; reads metadata and headers only."""
    schema.qtype(quant)
    if quant not in schema.USER_QUANTS:
        raise MfggufError(f"unknown quant type {quant!r}; choose one of {', '.join(schema.USER_QUANTS)}")
    if router not in schema.ROUTERS + cp.ROUTERS:
        raise MfggufError(f"unknown router {router!r}; choose one of {', '.join(dict.fromkeys(schema.ROUTERS + cp.ROUTERS))}")
    stats = needs_stats(router) or router == "ridge+learned"  # the experts' means feed the router
    info = run.info()
    run.check_no_pending_sync()
    manifest = read_manifest(run)
    tok_kv, vocab = run_tokenizer_kv(run)
    trunk = load_module(run, 0, manifest)
    cfg = model_config(trunk, vocab)
    cfg.validate()
    layout = resolve_layout(family(cfg.family), layout)
    _check_shapes("module trunk", trunk.entries, trunk_shapes(cfg), "retrain the trunk")

    ids = list(range(1, info["n_experts"] + 1)) if experts is None else list(experts)
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise MfggufError(f"expert {dup[0]} is listed twice in --experts; list each expert once")
    mods = []
    for i in ids:
        run.check_expert_index(i)
        m = load_module(run, i, manifest)
        if int(m.meta.get("round", 1)) < int(m.meta.get("rounds", 1)):
            raise MfggufError(f"module {m.name} has trained round {m.meta['round']} of {m.meta['rounds']}; run"
                              f" `mfgguf sync RUN`, then `mfgguf train-expert RUN --expert {i}` for the next round")
        if trunk.meta.get("final") and m.meta.get("trunk_sha256") == trunk.meta.get("synced_from"):
            raise MfggufError(f"module {m.name}'s router statistics predate the final sync; run"
                              f" `mfgguf restat RUN --expert {i}` (or `mfgguf sync RUN` for all)")
        if m.meta.get("trunk_sha256") != trunk.meta["sha256"]:
            raise MfggufError(f"module {m.name} was trained against a different trunk; retrain it with `mfgguf train-expert RUN --expert {i}`")
        _check_shapes(f"module {m.name}", m.entries, expert_shapes(cfg, stats, _format1(m) and router == "ridge")
                      | (cp.learned_shapes(cfg.n_layers, cfg.dim) if cp.is_complement(m.meta) else {}),
                      "retrain it (or use --router uniform if only its statistics are missing)")
        if stats and not m.meta.get("router_stats_count"):
            raise MfggufError(f"module {m.name} recorded no router statistics; retrain it or use --router uniform")
        mods.append(m)
    N = len(ids)
    comp = N > 0 and cp.check(router, layout, cfg.seed_expert, [m.name for m in mods], [cp.is_complement(m.meta) for m in mods])
    R = N + comp  # routed experts: the seed is one more when the experts complement it
    top_k = (2 if comp else 1) if top_k is None else top_k  # complementing experts trained as seed + one
    pooled = None
    if N and router in ("ridge", "ridge+learned") and not (all(_format1(m) for m in mods) and not run.router_stats_meta.is_file()):
        pooled = load_pooled_stats(run, manifest, trunk, mods)  # format-1 experts alone: their own second moments
        _check_shapes("the pooled router statistics", pooled.entries, pooled_shapes(cfg), f"run `mfgguf router-stats {run.root}`")
    if N and not 1 <= top_k <= R:
        raise MfggufError(f"--top-k {top_k} is out of range; this model has {R} experts, use 1..{R}")
    if N == 0:
        top_k = 0
    merged = merge_plan(mods, trunk_shapes(cfg), merge, density)
    lay = "dense" if N == 0 else layout
    arch = schema.arch_of(layout, N, cfg.family)
    if comp and arch != "granitemoe":
        raise MfggufError(f"experts that complement the seed assemble as granitemoe (a llama trunk) only, not {arch};"
                          " retrain them without --complement")

    slots = _slots(cfg, lay, R, quant, arch)
    ff = {"dense": cfg.trunk_ff, "granitemoe": cfg.expert_ff, "mixtral": cfg.anchor_ff + cfg.expert_ff}[lay]
    kv = [("general.architecture", "STRING", arch), ("general.name", "STRING", f"mfgguf {info.get('partition', '')} {N}x".strip()),
          ("general.file_type", "UINT32", schema.FILE_TYPE[quant]), ("general.quantization_version", "UINT32", 2)]
    kv += schema.model_kv(arch, cfg, n_experts=R, top_k=top_k, ff=ff, shexp_ff=cfg.anchor_ff)
    if (base := imported(run.root)) is not None:  # the base's own context length, not the training context
        ctx = base.gguf_kv()[2]
        kv = [(k, t, ctx if k == f"{arch}.context_length" else v) for k, t, v in kv]
    kv += tok_kv
    kv += [
        ("mfgguf.version", "STRING", __version__),
        ("mfgguf.layout", "STRING", lay),
        ("mfgguf.quant", "STRING", quant),
        ("mfgguf.router", "STRING", router if N else "none"),
        ("mfgguf.top_k", "UINT32", top_k),
        ("mfgguf.preset", "STRING", str(trunk.meta.get("preset", ""))),
        ("mfgguf.partition", "STRING", str(info.get("partition", ""))),
        ("mfgguf.anchor_ff", "UINT32", cfg.anchor_ff),
        ("mfgguf.expert_ff", "UINT32", cfg.expert_ff),
        ("mfgguf.trunk_sha256", "STRING", trunk.meta["sha256"]),
        ("mfgguf.modules", "ARRAY", ("STRING", [trunk.name] + [m.name for m in mods])),
        ("mfgguf.module_sha256", "ARRAY", ("STRING", [trunk.meta["sha256"]] + [m.meta["sha256"] for m in mods])),
    ]
    if pooled is not None:
        kv.append(("mfgguf.router_stats_sha256", "STRING", pooled.meta["sha256"]))
    if N:
        kv.append(("mfgguf.experts", "ARRAY", ("UINT32", ids)))
    if N and needs_stats(router) and not comp:  # what `mfgguf extend` recomputes the router from (routerstats.py)
        counts = [int(m.meta["router_stats_count"]) for m in mods]
        src = pooled.meta["sha256"] if pooled is not None else ""  # "": format-1 experts' own moments, or no G (centroid)
        src_n = 0 if router != "ridge" else int(pooled.meta.get("router_stats_count") or sum(counts)) if pooled else sum(counts)
        kv += routerstats.kv_entries(n_layers=cfg.n_layers, dim=cfg.dim, counts=counts, sources=[src],
                                     source_counts=[src_n], ridge=router == "ridge")
    if comp:  # only then: other files stay byte-identical
        kv.append(("mfgguf.complement", "BOOL", True))  # routed slot 0 is the seed, slot p + 1 expert ids[p]
    if merged:  # only then: files without merged tensors stay byte-identical to those of earlier versions
        kv += [("mfgguf.merge", "STRING", merge), ("mfgguf.merged_tensors", "UINT32", len(merged))]
        if merge == "ties":
            kv.append(("mfgguf.merge_density", "FLOAT64", density))  # f64: the exact float given
    p = Plan(run, cfg, arch, lay, quant, top_k, router, ids, trunk, mods, pooled, kv, slots, merge, density, merged, comp,
             constants=_constants(cfg, arch))
    _place(p)
    return p


def _format1(m: Module) -> bool:
    """A module written before router statistics were pooled: it holds its own second moments."""
    return int(m.meta.get("version", 1)) == 1


def _constants(cfg: ModelConfig, arch: str) -> dict[str, np.ndarray]:
    """Tensors of the file that no module holds: Llama 3.x's RoPE frequency factors (llama.cpp's rope_freqs),
    and qwen2moe's shared-expert gate rows (writers/qwen2moe.py)."""
    out = {}
    if cfg.rope_freq_factors:
        out["rope_freqs.weight"] = np.asarray(cfg.rope_freq_factors, np.float32)  # (head_dim / 2,)
    if arch in schema.SHEXP_GATED:
        for l in range(cfg.n_layers):
            out[blk(l, "ffn_gate_inp_shexp")] = np.full(cfg.dim, schema.SHEXP_GATE_LOGIT_SCALE, np.float32)
    return out


def _slots(cfg: ModelConfig, lay: str, N: int, quant: str, arch: str = "") -> list[Slot]:
    C, V = cfg.dim, cfg.vocab_size
    t = trunk_shapes(cfg)
    shapes: list[tuple[str, tuple[int, ...], int]] = [("token_embd.weight", (V, C), 0)]
    if cfg.rope_freq_factors:
        shapes.append(("rope_freqs.weight", (len(cfg.rope_freq_factors),), 0))
    extras = [x for x in family(cfg.family).extras]
    for l in range(cfg.n_layers):
        for a in schema.ATTN:
            shapes.append((blk(l, a), t[blk(l, a)], 0))
        shapes += [(f"blk.{l}.{x}", t[f"blk.{l}.{x}"], 0) for x in extras]
        if lay == "dense":  # anchor (+ seed: gate/up rows stacked, down columns joined)
            shapes += [(blk(l, "ffn_gate"), (cfg.trunk_ff, C), 0), (blk(l, "ffn_up"), (cfg.trunk_ff, C), 0),
                       (blk(l, "ffn_down"), (C, cfg.trunk_ff), 0)]
            continue
        ff = cfg.expert_ff + (cfg.anchor_ff if lay == "mixtral" else 0)
        shapes.append((blk(l, "ffn_gate_inp"), (N, C), 0))
        shapes += [(blk(l, "ffn_gate_exps"), (N, ff, C), N), (blk(l, "ffn_up_exps"), (N, ff, C), N),
                   (blk(l, "ffn_down_exps"), (N, C, ff), N)]
        if lay == "granitemoe":
            shapes += [(blk(l, f"ffn_{f}_shexp"), t[blk(l, f"ffn_{f}_shexp")], 0) for f in FFN]
            if arch in schema.SHEXP_GATED:
                shapes.append((blk(l, "ffn_gate_inp_shexp"), (C,), 0))
    shapes += [("output_norm.weight", (C,), 0), ("output.weight", (V, C), 0)]
    out = []
    for name, shape, n in shapes:
        qt, why = schema.tensor_type(name, shape, quant)
        out.append(Slot(name, shape, qt, why, nbytes=schema.tensor_nbytes(shape, qt), n_expert=n))
    return out


def _pad(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _place(p: Plan) -> None:
    off = 0
    for s in p.slots:
        s.offset = off
        off += _pad(s.nbytes)
    p.data_offset = _pad(len(header_bytes(p.kv, p.slots)))
    p.total_size = p.data_offset + off
    if any(k == schema.RS_OFFSET for k, _, _ in p.kv):  # the statistics' block follows the tensor data
        p.kv = routerstats.with_offset(p.kv, routerstats.block_start(off))
        p.stats = routerstats.StatsBlock.of_header(lambda k: kv_value(p.kv, k), p.data_offset)
        p.total_size = p.stats.end
    p.header = header_bytes(p.kv, p.slots)
    assert _pad(len(p.header)) == p.data_offset
    p.by_name = {s.name: s for s in p.slots}



# ---- GGUF header serialization -------------------------------------------------------------------

_SCALAR = {VType.UINT8: "<B", VType.INT8: "<b", VType.UINT16: "<H", VType.INT16: "<h", VType.UINT32: "<I",
           VType.INT32: "<i", VType.FLOAT32: "<f", VType.BOOL: "<?", VType.UINT64: "<Q", VType.INT64: "<q",
           VType.FLOAT64: "<d"}


def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value(vt: VType, v) -> bytes:
    if vt == VType.STRING:
        return _str(v)
    return struct.pack(_SCALAR[vt], v)


def header_bytes(kv: list[tuple[str, str, object]], slots: list[Slot]) -> bytes:
    """GGUF v3 header: key-values and tensor infos (not padded). Array values are (item type, list)."""
    out = [schema.GGUF_MAGIC, struct.pack("<IQQ", schema.GGUF_VERSION, len(slots), len(kv))]
    for key, vt, v in kv:
        vt = VType[vt]
        out += [_str(key), struct.pack("<I", vt)]
        if vt == VType.ARRAY:
            it, items = v
            it = VType[it]
            out.append(struct.pack("<IQ", it, len(items)))
            if it == VType.STRING:
                out += [_str(x) for x in items]
            else:
                out.append(np.asarray(items, dtype=_SCALAR[it]).tobytes())
        else:
            out.append(_value(vt, v))
    for s in slots:
        dims = s.shape[::-1]  # ggml order: fastest first
        out += [_str(s.name), struct.pack("<I", len(dims)), struct.pack(f"<{len(dims)}Q", *dims),
                struct.pack("<IQ", schema.QTYPES[s.qtype].ggml, s.offset)]
    return b"".join(out)


def write_header(fd: int, header: bytes, data_offset: int) -> None:
    """The header at offset 0 of `fd`, zeros up to `data_offset`."""
    at = pwrite_all(fd, np.frombuffer(header, np.uint8), 0)
    pwrite_all(fd, np.zeros(data_offset - at, np.uint8), at)


# ---- tokenizer -----------------------------------------------------------------------------------


def run_tokenizer_kv(run: RunDir) -> tuple[list[tuple[str, str, object]], int]:
    """The tokenizer keys a RUN's GGUF carries and its vocabulary size: an imported base's own, copied
    unchanged (base/runbase.py), else those of the RUN's byte-level BPE."""
    base = imported(run.root)
    if base is not None:
        kv, vocab, _ = base.gguf_kv()
        return kv, vocab
    return tokenizer_kv(run.tokenizer)


def tokenizer_kv(path: Path) -> tuple[list[tuple[str, str, object]], int]:
    """GGUF tokenizer keys for a byte-level BPE tokenizer.json, and its vocabulary size."""
    if not path.is_file():
        raise MfggufError(f"tokenizer not found: {path}; create the run with `mfgguf prepare`")
    try:
        tj = json.loads(path.read_text(encoding="utf-8"))
        model = tj["model"]
        vocab: dict[str, int] = dict(model["vocab"])
        merges = model.get("merges", [])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise MfggufError(f"tokenizer {path} is unreadable ({e}); re-create the run with `mfgguf prepare`") from None
    if model.get("type", "BPE") != "BPE":
        raise MfggufError(f"tokenizer {path} is {model.get('type')}, not byte-level BPE; re-create the run with `mfgguf prepare`")
    added = {a["content"]: a for a in tj.get("added_tokens", [])}
    for a in added.values():
        vocab.setdefault(a["content"], a["id"])
    n = max(vocab.values()) + 1
    tokens: list[str | None] = [None] * n
    for s, i in vocab.items():
        tokens[i] = s
    if any(t is None for t in tokens):
        raise MfggufError(f"tokenizer {path} has gaps in its token ids; re-create the run with `mfgguf prepare`")
    types = [schema.TOKEN_NORMAL] * n
    for a in added.values():
        types[a["id"]] = schema.TOKEN_CONTROL if a.get("special") else 4  # 4: USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    eos = vocab.get(schema.EOS_TOKEN)
    if eos is None:
        raise MfggufError(f"tokenizer {path} has no {schema.EOS_TOKEN} token; re-create the run with `mfgguf prepare`")
    kv = [
        ("tokenizer.ggml.model", "STRING", "gpt2"),
        ("tokenizer.ggml.pre", "STRING", "gpt-2"),
        ("tokenizer.ggml.tokens", "ARRAY", ("STRING", tokens)),
        ("tokenizer.ggml.token_type", "ARRAY", ("INT32", types)),
        ("tokenizer.ggml.merges", "ARRAY", ("STRING", merges)),
        ("tokenizer.ggml.bos_token_id", "UINT32", eos),  # GPT-2 style: one token opens and ends documents
        ("tokenizer.ggml.eos_token_id", "UINT32", eos),
        ("tokenizer.ggml.padding_token_id", "UINT32", eos),
        ("tokenizer.ggml.add_bos_token", "BOOL", False),  # training sequences carry no BOS
        ("tokenizer.ggml.add_eos_token", "BOOL", False),
        ("tokenizer.chat_template", "STRING", schema.CHAT_TEMPLATE),
    ]
    return kv, n
