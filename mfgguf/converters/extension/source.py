"""What `extend` starts from: the finished MoE GGUF (checked to carry its router statistics) and the experts
of another RUN to add (checked to be trained against the file's trunk), before anything is written.

The file's refusals (extend.py lists them) are raised here, one line each, nothing written.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from mfgguf.errors import MfggufError, retired
from mfgguf.families import layout_name
from mfgguf.run import RunDir, finished_against, read_manifest, router_stats_stale
from mfgguf.run.records import ModuleMeta
from mfgguf.gguf.fileio import truncated
from mfgguf.gguf.header import Header, read_gguf_header
from mfgguf.converters.plan.modules import PooledStatsNeeded
from mfgguf.modules.module import Module, load_module, read_header
from mfgguf.modules.tokenizer import run_tokenizer_kv
from mfgguf.converters.routing.stats import StatsBlock, block_start
from mfgguf.gguf.schema import (SHARED_EXPERT_ARCHS, RS_COUNTS, RS_EXPERT_SOURCE, RS_SOURCE_COUNTS, RS_SOURCES, blk)


# ---- the file we start from ----------------------------------------------------------------------


@dataclass
class Source:
    path: Path
    h: Header
    arch: str
    n: int  # experts in the file
    L: int
    D: int
    ff: int  # expert FFN width
    anchor_ff: int  # > 0: the layout folds the anchor into every slot, whose first anchor_ff rows are the anchor's
    router: str
    top_k: int
    trunk_sha: str
    stats: StatsBlock | None = None  # where its router statistics lie

    @classmethod
    def read(cls, path: Path) -> "Source":
        h = read_gguf_header(path)
        v = h.value
        if not v("mfgguf.version"):
            raise MfggufError(f"{path} was not written by `mfgguf assemble` (no mfgguf keys, no router statistics);"
                              " extend works on the files mfgguf assembles")
        arch, layout = v("general.architecture"), layout_name(v("mfgguf.layout") or "")  # files before: old names
        # shared-expert (granitemoe, qwen2moe): the anchor is a shared expert, a new expert a slot of its own. folded
        # (llama, qwen3moe) folds the anchor into every slot: a new slot is rebuilt with it (folded.py).
        if not (layout == "shared-expert" and arch in SHARED_EXPERT_ARCHS or layout == "folded"):
            raise MfggufError(f"{path} has the {layout} layout ({arch}); extend adds to and removes from the MoE"
                              " layouts mfgguf writes (shared-expert, folded): assemble the RUN with the experts instead")
        if v("mfgguf.complement") and v("mfgguf.seed_gate") is None:  # a seed routed without a gate: complementing experts
            raise retired(f"{path} was assembled from experts trained", "--complement",
                          "retrain them without it and assemble again")
        if v("mfgguf.complement"):
            raise MfggufError(f"{path} routes the seed as expert 0 (a seed gate); extend supports files of plain experts:"
                              " re-assemble with the new experts instead")
        router = v("mfgguf.router")
        if router not in ("ridge", "centroid"):
            raise MfggufError(f"{path}'s router is {router}: there are no router statistics to recompute it from;"
                              " re-assemble it with `--router ridge`")
        stats = StatsBlock.of_header(v, h.data_offset)
        if v(RS_COUNTS) is None or stats is None or (router == "ridge") != stats.ridge:
            raise MfggufError(f"{path} carries no router statistics (assembled before mfgguf recorded them);"
                              " re-assemble it with `mfgguf assemble` to extend it")
        if v("mfgguf.merge") is not None:
            raise MfggufError(f"{path}'s trunk is merged from its experts' trunk copies; extend needs a file assembled"
                              " with `--merge none` (or from FFN-only experts)")
        n = int(v(f"{arch}.expert_count"))
        anchor_ff = int(v("mfgguf.anchor_ff") or 0) if layout == "folded" else 0
        s = cls(path, h, arch, n, int(v(f"{arch}.block_count")), int(v(f"{arch}.embedding_length")),
                int(v("mfgguf.expert_ff")), anchor_ff, router, int(v(f"{arch}.expert_used_count")),
                v("mfgguf.trunk_sha256"), stats)
        want = {RS_COUNTS: n, RS_EXPERT_SOURCE: n, RS_SOURCE_COUNTS: len(v(RS_SOURCES) or [])}
        if any(len(v(k) or []) != m for k, m in want.items()) or not v(RS_SOURCES):
            raise MfggufError(f"{path}'s router statistics are inconsistent (counts for {n} experts expected);"
                              " re-assemble it")
        gate = next((t for t in h.tensors if t.name == blk(0, "ffn_gate_exps")), None)
        if gate is None or gate.shape[1] != s.anchor_ff + s.ff:
            raise MfggufError(f"{path}'s expert tensors are not {s.anchor_ff} anchor + {s.ff} expert rows wide, as its"
                              " mfgguf keys say; re-assemble it")
        data_end = h.tensors_end()
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


# ---- the experts to add --------------------------------------------------------------------------


@dataclass
class Additions:
    run: RunDir
    mods: list[Module]
    source: str  # sha256 of the RUN's pooled statistics ("" for centroid: no G needed)
    source_count: int
    pooled: Module | None  # to stream: the RUN's G, when the file does not hold this source yet
    trunk: Module | None = None  # to stream: the RUN's trunk, whose anchor a folded file's new slots hold


def read_additions(run: Path, ids: list[int] | None, src: Source) -> Additions:
    rd = RunDir(run)
    n = rd.run_info().n_experts
    rd.check_no_pending_sync()
    manifest = read_manifest(rd)
    tok, _ = run_tokenizer_kv(rd)
    tok = dict((k, v) for k, _, v in tok)
    for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        if k in tok and tok[k][1] != src.h.value(k):
            raise MfggufError(f"{run}'s tokenizer is not the one {src.path.name} was built with; extend takes experts"
                              " of RUNs that share the model's tokenizer and trunk")
    ids = list(range(1, n + 1)) if ids is None else list(ids)
    if len(set(ids)) != len(ids):
        raise MfggufError(f"expert {next(i for i in ids if ids.count(i) > 1)} is listed twice in --experts; list each once")
    have = set(src.h.value("mfgguf.module_sha256") or [])
    mods = []
    for i in ids:
        rd.check_expert_index(i)
        m = load_module(rd, i, manifest)
        name = f"{m.name} of {run}"
        if m.meta.trunk_sha256 != src.trunk_sha:
            raise MfggufError(f"{name} was trained against another trunk ({str(m.meta.trunk_sha256)[:12]}), not"
                              f" the one {src.path.name} was assembled from ({src.trunk_sha[:12]}); extend takes only"
                              " experts of the model's trunk")
        if not finished_against(m.meta, src.trunk_sha):
            raise MfggufError(f"{name} has trained round {m.meta.round} of {m.meta.rounds}; finish it first")
        if m.meta.sha256 in have:
            raise MfggufError(f"{name} is already in {src.path.name}")
        if m.meta.shared_tensors or any(k.startswith("shared.") for k in m.entries):
            raise MfggufError(f"{name} trained copies of trunk tensors, which cannot join a finished file; extend takes"
                              " FFN-only experts")
        if not m.meta.router_stats_count:
            raise MfggufError(f"{name} recorded no router statistics; retrain it")
        _check_expert(m, name, src)
        mods.append(m)
    trunk = _anchor_trunk(rd, manifest, src) if src.anchor_ff and mods else None
    if src.router != "ridge":
        return Additions(rd, mods, "", 0, None, trunk)
    if not rd.router_stats_meta.is_file() or not rd.router_stats.is_file():
        raise PooledStatsNeeded(f"{run} has no pooled router statistics; compute them with `mfgguf router-stats {run}`",
                                "are missing")
    meta = ModuleMeta.from_json(json.loads(rd.router_stats_meta.read_text()))
    if (manifest.get("router_stats") or {}).get("blake3") != meta.blake3 or not meta.blake3:
        raise MfggufError(f"{run}'s pooled router statistics differ from its manifest's; run `mfgguf router-stats {run}`")
    if why := router_stats_stale(meta, src.trunk_sha, {m.name: m.meta.sha256 for m in mods}):
        raise PooledStatsNeeded(f"{run}'s pooled router statistics {why}; run `mfgguf router-stats {run}`", why)
    count = int(meta.router_stats_count or 0)
    if count <= 0:
        raise MfggufError(f"{run}'s pooled router statistics record no token count; run `mfgguf router-stats {run}`")
    pooled = None
    if meta.sha256 not in (src.h.value(RS_SOURCES) or []):
        st = rd.router_stats.stat()
        if st.st_size != meta.bytes:
            raise MfggufError(f"{rd.router_stats.name} of {run} is modified or truncated; run `mfgguf router-stats {run}`")
        hl, entries = read_header(rd.router_stats, "the pooled router statistics")
        for l in range(src.L):
            e = entries.get(f"router_stats.blk.{l}.second_moment")
            if e is None or e.shape != (src.D, src.D):
                raise MfggufError(f"{run}'s pooled router statistics do not match the model's shape; run"
                                  f" `mfgguf router-stats {run}`")
        pooled = Module(-1, "router_stats", rd.router_stats, meta, entries, hl, st.st_size, st.st_mtime_ns)
    return Additions(rd, mods, meta.sha256, count, pooled, trunk)


def _anchor_trunk(rd: RunDir, manifest: dict, src: Source) -> Module:
    """The --add RUN's trunk, for the anchor a folded file's new slots hold: the very trunk the file was built from."""
    trunk = load_module(rd, 0, manifest)
    if trunk.meta.sha256 != src.trunk_sha:
        raise MfggufError(f"{rd.root}'s trunk ({str(trunk.meta.sha256)[:12]}) is not the one {src.path.name} was"
                          f" assembled from ({src.trunk_sha[:12]}), whose anchor every expert of this {src.arch} file"
                          " holds: add from a RUN that holds the model's trunk")
    return trunk


def _check_expert(m: Module, name: str, src: Source) -> None:
    want = {}
    for l in range(src.L):
        want.update({blk(l, "ffn_gate"): (src.ff, src.D), blk(l, "ffn_up"): (src.ff, src.D),
                     blk(l, "ffn_down"): (src.D, src.ff), f"router_stats.blk.{l}.mean": (src.D,)})
    for k, shape in want.items():
        e = m.entries.get(k)
        if e is None or e.shape != shape:
            raise MfggufError(f"{name} does not fit {src.path.name}: tensor {k} is"
                              f" {list(e.shape) if e else 'missing'}, expected {list(shape)}")
