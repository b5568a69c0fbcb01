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
    >>> p = plan(RunDir("RUN"), quant="q8_0", top_k=1, router="ridge", layout="shared-expert", experts=None)
    >>> p.slot("blk.0.ffn_up_exps.weight").expert_bytes
    >>> p.total_size
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mfgguf import __version__
from mfgguf.config import ModelConfig
from mfgguf.base.runbase import imported
from mfgguf.errors import MfggufError
from mfgguf.run import RunDir, RunInfo, read_manifest
from mfgguf.converters.routing import seed_gate as sg
from mfgguf.converters.routing import stats as routerstats
from mfgguf.gguf import schema
from mfgguf.modules.merge import merge_plan
from mfgguf.converters.routing.router import needs_stats
from mfgguf.gguf.header import kv_value
from mfgguf.families import family, resolve_layout
from mfgguf.gguf.schema import ALIGNMENT, FFN, blk

from mfgguf.gguf.writer import Slot, header_bytes
from mfgguf.converters.plan.names import BASE, base_name, expert_kv, model_name
from mfgguf.converters.plan.modules import load_pooled_stats
from mfgguf.modules.module import (Module, check_shapes, expert_shapes, load_module, model_config, pooled_shapes,
                                   trunk_shapes)
from mfgguf.modules.tokenizer import run_tokenizer_kv


# ---- the plan ------------------------------------------------------------------------------------


@dataclass
class Plan:
    run: RunDir
    cfg: ModelConfig
    arch: str
    layout: str  # shared-expert | folded | dense
    quant: str
    top_k: int
    router: str
    experts: list[int]  # expert ids in slot order
    trunk: Module
    expert_modules: list[Module]  # headers only; streaming reopens each file in turn
    pooled: Module | None  # the router's pooled second moments (None: not needed)
    kv: list[tuple[str, str, object]]
    slots: list[Slot]
    merge: str = "none"  # how the experts' copies of trunk tensors are merged (merge.py)
    merged: dict[str, list[int]] = field(default_factory=dict)  # trunk tensor -> expert positions holding a copy
    routed_seed: bool = False  # the seed is routed slot 0: a seed gate (routing/seed_gate.py)
    seed_gate: float | None = None  # plain experts with the seed routed: its row is this x the ridge rows' sum
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


def plan(run: RunDir, *, quant: str, top_k: int | None, router: str, layout: str, experts: list[int] | None,
         merge: str = "mean", seed_gate: float | None = None) -> Plan:
    """Validate everything and lay the file out; reads metadata and headers only."""
    schema.qtype(quant)
    if quant not in schema.USER_QUANTS:
        raise MfggufError(f"unknown quant type {quant!r}; choose one of {', '.join(schema.USER_QUANTS)}")
    if router not in schema.ROUTERS:
        raise MfggufError(f"unknown router {router!r}; choose one of {', '.join(schema.ROUTERS)}")
    stats = needs_stats(router)  # the experts' means feed the router
    info = run.run_info()
    run.check_no_pending_sync()
    manifest = read_manifest(run)
    tok_kv, vocab = run_tokenizer_kv(run)
    trunk = load_module(run, 0, manifest)
    cfg = model_config(trunk, vocab)
    cfg.validate()
    layout = resolve_layout(family(cfg.family), layout)
    check_shapes("module trunk", trunk.entries, trunk_shapes(cfg), "retrain the trunk")

    ids = list(range(1, info.n_experts + 1)) if experts is None else list(experts)
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise MfggufError(f"expert {dup[0]} is listed twice in --experts; list each expert once")
    mods = _expert_modules(run, ids, manifest, trunk, cfg, stats, router)
    N = len(ids)
    if seed_gate is not None and not N:
        raise MfggufError("--seed-gate routes the seed beside experts, and none is selected; drop it or select experts")
    routed_seed = N > 0 and sg.check(router, cfg.seed_expert, seed_gate)
    R = N + routed_seed  # routed experts: the seed is one more when a gate routes it
    top_k = 1 if top_k is None else top_k
    pooled = None
    if N and router == "ridge":
        pooled = load_pooled_stats(run, manifest, trunk, mods)
        check_shapes("the pooled router statistics", pooled.entries, pooled_shapes(cfg), f"run `mfgguf router-stats {run.root}`")
    if N and not 1 <= top_k <= R:
        raise MfggufError(f"--top-k {top_k} is out of range; this model has {R} experts, use 1..{R}")
    if N == 0:
        top_k = 0
    merged = merge_plan(mods, trunk_shapes(cfg), merge)
    lay = "dense" if N == 0 else layout
    arch = schema.arch_of(layout, N, cfg.family)
    if seed_gate is not None and lay == "folded" and any("_shexp." in n for n in merged):  # a merged anchor
        raise MfggufError("--seed-gate in the folded layout (llama, qwen3moe) cannot fold an anchor the experts"
                          " trained (--shared all) into the seed's slot; pass --merge none or --layout shared-expert")

    if not cfg.anchor_ff and lay == "shared-expert" and arch in schema.SHEXP_GATED:
        raise MfggufError(f"this trunk has no anchor (its seed is the base's whole FFN), and {arch} needs a shared expert;"
                          " pass --layout folded")
    slots = _slots(cfg, lay, R, quant, arch)
    ff = {"dense": cfg.trunk_ff, "shared-expert": cfg.expert_ff, "folded": cfg.anchor_ff + cfg.expert_ff}[lay]
    name = base_name(run.root, str(trunk.meta.preset or ""))
    kv = [("general.architecture", "STRING", arch), ("general.name", "STRING", model_name(name, N)),
          ("general.file_type", "UINT32", schema.FILE_TYPE[quant]), ("general.quantization_version", "UINT32", 2)]
    kv += schema.model_kv(arch, cfg, n_experts=R, top_k=top_k, ff=ff, shexp_ff=cfg.anchor_ff)
    if (base := imported(run.root)) is not None:  # the base's own context length, not the training context
        ctx = base.gguf_kv()[2]
        kv = [(k, t, ctx if k == f"{arch}.context_length" else v) for k, t, v in kv]
    kv += tok_kv
    kv += _mfgguf_kv(cfg, info, trunk, mods, ids, pooled, lay=lay, quant=quant, router=router, top_k=top_k,
                     routed_seed=routed_seed, merged=merged, merge=merge, seed_gate=seed_gate)
    vocab_tokens = next((v[1] for k, _, v in tok_kv if k == "tokenizer.ggml.tokens"), None)
    kv += [(BASE, "STRING", name)] + (expert_kv(run, ids, [m.meta for m in mods], vocab_tokens) if N else [])
    p = Plan(run, cfg, arch, lay, quant, top_k, router, ids, trunk, mods, pooled, kv, slots, merge, merged, routed_seed,
             seed_gate, constants=_constants(cfg, arch))
    _place(p)
    return p


def _expert_modules(run: RunDir, ids: list[int], manifest: dict, trunk: Module, cfg: ModelConfig, stats: bool,
                    router: str) -> list[Module]:
    """The experts' modules, each checked: its last round synced, trained against this trunk, shaped as the config says."""
    mods = []
    for i in ids:
        run.check_expert_index(i)
        m = load_module(run, i, manifest)
        if m.meta.round < m.meta.rounds:
            raise MfggufError(f"module {m.name} has trained round {m.meta.round} of {m.meta.rounds}; run"
                              f" `mfgguf sync RUN`, then `mfgguf train-expert RUN --expert {i}` for the next round")
        if (trunk.meta.final and m.meta.trunk_sha256 == trunk.meta.synced_from
                and not m.meta.shared_merged):
            raise MfggufError(f"module {m.name}'s router statistics predate the final sync; run"
                              f" `mfgguf restat RUN --expert {i}` (or `mfgguf sync RUN` for all)")
        if m.meta.trunk_sha256 != trunk.meta.sha256:
            raise MfggufError(f"module {m.name} was trained against a different trunk; retrain it with `mfgguf train-expert RUN --expert {i}`")
        check_shapes(f"module {m.name}", m.entries, expert_shapes(cfg, stats),
                     "retrain it (or use --router uniform if only its statistics are missing)")
        if stats and not m.meta.router_stats_count:
            raise MfggufError(f"module {m.name} recorded no router statistics; retrain it or use --router uniform")
        mods.append(m)
    return mods


def _mfgguf_kv(cfg: ModelConfig, info: RunInfo, trunk: Module, mods: list[Module], ids: list[int], pooled: Module | None, *,
               lay: str, quant: str, router: str, top_k: int, routed_seed: bool, merged: dict, merge: str,
               seed_gate: float | None = None) -> list[tuple[str, str, object]]:
    """The `mfgguf.*` keys: what the file was assembled from and how, and what `extend` recomputes the router from."""
    N = len(mods)
    kv = [
        ("mfgguf.version", "STRING", __version__),
        ("mfgguf.layout", "STRING", lay),
        ("mfgguf.quant", "STRING", quant),
        ("mfgguf.router", "STRING", router if N else "none"),
        ("mfgguf.top_k", "UINT32", top_k),
        ("mfgguf.preset", "STRING", str(trunk.meta.preset or "")),
        ("mfgguf.partition", "STRING", str(info.partition or "")),
        ("mfgguf.anchor_ff", "UINT32", cfg.anchor_ff),
        ("mfgguf.expert_ff", "UINT32", cfg.expert_ff),
        ("mfgguf.trunk_sha256", "STRING", trunk.meta.sha256),
        ("mfgguf.modules", "ARRAY", ("STRING", [trunk.name] + [m.name for m in mods])),
        ("mfgguf.module_sha256", "ARRAY", ("STRING", [trunk.meta.sha256] + [m.meta.sha256 for m in mods])),
    ]
    if pooled is not None:
        kv.append(("mfgguf.router_stats_sha256", "STRING", pooled.meta.sha256))
    if N:
        kv.append(("mfgguf.experts", "ARRAY", ("UINT32", ids)))
    if N and needs_stats(router) and not routed_seed:  # what `mfgguf extend` recomputes the router from (routing/stats.py)
        counts = [int(m.meta.router_stats_count) for m in mods]
        src = pooled.meta.sha256 if pooled is not None else ""  # "": no G (centroid)
        src_n = int(pooled.meta.router_stats_count or sum(counts)) if pooled is not None else 0
        kv += routerstats.kv_entries(n_layers=cfg.n_layers, dim=cfg.dim, counts=counts, sources=[src],
                                     source_counts=[src_n], ridge=router == "ridge")
    if routed_seed:  # only then: other files stay byte-identical
        # routed slot 0 is the seed, slot p + 1 expert ids[p]; the key keeps its older name so earlier files still read
        kv.append(("mfgguf.complement", "BOOL", True))
    if seed_gate is not None:
        kv.append(("mfgguf.seed_gate", "FLOAT64", float(seed_gate)))  # f64: the exact C given
    if merged:  # only then: files without merged tensors stay byte-identical to those of earlier versions
        kv += [("mfgguf.merge", "STRING", merge), ("mfgguf.merged_tensors", "UINT32", len(merged))]
    return kv


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
        ff = cfg.expert_ff + (cfg.anchor_ff if lay == "folded" else 0)
        shapes.append((blk(l, "ffn_gate_inp"), (N, C), 0))
        shapes += [(blk(l, "ffn_gate_exps"), (N, ff, C), N), (blk(l, "ffn_up_exps"), (N, ff, C), N),
                   (blk(l, "ffn_down_exps"), (N, C, ff), N)]
        if lay == "shared-expert" and cfg.anchor_ff:  # no anchor (the seed is the base's whole FFN): no shared expert
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
