"""The file `extend` writes: laid out from the finished file's header and the additions, then streamed.

The trunk and the kept experts' slots are copied byte for byte (copy_file_range, no decode); only the new
experts' tensors are quantized as their module files stream; the router rows and the statistics block go
in last (extend.py tells the whole story).
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass, field

import numpy as np

from mfgguf.errors import MfggufError
from mfgguf.converters import quant as Q
from mfgguf.gguf.fileio import allocate, pread_into, pwrite_all, truncated
from mfgguf.modules.module import Module
from mfgguf.gguf.writer import Slot, header_bytes, write_header
from mfgguf.converters.plan.names import BASE, LABELS, TOKENS, TRUNKS, expert_kv, model_name
from mfgguf.modules.merge import open_checked
from mfgguf.converters.routing.router import RouterBuilder, keep_rows
from mfgguf.converters.routing.stats import StatsBlock, block_start, read_f32, with_offset
from mfgguf.gguf.schema import (ALIGNMENT, QTYPE_BY_ID, ROUTING_RECORDS, RS_COUNTS, RS_EXPERT_SOURCE, RS_SOURCE_COUNTS, RS_SOURCES, blk)
from mfgguf.converters.stream import stream_modules
from mfgguf.converters.extension.folded import Fold
from mfgguf.converters.extension.source import Additions, Source

EXPS_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
FFN_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.weight")
STAT_RE = re.compile(r"router_stats\.blk\.(\d+)\.mean")
COPY_BYTES = 64 << 20  # bytes per copy_file_range call


# ---- the new file --------------------------------------------------------------------------------


@dataclass
class Extension:
    src: Source
    slot_of: list[int | None]  # new slot -> old slot, or None for an added expert
    new: list[Module]  # added experts, in slot order after the kept ones
    sources: list[int | None]  # new source -> old source, or None for the added RUN's
    adds: Additions | None
    kv: list
    slots: list[Slot]
    arch: str
    header: bytes = b""  # layout.header_bytes
    data_offset: int = 0
    total_size: int = 0
    stats: StatsBlock | None = None  # the new file's statistics block
    old: dict[str, object] = field(default_factory=dict)  # old tensor infos by name


def plan_extension(src: Source, keep: list[int], adds: Additions | None, keep_routing: bool = False) -> Extension:
    v = src.h.value
    new = adds.mods if adds else []
    N = len(keep) + len(new)
    if N == 0:
        raise MfggufError("that removes every expert; assemble the trunk alone with `mfgguf assemble RUN --experts none`")
    if src.top_k > N:
        raise MfggufError(f"{src.path.name} routes each token to {src.top_k} experts; it cannot keep only {N}")
    old_src = v(RS_EXPERT_SOURCE)
    sources: list[int | None] = sorted({old_src[p] for p in keep})
    expert_source = [sources.index(old_src[p]) for p in keep]
    if new:
        shas = v(RS_SOURCES)
        s = next((sources.index(j) for j, sha in enumerate(shas) if sha == adds.source and j in sources), None)
        if s is None:
            hit = next((j for j, sha in enumerate(shas) if sha == adds.source), None)  # all its experts were removed
            sources.append(hit)
            s = len(sources) - 1
        expert_source += [s] * len(new)
    assert src.router != "ridge" or (None in sources) == (adds is not None and adds.pooled is not None)
    names, shas, ids = v("mfgguf.modules"), v("mfgguf.module_sha256"), v("mfgguf.experts")
    counts = [v(RS_COUNTS)[p] for p in keep] + [int(m.meta.router_stats_count) for m in new]
    src_shas = [v(RS_SOURCES)[j] if j is not None else adds.source for j in sources]
    src_counts = [v(RS_SOURCE_COUNTS)[j] if j is not None else adds.source_count for j in sources]
    repl = {
        f"{src.arch}.expert_count": N,
        "mfgguf.modules": ("STRING", [names[0]] + [names[1 + p] for p in keep] + [m.name for m in new]),
        "mfgguf.module_sha256": ("STRING", [shas[0]] + [shas[1 + p] for p in keep] + [m.meta.sha256 for m in new]),
        "mfgguf.experts": ("UINT32", [ids[p] for p in keep] + [m.index for m in new]),
        RS_COUNTS: ("UINT64", counts),
        RS_EXPERT_SOURCE: ("UINT32", expert_source),
        RS_SOURCES: ("STRING", src_shas),
        RS_SOURCE_COUNTS: ("UINT64", src_counts),
        "mfgguf.router_stats_sha256": src_shas[0],
    }
    repl.update(_named(src, keep, adds))
    part, base = v("mfgguf.partition", ""), v(BASE)
    if base is not None and v("general.name") == model_name(base, src.n):
        repl["general.name"] = model_name(base, N)
    elif v("general.name") == f"mfgguf {part} {src.n}x".strip():  # a file of an earlier version: its own form
        repl["general.name"] = f"mfgguf {part} {N}x".strip()
    # recomputed rows are the closed form again: a calibration's or a tuning's record would describe rows that are gone
    drop = () if keep_routing else ROUTING_RECORDS
    kv = [(k, t, repl[k] if k in repl else val) for k, t, val in src.h.kv if k not in drop]
    kv += [(k, "ARRAY", repl[k]) for k in (LABELS, TOKENS, TRUNKS) if k in repl and src.h.value(k) is None]
    slots = []
    for t in src.h.tensors:
        shape = t.shape
        if EXPS_RE.fullmatch(t.name):
            shape = (N, *shape[1:])
        elif t.name.endswith("ffn_gate_inp.weight"):
            shape = (N, shape[1])
        q = QTYPE_BY_ID[t.ggml_type].name
        rows = int(np.prod(shape[:-1]))
        slots.append(Slot(t.name, shape, q, None, nbytes=rows * QTYPE_BY_ID[t.ggml_type].row_bytes(shape[-1]),
                          n_expert=N if EXPS_RE.fullmatch(t.name) else 0))
    p = Extension(src, [*keep, *[None] * len(new)], new, sources, adds, kv, slots, src.arch)
    off = 0
    for s in slots:
        s.offset = off
        off += (s.nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
    p.data_offset = (len(header_bytes(kv, slots)) + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
    p.stats = StatsBlock(p.data_offset + block_start(off), src.L, src.D, N, len(sources), src.stats.ridge)
    p.kv = with_offset(kv, block_start(off))
    p.header = header_bytes(p.kv, slots)
    p.total_size = p.stats.end
    p.old = {t.name: t for t in src.h.tensors}
    return p


def _named(src: Source, keep: list[int], adds: Additions | None) -> dict:
    """The experts' names, tokens and trunks (plan/names.py) of the kept slots, then of the added experts; a file of an
    earlier version names its kept experts by their module."""
    v, new = src.h.value, adds.mods if adds else []
    old = {LABELS: v(LABELS) or [f"{n}" for n in v("mfgguf.modules")[1:]], TOKENS: v(TOKENS) or [0] * src.n,
           TRUNKS: v(TRUNKS) or [src.trunk_sha] * src.n}
    added = dict((k, val[1]) for k, _, val in expert_kv(adds.run, [m.index for m in new], [m.meta for m in new],
                                                       src.h.value("tokenizer.ggml.tokens"))) if new else {}
    types = {LABELS: "STRING", TOKENS: "UINT64", TRUNKS: "STRING"}
    return {k: (types[k], [old[k][p] for p in keep] + list(added.get(k, []))) for k in types}


def write_extension(p: Extension, fin: int, fd: int, threads: int, keep_routing: bool = False) -> None:
    src, N = p.src, len(p.slot_of)
    write_header(fd, p.header, p.data_offset)
    allocate(fd, p.total_size)
    written = {s.name: 0 for s in p.slots}
    fold = Fold(src.anchor_ff, p.adds.trunk) if src.anchor_ff and p.new else None
    for s in p.slots:  # the trunk and the kept experts: their bytes as they are
        t = p.old[s.name]
        base = src.h.data_offset + t.offset
        if s.n_expert:
            eb = s.nbytes // N
            for q, old in enumerate(p.slot_of):
                if old is not None:
                    _copy(fin, fd, eb, base + old * eb, p.data_offset + s.offset + q * eb)
                    written[s.name] += eb
                elif fold is not None and (rows := fold.anchor_rows(EXPS_RE.fullmatch(s.name).group(2))):
                    _copy(fin, fd, rows * s.row_bytes, base, p.data_offset + s.offset + q * eb)  # from its first slot
                    written[s.name] += rows * s.row_bytes
        elif not s.name.endswith("ffn_gate_inp.weight"):
            _copy(fin, fd, s.nbytes, base, p.data_offset + s.offset)
            written[s.name] += s.nbytes
    # the added experts (and their RUN's G, when it is a new source: hashed here, read a layer at a time below; and a
    # folded file's trunk: hashed here, the anchor's down columns read from it beside the stream)
    first = len(p.slot_of) - len(p.new)
    lead = [m for m in (fold.trunk if fold else None, p.adds.pooled if p.adds else None) if m is not None]
    mu_new = np.zeros((len(p.new), src.L, src.D), np.float32)
    off = len(lead)
    with fold or contextlib.nullcontext():
        for pos, name, r0, x, release in stream_modules(lead + p.new, lanes=2):
            try:
                if pos < off:
                    continue
                if (st := STAT_RE.fullmatch(name)) is not None:
                    mu_new[pos - off, int(st.group(1))] = x.reshape(-1)
                    continue
                if (m := FFN_RE.fullmatch(name)) is None:
                    continue
                l, f = int(m.group(1)), m.group(2)
                s = _slot(p, blk(l, f"ffn_{f}_exps"))
                at = s.offset + (first + pos - off) * (s.nbytes // N)
                for r, y in fold.rows(l, f, r0, x) if fold else [(r0, x)]:
                    q = Q.quantize(y, s.qtype, threads=threads)
                    pwrite_all(fd, q, p.data_offset + at + r * s.row_bytes)
                    written[s.name] += q.nbytes
            finally:
                release()
    # router statistics: kept arrays copied as they are, new ones written; then the router from them
    old_at, at = src.stats, p.stats
    mu = np.zeros((N, src.L, src.D), np.float32)
    for q, old in enumerate(p.slot_of):
        if old is not None:
            mu[q] = read_f32(fin, old_at.mean(old), (src.L, src.D))
        else:
            mu[q] = mu_new[q - first]
        pwrite_all(fd, mu[q], at.mean(q))
    counts = _kv(p, RS_COUNTS)
    pooled = None
    if at.ridge:
        for j, old in enumerate(p.sources):
            if old is not None:
                _copy(fin, fd, src.L * at.layer_bytes, old_at.second_moment(old), at.second_moment(j))
            else:
                _copy_pooled(p.adds.pooled, fd, at, j)
        weights = [float(c) for c in _kv(p, RS_SOURCE_COUNTS)]
        pooled = lambda l: _pooled_layer(fd, at, weights, l)  # noqa: E731
    rb = RouterBuilder(src.router, n_layers=src.L, dim=src.D, n_experts=N, pooled=pooled)
    for q in range(N):
        for l in range(src.L):
            rb.add_mean(q, l, mu[q, l], int(counts[q]))
    for l, w in enumerate(rb.finish()):  # w: (N, dim) f32
        s = _slot(p, blk(l, "ffn_gate_inp"))
        if keep_routing:
            t = p.old[s.name]
            w = keep_rows(w, read_f32(fin, src.h.data_offset + t.offset, (src.n, src.D)), p.slot_of)
        pwrite_all(fd, Q.quantize(w, s.qtype), p.data_offset + s.offset)
        written[s.name] += s.nbytes
    _finish(p, written, fd)


def _finish(p: Extension, written: dict[str, int], fd: int) -> None:
    """Every tensor written whole, and on disk, before the file is read back and renamed over the destination."""
    short = [s.name for s in p.slots if written[s.name] != s.nbytes]
    if short:
        raise AssertionError(f"{len(short)} tensors incompletely written, e.g. {short[0]}")
    os.fsync(fd)


def _copy_pooled(m: Module, fd: int, at: StatsBlock, j: int) -> None:
    """The added RUN's pooled G, layer by layer, into source j of the new file's block (the file the stream
    hashed: same size and mtime)."""
    fin = open_checked(m)
    try:
        G = np.empty((at.dim, at.dim), np.float32)
        for l in range(at.n_layers):
            e = m.entries[f"router_stats.blk.{l}.second_moment"]
            pwrite_all(fd, pread_into(fin, G, e.begin, truncated(m)), at.second_moment(j, l))
    finally:
        os.close(fin)


def _pooled_layer(fd: int, at: StatsBlock, weights: list[float], l: int) -> np.ndarray:
    """Layer l of the G the router uses, from the sources just written: one source's G as recorded (as assembly
    used it), or their token-weighted mean."""
    if len(weights) == 1:
        return read_f32(fd, at.second_moment(0, l), (at.dim, at.dim))
    acc = sum(read_f32(fd, at.second_moment(j, l), (at.dim, at.dim)).astype(np.float64) * w for j, w in enumerate(weights))
    return (acc / sum(weights)).astype(np.float32)


def _kv(p: Extension, key: str):
    return next(v[1] for k, _, v in p.kv if k == key)


def _slot(p: Extension, name: str) -> Slot:
    return next(s for s in p.slots if s.name == name)


def _copy(fin: int, fout: int, n: int, src_off: int, dst_off: int) -> None:
    """n bytes from fin at src_off to fout at dst_off, in the kernel where it can (copy_file_range)."""
    in_kernel = getattr(os, "copy_file_range", None)  # Linux only
    while n > 0:
        try:
            k = in_kernel(fin, fout, min(n, COPY_BYTES), src_off, dst_off) if in_kernel else 0
        except OSError:
            k = 0
        if k <= 0:  # another OS, another filesystem or no kernel support: a plain read and write
            b = os.pread(fin, min(n, COPY_BYTES), src_off)
            if not b:
                raise MfggufError("the model file ended early while copying; it is truncated")
            k = os.pwrite(fout, b, dst_off)
        n, src_off, dst_off = n - k, src_off + k, dst_off + k
