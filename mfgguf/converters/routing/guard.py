"""Keep the old domains where they were when `extend` adds an expert: a bias on the new rows, searched.

`extend --keep-routing` leaves the old experts' router rows exactly as they were, so tokens rank the
old experts as before; what still moves an old domain is the added expert taking some of its tokens.
On SmolLM2 with 768-unit experts that still moved old domains' perplexity by around a percent
(docs/assembly.md). The guard lowers the added experts' logits by b nats and takes the first b of
a ladder (0, -0.25, -0.5, ...) under which every old expert's own training shard moves by at most
`max_move` of perplexity against the file before the change, scored by llama.cpp on an evenly
spaced sample; two halvings of the gap to the step before then look for a milder b that still holds.

llama's router has no bias, so b is folded into the row along a direction u with x . u as near 1
for every token as the statistics the file carries allow (u ∝ G^-1 m, m the pooled mean FFN input,
G the pooled second moment; `calibrate`'s m / |m|^2 where the file has no G): on the tiny test
trunk that made the ladder monotone where m / |m|^2 was not. Far down the ladder the new experts
are all but never chosen and the old function comes back; the new domain's sample is scored beside
the old ones, so the price is stated.

The samples are training tokens (each expert's shard in its RUN, the old experts checked to be the
very modules the file was built from); the held-out split is never opened. Removing the added
experts later still gives back the original file: only their rows move.

Example:
    >>> guard_new_rows(Path("model.gguf"), Path("model5.gguf"), RunDir("RUN"), new_slots=[4])["bias"]
    -3.0
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mfgguf.errors import MfggufError
from mfgguf.run import RunDir, module_name, module_record
from mfgguf.converters.routing.calibrate import bias_direction, window_sample
from mfgguf.gguf.edit import read_f32, read_kv, set_f32
from mfgguf.gguf.header import read_gguf_header
from mfgguf.converters.routing.stats import StatsBlock, read_f32 as read_block
from mfgguf.gguf.schema import RS_COUNTS, RS_SOURCE_COUNTS

RIDGE = 1e-4  # of the mean diagonal of G: keeps the solve well posed where G is near singular


@dataclass(frozen=True)
class Guard:
    max_move: float = 0.005  # largest relative move of any old expert's shard perplexity (0.005: half a percent)
    # nats added to the new experts' logits, tried in order; at -8 they are all but never routed to
    steps: tuple[float, ...] = (0.0, -0.25, -0.5, -1.0, -2.0, -4.0, -8.0)
    refine: int = 2  # halvings of the gap between the last step over the limit and the first within it
    tokens: int = 4096  # sample per expert: evenly spaced windows of its training shard
    run: Path | None = None  # the RUN holding the old experts' shards; None: the RUN the experts are added from


def guard_new_rows(before: Path, after: Path, rd: RunDir, *, new_slots: list[int], guard: Guard = Guard(),
                   threads: int | None = None, progress: bool = True) -> dict:
    """Bias the router rows of `after`'s slots `new_slots` (0-based) in place, the first step of the ladder
    under which every old expert's shard sample moves by at most guard.max_move against `before`. The new
    experts' shards are read from `rd` (the RUN they were added from), the old ones' from guard.run or `rd`.

    Returns {"bias", "met", "max_move", "moves" {expert: relative move}, "new" {expert: relative move},
    "tokens", "candidates"}; every figure a relative change of perplexity against `before`.
    """
    from mfgguf.runtime.perplexity import WINDOW, perplexity_by_domain

    kv_a = read_kv(after)
    arch = kv_a["general.architecture"]
    L, N = int(kv_a[f"{arch}.block_count"]), int(kv_a[f"{arch}.expert_count"])
    ids_a, shas_a = list(kv_a["mfgguf.experts"]), list(kv_a["mfgguf.module_sha256"])[1:]
    old = [q for q in range(N) if q not in new_slots]
    ctx = min(WINDOW, int(kv_a[f"{arch}.context_length"]))  # `mfgguf perplexity`'s window
    old_rd = RunDir(guard.run) if guard.run is not None else rd
    samples = {q: _shard_sample(rd if q in new_slots else old_rd, int(ids_a[q]), shas_a[q], guard.tokens, ctx)
               for q in range(N)}
    names = {q: module_name(int(ids_a[q])) for q in range(N)}
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if progress else (lambda s: None)

    def nll(path: Path, slots: list[int]) -> dict[int, float]:
        r = perplexity_by_domain(path, {q: samples[q] for q in slots}, ctx=ctx, threads=threads)["domains"]
        return {q: r[q]["nll"] for q in slots}

    ref = nll(before, old)  # the old experts' samples as the file was
    router = [f"blk.{l}.ffn_gate_inp.weight" for l in range(L)]
    R = read_f32(after, router)  # {name: (N, dim)}
    u = _flat_direction(after, kv_a, L)  # (L, dim)
    new_ref: dict[int, float] = {}
    candidates: list[dict] = []

    def score(b: float) -> dict:
        set_f32(after, _biased(R, new_slots, b, u))
        got = nll(after, list(range(N)))
        if not new_ref:  # the first candidate is the unbiased file
            new_ref.update({q: got[q] for q in new_slots})
        moves = {names[q]: math.expm1(got[q] - ref[q]) for q in old}
        c = {"bias": b, "max_move": max(moves.values()), "moves": moves,
             "new": {names[q]: math.expm1(got[q] - new_ref[q]) for q in new_slots}}
        candidates.append(c)
        say(f"extend --guard: new rows {b:+g} nats: old experts moved at most {100 * c['max_move']:+.2f}%,"
            f" the new ones' own samples {', '.join(f'{100 * v:+.2f}%' for v in c['new'].values())}")
        return c

    over, best = None, None  # the last candidate over the limit; the first within it (else the least over)
    for b in guard.steps:
        c = score(b)
        if c["max_move"] <= guard.max_move:
            best = c
            break
        over = c
        best = c if best is None or c["max_move"] < best["max_move"] else best
    if best["max_move"] <= guard.max_move and over is not None:
        for _ in range(guard.refine):  # the bias between them nearest zero that still holds the limit
            c = score((over["bias"] + best["bias"]) / 2)
            over, best = (over, c) if c["max_move"] <= guard.max_move else (c, best)
    rows = _biased(R, new_slots, best["bias"], u)
    set_f32(after, rows)
    if any(not np.array_equal(a, rows[n]) for n, a in read_f32(after, router).items()):
        raise MfggufError(f"{after} did not read back as written; check the disk and retry")
    return {**best, "met": best["max_move"] <= guard.max_move, "limit": guard.max_move, "tokens": guard.tokens,
            "ctx": ctx, "candidates": candidates}


def _biased(R: dict[str, np.ndarray], slots: list[int], b: float, u: np.ndarray) -> dict[str, np.ndarray]:
    out = {}
    for l, (name, r) in enumerate(R.items()):
        x = r.copy()  # (N, dim)
        x[slots] += np.float32(b) * u[l].astype(np.float32)[None, :]  # x . u ~ 1: logit ~ logit + b
        out[name] = x
    return out


def _flat_direction(path: Path, kv: dict, L: int) -> np.ndarray:
    """(L, dim) u with m . u = 1 and x . u as nearly constant over tokens as the file's statistics say: u ∝ G^-1 m
    (the least-squares fit of the constant 1 from x, G the pooled second moment, lightly ridged) where the
    file carries G; else calibrate's m / |m|^2. m: the token-weighted mean of the experts' recorded means."""
    h = read_gguf_header(path)
    at = StatsBlock.of_header(h.value, h.data_offset)
    counts = np.asarray(kv[RS_COUNTS], np.float64)  # (N,)
    weights = np.asarray(kv[RS_SOURCE_COUNTS], np.float64)  # (S,)
    fd = os.open(path, os.O_RDONLY)
    try:
        m = sum(c * read_block(fd, at.mean(q), (L, at.dim)).astype(np.float64) for q, c in enumerate(counts))
        m = m / counts.sum()  # (L, dim)
        if not at.ridge:
            return bias_direction(m)
        u = np.empty_like(m)
        for l in range(L):
            G = sum(w * read_block(fd, at.second_moment(j, l), (at.dim, at.dim)).astype(np.float64)
                    for j, w in enumerate(weights)) / weights.sum()  # (dim, dim)
            g = np.linalg.solve(G + RIDGE * np.trace(G) / at.dim * np.eye(at.dim), m[l])  # (dim,)
            u[l] = g / (m[l] @ g)
        return u
    finally:
        os.close(fd)


def _shard_sample(rd: RunDir, i: int, sha: str, n: int, ctx: int) -> np.ndarray:
    m = module_record(rd, i)
    if m is None or m.sha256 != sha or not rd.shard(i).is_file():
        raise MfggufError(f"--guard scores every expert's training shard, and {module_name(i)} of the model was not"
                          f" trained in {rd.root} (or its shard data/{rd.shard(i).name} is gone); pass --guard-run, the"
                          " RUN the old experts came from")
    return window_sample(rd.shard(i), n, ctx)
