"""Add experts to a finished MoE GGUF, or remove some, without its modules and without retraining.

`mfgguf assemble` records in the file what the router was computed from (routerstats.py): each
expert's FFN-input means and token count, and each source's pooled second moment G with its token
count, beside the trunk's sha256 (`mfgguf.trunk_sha256`). `extend` reads them back, drops the
removed slots, adds experts of another RUN trained against the same trunk (their means from their
module files, their RUN's pooled G as a new source), and recomputes the router in closed form
(router.py), exactly as assembly would.

Sources. G is kept per source, never summed into one matrix: a source is one RUN's pooled
statistics file (named by its sha256), and the G the router uses is their token-weighted mean,
G = sum_s c_s G_s / sum_s c_s (one source: G_s itself). A source stays while any expert that came
with it does. So removing what was added drops its source and gives back the very bytes the router
was computed from: the router, and the whole file, come back bit for bit. The price is one
layers x dim x dim f32 array per source in the statistics block after the tensor data
(routerstats.py; `tiny` 32 KB, `small` 1 MB, `1b` 50 MB), which no GGUF reader loads. Experts
added from the RUN a source already came from share its G.

Streaming, as assembly: the output is preallocated beside the destination; every tensor of the
trunk and every kept expert slot of the stacked `_exps` tensors is copied byte for byte
(copy_file_range, no decode), only the new experts' tensors are quantized (ggml's reference
quantizer, the type of the slot they join), row chunk by row chunk as their module files stream
and are hashed (stream.py); the router rows and the statistics go in last, then the file is
re-read (readback.py) and renamed over the destination. Memory holds the N means (layers x dim),
one layer of G at a time and a few chunks: not the experts, not a whole G.

Refused with one line, nothing written: a GGUF without the router statistics (not written by this
mfgguf's assemble, or with a router that needs none, or rewritten by a tool that dropped the block
after its tensors), a layout other than granitemoe, a file whose
trunk was merged from experts' copies, an expert trained against another trunk (or unfinished, or
with trunk copies of its own, or already in the file), a slot K out of range, and an existing
destination without --force.

Example:
    >>> extend(Path("model.gguf"), Path("model5.gguf"), add=Path("RUN2"), experts=[1])
    {'path': 'model5.gguf', 'experts': 5, 'added': 1, 'removed': 0, ...}
"""

from __future__ import annotations

import errno
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mfgguf.errors import MfggufError
from mfgguf.run import RunDir, atomic_path, finished_against, read_manifest, router_stats_stale
from mfgguf.converters import quant as Q
from mfgguf.converters.plan.ensure_stats import Pool, plan_with_stats
from mfgguf.gguf.fileio import pread_into, pwrite_all, truncated
from mfgguf.converters.routing.guard import Guard, guard_new_rows
from mfgguf.gguf.header import Header, read_gguf_header
from mfgguf.converters.plan.modules import Module, PooledStatsNeeded, load_module, read_header
from mfgguf.converters.plan.header import Slot, header_bytes, write_header
from mfgguf.converters.plan.tokenizer import run_tokenizer_kv
from mfgguf.converters.merge import open_checked
from mfgguf.converters.readback import verify
from mfgguf.converters.routing.router import RouterBuilder, keep_rows
from mfgguf.converters.routing.stats import StatsBlock, block_start, read_f32, with_offset
from mfgguf.gguf.schema import (ALIGNMENT, QTYPE_BY_ID, ROUTING_RECORDS, RS_COUNTS, RS_EXPERT_SOURCE, RS_OLD_BLOBS,
                     RS_SOURCE_COUNTS, RS_SOURCES, blk)
from mfgguf.converters.stream import stream_modules

EXPS_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
FFN_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.weight")
STAT_RE = re.compile(r"router_stats\.blk\.(\d+)\.(mean|second_moment)")
COPY_BYTES = 64 << 20  # bytes per copy_file_range call


def extend(model: Path, out: Path, *, add: Path | None = None, experts: list[int] | None = None,
           remove: list[int] | None = None, force: bool = False, threads: int | None = None,
           keep_routing: bool = False, guard: Guard | None = None, pool_stats: Pool | None = None) -> dict:
    """Add experts trained later against the same trunk to a finished MoE GGUF, or remove experts
    from it, without the original modules and without retraining: the router is recomputed in closed
    form from the statistics `assemble` recorded in the file. --add RUN takes the experts of RUN
    (--experts LIST: some of them) trained against the model's trunk; --remove K,... drops the
    K-th experts (1..N in the file's order: `mfgguf inspect`'s slot K-1; removal first, then additions).
    Existing experts are copied byte for byte, only new ones are quantized, one tensor at a time.
    Removing what was added gives back the original file. An existing OUT is replaced only with
    --force. --keep-routing leaves the experts already in the file their router rows exactly (tokens
    rank them as before) and puts an added expert's closed-form row on their scale, instead of
    recomputing every row: a domain opted in or out moves the others less. --guard PCT keeps the rows too and
    lowers the added experts' logits by the fewest nats (searched: 0, 0.25, 0.5, 1, ..., then halved gaps) under
    which every old expert's training shard (a 4,096-token sample from --guard-run RUN, default the --add RUN,
    scored by llama.cpp) moves by at most PCT percent of perplexity: the price, the new domain's own gain given
    back, is printed. `pool_stats` is the router-stats pass run first where the --add RUN's pooled statistics
    are missing or stale (as `assemble` does; None: the planner's error stands).

    Example:
        mfgguf extend model.gguf --add RUN2 --experts 1 -o model4.gguf
    """
    t0 = time.perf_counter()
    model, out = Path(model), Path(out)
    if not model.is_file():
        raise MfggufError(f"{model} does not exist; give the .gguf written by `mfgguf assemble`")
    if out.is_dir():
        raise MfggufError(f"{out} is a directory; give a file name such as {out / 'model.gguf'}")
    if out.exists() and not force:
        raise MfggufError(f"{out} already exists; pass --force to overwrite it")
    if add is None and not remove:
        raise MfggufError("nothing to do: pass --add RUN (and --experts LIST) and/or --remove K[,K...]")
    if experts is not None and add is None:
        raise MfggufError("--experts selects experts of the RUN given with --add; pass --add RUN")
    if guard is not None and (add is None or remove):
        raise MfggufError("--guard keeps the old experts' domains in place when experts are added: pass --add RUN,"
                          " and remove experts in an extend of its own")
    if guard is not None and not 0 < guard.max_move < 1:
        raise MfggufError(f"--guard {100 * guard.max_move:g} is out of range; give the largest move allowed in percent,"
                          " e.g. 0.5")
    keep_routing = keep_routing or guard is not None
    src = _Source.read(model)
    keep = src.kept(remove or [])
    adds = plan_with_stats(lambda: _additions(Path(add), experts, src), RunDir(add), progress=False,
                           verb="extend", experts=experts, pool=pool_stats) if add else None
    p = _plan(src, keep, adds, keep_routing)
    with open(model, "rb") as fin:
        with atomic_path(out, suffix=f".{os.getpid()}") as tmp:
            fd = os.open(tmp, os.O_RDWR)
            try:
                _write(p, fin.fileno(), fd, threads or Q.default_threads(), keep_routing)
            finally:
                os.close(fd)
            verify(p, tmp)
            guarded = guard_new_rows(model, tmp, RunDir(add), new_slots=list(range(len(keep), len(p.slot_of))),
                                     guard=guard, threads=threads) if guard else None
            m = os.umask(0)
            os.umask(m)
            os.chmod(tmp, 0o644 & ~m)
    return {"path": str(out), "bytes": p.total_size, "experts": len(p.slot_of), "added": len(p.new),
            "removed": src.n - len(keep), "router": src.router, "sources": len(p.sources), "keep_routing": keep_routing,
            "guard": guarded, "seconds": round(time.perf_counter() - t0, 3)}


# ---- the file we start from ----------------------------------------------------------------------


@dataclass
class _Source:
    path: Path
    h: Header
    arch: str
    n: int  # experts in the file
    L: int
    D: int
    ff: int  # expert FFN width
    router: str
    top_k: int
    trunk_sha: str
    stats: StatsBlock | None = None  # where its router statistics lie

    @classmethod
    def read(cls, path: Path) -> "_Source":
        h = read_gguf_header(path)
        v = h.value
        if not v("mfgguf.version"):
            raise MfggufError(f"{path} was not written by `mfgguf assemble` (no mfgguf keys, no router statistics);"
                              " extend works on the files mfgguf assembles")
        arch, layout = v("general.architecture"), v("mfgguf.layout")
        if layout != "granitemoe" or arch != "granitemoe":
            raise MfggufError(f"{path} has the {layout} layout; extend supports granitemoe files: re-assemble with"
                              " `--layout granitemoe`")
        if v("mfgguf.complement"):
            raise MfggufError(f"{path} routes the seed as expert 0 (complementing experts); extend supports files of"
                              " plain experts: re-assemble with the new experts instead")
        router = v("mfgguf.router")
        if router not in ("ridge", "centroid"):
            raise MfggufError(f"{path}'s router is {router}: there are no router statistics to recompute it from;"
                              " re-assemble it with `--router ridge`")
        if v(RS_OLD_BLOBS[0]) is not None:
            raise MfggufError(f"{path} was assembled by mfgguf 0.1, which kept the router statistics in the"
                              " header; re-assemble it with this `mfgguf assemble` to extend it")
        stats = StatsBlock.of_header(v, h.data_offset)
        if v(RS_COUNTS) is None or stats is None or (router == "ridge") != stats.ridge:
            raise MfggufError(f"{path} carries no router statistics (assembled before mfgguf recorded them);"
                              " re-assemble it with `mfgguf assemble` to extend it")
        if v("mfgguf.merge") is not None:
            raise MfggufError(f"{path}'s trunk is merged from its experts' trunk copies; extend needs a file assembled"
                              " with `--merge none` (or from FFN-only experts)")
        n = int(v(f"{arch}.expert_count"))
        s = cls(path, h, arch, n, int(v(f"{arch}.block_count")), int(v(f"{arch}.embedding_length")),
                int(v("mfgguf.expert_ff")), router, int(v(f"{arch}.expert_used_count")), v("mfgguf.trunk_sha256"), stats)
        want = {RS_COUNTS: n, RS_EXPERT_SOURCE: n, RS_SOURCE_COUNTS: len(v(RS_SOURCES) or [])}
        if any(len(v(k) or []) != m for k, m in want.items()) or not v(RS_SOURCES):
            raise MfggufError(f"{path}'s router statistics are inconsistent (counts for {n} experts expected);"
                              " re-assemble it")
        data_end = max(t.offset + _nbytes(t) for t in h.tensors) + h.data_offset
        if data_end > h.size:
            raise MfggufError(f"{path} is shorter than its header says; it is truncated: re-assemble it")
        if stats.offset != block_start(data_end) or stats.end != h.size:
            raise MfggufError(f"{path} does not end with its router statistics (truncated, or rewritten by a tool"
                              " that drops them); re-assemble it with `mfgguf assemble` to extend it")
        return s

    def kept(self, remove: list[int]) -> list[int]:
        """Slots (0-based) that stay, in order; `remove` holds 1-based slots."""
        for k in remove:
            if not 1 <= k <= self.n:
                raise MfggufError(f"--remove {k} is out of range; {self.path.name} has experts 1..{self.n}")
        if len(set(remove)) != len(remove):
            raise MfggufError(f"--remove lists slot {next(k for k in remove if remove.count(k) > 1)} twice; list each once")
        return [p for p in range(self.n) if p + 1 not in remove]


def _nbytes(t) -> int:
    q = QTYPE_BY_ID[t.ggml_type]
    rows = int(np.prod(t.shape[:-1])) if len(t.shape) > 1 else 1
    return rows * q.row_bytes(t.shape[-1])


# ---- the experts to add --------------------------------------------------------------------------


@dataclass
class _Additions:
    run: RunDir
    mods: list[Module]
    source: str  # sha256 of the RUN's pooled statistics ("" for centroid: no G needed)
    source_count: int
    pooled: Module | None  # to stream: the RUN's G, when the file does not hold this source yet


def _additions(run: Path, ids: list[int] | None, src: _Source) -> _Additions:
    rd = RunDir(run)
    info = rd.info()
    rd.check_no_pending_sync()
    manifest = read_manifest(rd)
    tok, _ = run_tokenizer_kv(rd)
    tok = dict((k, v) for k, _, v in tok)
    for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        if k in tok and tok[k][1] != src.h.value(k):
            raise MfggufError(f"{run}'s tokenizer is not the one {src.path.name} was built with; extend takes experts"
                              " of RUNs that share the model's tokenizer and trunk")
    ids = list(range(1, int(info["n_experts"]) + 1)) if ids is None else list(ids)
    if len(set(ids)) != len(ids):
        raise MfggufError(f"expert {next(i for i in ids if ids.count(i) > 1)} is listed twice in --experts; list each once")
    have = set(src.h.value("mfgguf.module_sha256") or [])
    mods = []
    for i in ids:
        rd.check_expert_index(i)
        m = load_module(rd, i, manifest)
        name = f"{m.name} of {run}"
        if m.meta.get("trunk_sha256") != src.trunk_sha:
            raise MfggufError(f"{name} was trained against another trunk ({str(m.meta.get('trunk_sha256'))[:12]}), not"
                              f" the one {src.path.name} was assembled from ({src.trunk_sha[:12]}); extend takes only"
                              " experts of the model's trunk")
        if not finished_against(m.meta, src.trunk_sha):
            raise MfggufError(f"{name} has trained round {m.meta.get('round')} of {m.meta.get('rounds')}; finish it first")
        if m.meta["sha256"] in have:
            raise MfggufError(f"{name} is already in {src.path.name}")
        if m.meta.get("shared_tensors") or any(k.startswith("shared.") for k in m.entries):
            raise MfggufError(f"{name} trained copies of trunk tensors, which cannot join a finished file; extend takes"
                              " FFN-only experts")
        if m.meta.get("complement"):
            raise MfggufError(f"{name} complements the seed (--complement); extend takes plain experts: assemble"
                              " complementing experts from their RUN")
        if not m.meta.get("router_stats_count"):
            raise MfggufError(f"{name} recorded no router statistics; retrain it")
        _check_expert(m, name, src)
        mods.append(m)
    if src.router != "ridge":
        return _Additions(rd, mods, "", 0, None)
    if not rd.router_stats_meta.is_file() or not rd.router_stats.is_file():
        raise PooledStatsNeeded(f"{run} has no pooled router statistics; compute them with `mfgguf router-stats {run}`",
                                "are missing")
    meta = json.loads(rd.router_stats_meta.read_text())
    if (manifest.get("router_stats") or {}).get("blake3") != meta.get("blake3") or not meta.get("blake3"):
        raise MfggufError(f"{run}'s pooled router statistics differ from its manifest's; run `mfgguf router-stats {run}`")
    if why := router_stats_stale(meta, src.trunk_sha, {m.name: m.meta["sha256"] for m in mods}):
        raise PooledStatsNeeded(f"{run}'s pooled router statistics {why}; run `mfgguf router-stats {run}`", why)
    count = int(meta.get("router_stats_count") or 0)
    if count <= 0:
        raise MfggufError(f"{run}'s pooled router statistics record no token count; run `mfgguf router-stats {run}`")
    pooled = None
    if meta["sha256"] not in (src.h.value(RS_SOURCES) or []):
        st = rd.router_stats.stat()
        if st.st_size != meta.get("bytes"):
            raise MfggufError(f"{rd.router_stats.name} of {run} is modified or truncated; run `mfgguf router-stats {run}`")
        hl, entries = read_header(rd.router_stats, "the pooled router statistics")
        for l in range(src.L):
            e = entries.get(f"router_stats.blk.{l}.second_moment")
            if e is None or e.shape != (src.D, src.D):
                raise MfggufError(f"{run}'s pooled router statistics do not match the model's shape; run"
                                  f" `mfgguf router-stats {run}`")
        pooled = Module(-1, "router_stats", rd.router_stats, meta, entries, hl, st.st_size, st.st_mtime_ns)
    return _Additions(rd, mods, meta["sha256"], count, pooled)


def _check_expert(m: Module, name: str, src: _Source) -> None:
    want = {}
    for l in range(src.L):
        want.update({blk(l, "ffn_gate"): (src.ff, src.D), blk(l, "ffn_up"): (src.ff, src.D),
                     blk(l, "ffn_down"): (src.D, src.ff), f"router_stats.blk.{l}.mean": (src.D,)})
    for k, shape in want.items():
        e = m.entries.get(k)
        if e is None or e.shape != shape:
            raise MfggufError(f"{name} does not fit {src.path.name}: tensor {k} is"
                              f" {list(e.shape) if e else 'missing'}, expected {list(shape)}")


# ---- the new file --------------------------------------------------------------------------------


@dataclass
class _Plan:
    src: _Source
    slot_of: list[int | None]  # new slot -> old slot, or None for an added expert
    new: list[Module]  # added experts, in slot order after the kept ones
    sources: list[int | None]  # new source -> old source, or None for the added RUN's
    adds: _Additions | None
    kv: list
    slots: list[Slot]
    arch: str
    header: bytes = b""  # layout.header_bytes
    data_offset: int = 0
    total_size: int = 0
    stats: StatsBlock | None = None  # the new file's statistics block
    old: dict[str, object] = field(default_factory=dict)  # old tensor infos by name


def _plan(src: _Source, keep: list[int], adds: _Additions | None, keep_routing: bool = False) -> _Plan:
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
    counts = [v(RS_COUNTS)[p] for p in keep] + [int(m.meta["router_stats_count"]) for m in new]
    src_shas = [v(RS_SOURCES)[j] if j is not None else adds.source for j in sources]
    src_counts = [v(RS_SOURCE_COUNTS)[j] if j is not None else adds.source_count for j in sources]
    repl = {
        f"{src.arch}.expert_count": N,
        "mfgguf.modules": ("STRING", [names[0]] + [names[1 + p] for p in keep] + [m.name for m in new]),
        "mfgguf.module_sha256": ("STRING", [shas[0]] + [shas[1 + p] for p in keep] + [m.meta["sha256"] for m in new]),
        "mfgguf.experts": ("UINT32", [ids[p] for p in keep] + [m.index for m in new]),
        RS_COUNTS: ("UINT64", counts),
        RS_EXPERT_SOURCE: ("UINT32", expert_source),
        RS_SOURCES: ("STRING", src_shas),
        RS_SOURCE_COUNTS: ("UINT64", src_counts),
        "mfgguf.router_stats_sha256": src_shas[0],
    }
    part = v("mfgguf.partition", "")
    if v("general.name") == f"mfgguf {part} {src.n}x".strip():
        repl["general.name"] = f"mfgguf {part} {N}x".strip()
    # recomputed rows are the closed form again: a calibration's or a tuning's record would describe rows that are gone
    drop = () if keep_routing else ROUTING_RECORDS
    kv = [(k, t, repl[k] if k in repl else val) for k, t, val in src.h.kv if k not in drop]
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
    p = _Plan(src, [*keep, *[None] * len(new)], new, sources, adds, kv, slots, src.arch)
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


def _write(p: _Plan, fin: int, fd: int, threads: int, keep_routing: bool = False) -> None:
    src, N = p.src, len(p.slot_of)
    write_header(fd, p.header, p.data_offset)
    _preallocate(fd, p.total_size)
    written = {s.name: 0 for s in p.slots}
    for s in p.slots:  # the trunk and the kept experts: their bytes as they are
        t = p.old[s.name]
        base = src.h.data_offset + t.offset
        if s.n_expert:
            eb = s.nbytes // N
            for q, old in enumerate(p.slot_of):
                if old is not None:
                    _copy(fin, fd, eb, base + old * eb, p.data_offset + s.offset + q * eb)
                    written[s.name] += eb
        elif not s.name.endswith("ffn_gate_inp.weight"):
            _copy(fin, fd, s.nbytes, base, p.data_offset + s.offset)
            written[s.name] += s.nbytes
    # the added experts (and their RUN's G, when it is a new source: hashed here, read a layer at a time below)
    first = len(p.slot_of) - len(p.new)
    new_source = p.adds is not None and p.adds.pooled is not None
    mods = ([p.adds.pooled] if new_source else []) + p.new
    mu_new = np.zeros((len(p.new), src.L, src.D), np.float32)
    off = 1 if new_source else 0
    for pos, name, r0, x, release in stream_modules(mods, lanes=2):
        try:
            if (st := STAT_RE.fullmatch(name)) is not None:
                if pos >= off and st.group(2) == "mean":
                    mu_new[pos - off, int(st.group(1))] = x.reshape(-1)
                continue
            if pos < off or (m := FFN_RE.fullmatch(name)) is None:
                continue
            s = _slot(p, blk(int(m.group(1)), f"ffn_{m.group(2)}_exps"))
            at = s.offset + (first + pos - off) * (s.nbytes // N) + r0 * s.row_bytes
            q = Q.quantize(x, s.qtype, threads=threads)
            pwrite_all(fd, q, p.data_offset + at)
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


def _kv(p: _Plan, key: str):
    return next(v[1] for k, _, v in p.kv if k == key)


def _slot(p: _Plan, name: str) -> Slot:
    return next(s for s in p.slots if s.name == name)


def _preallocate(fd: int, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise MfggufError(f"not enough disk space for the output: it needs {size / 1e9:.2f} GB;"
                              " free some space or write it elsewhere with -o") from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)


def _copy(fin: int, fout: int, n: int, src_off: int, dst_off: int) -> None:
    """n bytes from fin at src_off to fout at dst_off, in the kernel where it can (copy_file_range)."""
    while n > 0:
        try:
            k = os.copy_file_range(fin, fout, min(n, COPY_BYTES), src_off, dst_off)
        except OSError:
            k = 0
        if k <= 0:  # another filesystem or no kernel support: a plain read and write
            b = os.pread(fin, min(n, COPY_BYTES), src_off)
            if not b:
                raise MfggufError("the model file ended early while copying; it is truncated")
            k = os.pwrite(fout, b, dst_off)
        n, src_off, dst_off = n - k, src_off + k, dst_off + k
