"""Calibrate a finished MoE GGUF's routing on training tokens, without gradient training.

What llama.cpp lets a file change, and how each knob is written (so every front-end runs it):
  top-k        `{arch}.expert_used_count` (and `mfgguf.top_k`).
  temperature  folded into the router: logits = x @ (R / t).T. granitemoe, llama and qwen3moe
               renormalise the selected softmax weights, so with top-1 the weight is 1 and the
               argmax ignores t: there temperature is searched for top-k >= 2 only. qwen2moe
               weights the selected experts by their softmax probabilities as they are
               (schema.UNNORMALISED_TOPK), so t changes top-1 too and is searched at every top-k.
  bias         per expert, b_i added to expert i's logit. llama's router has no bias and its
               input (the RMS-normed FFN input) has no constant feature, so no exact fold
               exists. Approximation: R_i += b_i * u with u = m / |m|^2, m the pooled mean FFN
               input of the layer (the experts' recorded means, weighted by their token
               counts): x . u = 1 on average. How constant it really is, the spread std(x . u)
               from the pooled second moment, is reported per layer (0 would be exact).
  weights      `{arch}.expert_weights_scale`, `_norm` and `expert_gating_func` are not read by
               llama.cpp's granitemoe or llama graphs (they hard-code softmax, renormalised top-k,
               no scale; tests/converters/routing/test_calibrate.py checks a file with them set computes
               the same logits), so they are not calibrated: writing them would change nothing.

Search: the settings that minimise perplexity, computed by llama.cpp, on a calibration sample of
the RUN's training tokens (data/train.npy: evenly spaced windows, `tokens` in all). The held-out
split (data/heldout/) is never opened. Each candidate rewrites only the router tensors and
the top-k key of one scratch copy in place; the grid is every top-k with every temperature, then
a coordinate search of the per-expert bias at the best of those (only when bias steps are given).
The settings the file had are a candidate too, so calibration never makes the sample's perplexity
worse. The written file is
scored again and its `mfgguf.calibration` key (JSON) records the settings and both perplexities.

Example:
    >>> calibrate(Path("model.gguf"), Path("RUN"), Path("calibrated.gguf"))["chosen"]
    {'top_k': 2, 'temperature': 1.0, 'bias': [0.0, 0.0, 0.0]}
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mfgguf.errors import MfggufError
from mfgguf.run import STATS_PREFIX, RunDir, atomic_path, read_json
from mfgguf.converters.ggufedit import copy_with_kv, read_f32, read_kv, set_f32, set_scalar, write_edited
from mfgguf.gguf.schema import CALIBRATION_KEY, UNNORMALISED_TOPK


@dataclass(frozen=True)
class CalibrationGrid:
    top_k: tuple[int, ...] | None = None  # None: 1 .. min(experts, 4)
    temperature: tuple[float, ...] = (0.5, 1.0, 2.0)  # router temperatures tried with top-k >= 2
    # nats added to one expert at a time; off by default: on the demo run the bias it chose lowered the
    # sample's perplexity but not the held-out one (top-2 alone: 85.67, with the bias: 85.71), at 2N more candidates
    bias: tuple[float, ...] = ()
    bias_passes: int = 1  # rounds of the coordinate search over the experts


def calibrate(model: Path, run: Path, out: Path, *, grid: CalibrationGrid = CalibrationGrid(), tokens: int = 8192,
              ctx: int | None = None, threads: int | None = None, force: bool = False, progress: bool = True) -> dict:
    """Choose top-k, router temperature and a per-expert router bias on training tokens; write them into a GGUF copy.

    MODEL is a MoE GGUF written by `mfgguf assemble` from RUN. The calibration sample is `tokens`
    tokens of RUN/data/train.npy (the trunk's training mix; the held-out split is never read),
    scored by llama.cpp in windows of --ctx (default: the model's context). Candidates rewrite
    only the router tensors and expert_used_count of a scratch copy; the best is written to OUT
    (top-k as the file's expert_used_count, temperature and bias folded into the router tensor,
    the record in `mfgguf.calibration`), so every llama.cpp front-end runs the calibrated model.
    The bias has no exact fold (llama's router has no bias): it is added along the pooled mean
    FFN-input direction, whose spread is reported. Returns the chosen settings, the calibration
    sample's perplexity before and after, and every candidate.

    Example:
        mfgguf calibrate model.gguf --run RUN -o calibrated.gguf --top-k 1,2,3 --temperature 0.5,1,2
    """
    from mfgguf.runtime.llm import check_ctx, read_header
    from mfgguf.runtime.perplexity import perplexity

    model, out, rd = Path(model), Path(out), RunDir(run)
    _check_paths(rd, out, tokens, force)
    header = read_header(model)
    ctx = check_ctx(header, ctx)
    arch, kv = header["arch"], read_kv(model)
    n_exp, L = int(kv.get(f"{arch}.expert_count") or 0), int(kv[f"{arch}.block_count"])
    if n_exp < 2:
        raise MfggufError(f"{model} has {n_exp} experts; calibration needs a Mixture-of-Experts GGUF (`mfgguf assemble` with 2+ experts)")
    ks = _top_ks(grid, n_exp)
    names = [f"blk.{l}.ffn_gate_inp.weight" for l in range(L)]
    R = read_f32(model, names)  # {name: (N, dim)}
    sample = training_sample(rd, tokens, ctx)
    u, spread = bias_directions(rd, kv, L) if grid.bias else (None, None)
    k0 = int(kv[f"{arch}.expert_used_count"])
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if progress else (lambda s: None)

    with tempfile.TemporaryDirectory(prefix=f".{out.name}.calib.", dir=out.parent if out.parent.is_dir() else None) as td:
        scratch = Path(td) / "candidate.gguf"
        copy_with_kv(model, scratch, [])
        seen: dict[tuple, float] = {}

        def score(k: int, t: float, b: np.ndarray) -> float:
            key = (k, t, tuple(np.round(b, 6)))
            if key not in seen:
                set_scalar(scratch, f"{arch}.expert_used_count", k)
                set_f32(scratch, routers(R, t, b, u))
                seen[key] = perplexity(scratch, sample, ctx=ctx, threads=threads)["nll"]
                say(f"calibrate: top-{k} temperature {t:g} bias {_fmt_bias(b)}: ppl {math.exp(seen[key]):.4f}")
            return seen[key]

        zero = np.zeros(n_exp)
        best = _search(score, grid, ks, k0, n_exp, every_k=arch in UNNORMALISED_TOPK)
        before = seen[(k0, 1.0, tuple(zero))]
        candidates = [{"top_k": k, "temperature": t, "bias": [float(x) for x in b], "ppl": math.exp(v)}
                      for (k, t, b), v in seen.items()]

    _, k, t, b = best
    chosen = {"top_k": k, "temperature": t, "bias": [float(x) for x in b]}
    record = {**chosen, "bias_direction": "pooled mean FFN input" if u is not None else None,
              "bias_spread": spread, "sample": "data/train.npy", "tokens": int(len(sample)), "ctx": ctx,
              "ppl_before": math.exp(before), "ppl_after": None, "previous": kv.get(CALIBRATION_KEY)}
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out, suffix=f".{os.getpid()}") as tmp:
        _write(model, tmp, arch, k, routers(R, t, b, u), record)
        record["ppl_after"] = math.exp(perplexity(tmp, sample, ctx=ctx, threads=threads)["nll"])
        _write(model, tmp, arch, k, routers(R, t, b, u), record)  # the same file, the measured figure recorded
        os.chmod(tmp, 0o644)
    return {"path": str(out), "model": str(model), "chosen": chosen, "ppl_before": record["ppl_before"],
            "ppl_after": record["ppl_after"], "tokens": record["tokens"], "ctx": ctx, "bias_spread": spread,
            "candidates": candidates}


def _check_paths(rd: RunDir, out: Path, tokens: int, force: bool) -> None:
    if not rd.root.is_dir():
        raise MfggufError(f"RUN directory not found: {rd.root}; pass the RUN the model was assembled from")
    if out.is_dir():
        raise MfggufError(f"{out} is a directory; give a file name such as {out / 'calibrated.gguf'}")
    if out.exists() and not force:
        raise MfggufError(f"{out} already exists; pass --force to overwrite it")
    if tokens < 1:
        raise MfggufError(f"--tokens {tokens} is too small; pass a positive number of calibration tokens")


def _search(score: Callable[[int, float, np.ndarray], float], grid: CalibrationGrid, ks: tuple[int, ...], k0: int,
            n_exp: int, every_k: bool = False) -> tuple[float, int, float, np.ndarray]:
    """(nll, top-k, temperature, bias) of the best candidate: the file's own top-k first, then each top-k with
    each temperature (top-1 only at t = 1 unless `every_k`: a graph that renormalises makes t idle there), then
    each expert's bias, step by step, for `grid.bias_passes` passes."""
    zero = np.zeros(n_exp)
    best = (score(k0, 1.0, zero), k0, 1.0, zero)
    for k in ks:
        for t in ((1.0,) if k == 1 and not every_k else grid.temperature):
            nll = score(k, float(t), zero)
            if nll < best[0]:
                best = (nll, k, float(t), zero)
    for _ in range(grid.bias_passes if grid.bias else 0):
        for i in range(n_exp):
            for step in grid.bias:
                b = best[3].copy()
                b[i] += step
                nll = score(best[1], best[2], b)
                if nll < best[0]:
                    best = (nll, best[1], best[2], b)
    return best


def _write(model: Path, dst: Path, arch: str, k: int, rows: dict[str, np.ndarray], record: dict) -> None:
    write_edited(model, dst, [(f"{arch}.expert_used_count", "UINT32", k), ("mfgguf.top_k", "UINT32", k),
                              (CALIBRATION_KEY, "STRING", json.dumps(record, sort_keys=True))], rows, "the calibrated file")
    if int(read_kv(dst)[f"{arch}.expert_used_count"]) != k:
        raise MfggufError(f"the calibrated file {dst} did not read back as written; check the disk and retry")


def routers(R: dict[str, np.ndarray], t: float, b: np.ndarray, u: np.ndarray | None) -> dict[str, np.ndarray]:
    """Router rows with temperature t and bias b folded in: R / t + b u^T per layer, (N, dim) f32."""
    out = {}
    for l, (name, r) in enumerate(R.items()):
        x = r.astype(np.float64) / t  # (N, dim)
        if u is not None and np.any(b):
            x = x + b[:, None] * u[l][None, :]  # (N, dim): x . u ~ 1, so logit_i ~ logit_i + b_i
        out[name] = x.astype(np.float32)
    return out


def training_sample(rd: RunDir, n: int, ctx: int) -> np.ndarray:
    """`n` tokens (whole windows of ctx, at least one) of RUN/data/train.npy, evenly spaced over it.

    The only data file calibration opens: the held-out split stays unseen.
    """
    path = rd.train_tokens
    if not path.is_file():
        raise MfggufError(f"{path} is missing: calibration samples the RUN's training tokens; re-create the run with `mfgguf prepare`")
    return window_sample(path, n, ctx)


def window_sample(path: Path, n: int, ctx: int) -> np.ndarray:
    """`n` tokens (whole windows of ctx, at least one) of the token file `path`, evenly spaced over it."""
    t = np.load(path, mmap_mode="r", allow_pickle=False)  # (T,) uint16/uint32
    w = max(1, n // ctx)
    if len(t) < ctx:
        raise MfggufError(f"{path} has {len(t)} tokens, fewer than one window of --ctx {ctx}; pass a smaller --ctx")
    w = min(w, len(t) // ctx)
    starts = np.linspace(0, len(t) - ctx, w).astype(np.int64)  # (w,)
    return np.concatenate([np.asarray(t[s:s + ctx], np.int64) for s in starts])  # (w * ctx,)


def bias_directions(rd: RunDir, kv: dict, L: int) -> tuple[np.ndarray, list[float] | None]:
    """(u (L, dim), spread per layer): u = m / |m|^2 for the pooled mean FFN input m of each layer.

    m is the token-weighted mean of the experts' recorded means (their own training shards), the
    experts named by the file's `mfgguf.experts`, checked to be the very modules it was built from.
    spread = std(x . u) = sqrt(u^T G u - 1) with G the pooled second moment, where recorded.
    """
    from safetensors import safe_open

    ids, shas = kv.get("mfgguf.experts"), kv.get("mfgguf.module_sha256")
    if not ids or not shas or len(shas) != len(ids) + 1:
        raise MfggufError("the model does not name the experts it was assembled from (mfgguf.experts); pass --bias none")
    m, n = None, 0.0
    for i, sha in zip(ids, shas[1:]):
        meta = read_json(rd.module_meta(int(i)), f"metadata of expert {i}")
        if meta.get("sha256") != sha:
            raise MfggufError(f"expert {i} in {rd.root} is not the one the model was assembled from; pass the right --run or --bias none")
        c = float(meta.get("router_stats_count") or 0)
        with safe_open(str(rd.module_file(int(i))), "numpy") as f:
            mu = np.stack([f.get_tensor(f"{STATS_PREFIX}blk.{l}.mean").astype(np.float64).reshape(-1) for l in range(L)])  # (L, dim)
        m = c * mu if m is None else m + c * mu
        n += c
    if n <= 0:
        raise MfggufError("the experts recorded no router statistics; pass --bias none")
    u = bias_direction(m / n)  # (L, dim)
    spread = None
    if rd.router_stats.is_file():
        with safe_open(str(rd.router_stats), "numpy") as f:
            spread = []
            for l in range(L):
                G = f.get_tensor(f"{STATS_PREFIX}blk.{l}.second_moment").astype(np.float64)  # (dim, dim)
                spread.append(float(np.sqrt(max(u[l] @ G @ u[l] - 1.0, 0.0))))
    return u, spread


def bias_direction(m: np.ndarray) -> np.ndarray:
    """u = m / |m|^2 per layer for pooled mean FFN inputs m (L, dim): x . u is 1 at the mean, so adding b u to a
    router row adds about b nats to that expert's logit."""
    return m / np.maximum((m * m).sum(1, keepdims=True), 1e-12)  # (L, dim)


def _top_ks(grid: CalibrationGrid, n_exp: int) -> tuple[int, ...]:
    ks = grid.top_k or tuple(range(1, min(n_exp, 4) + 1))
    bad = [k for k in ks if not 1 <= k <= n_exp]
    if bad:
        raise MfggufError(f"--top-k {bad[0]} is out of range; this model has {n_exp} experts, use 1..{n_exp}")
    if any(t <= 0 for t in grid.temperature):
        raise MfggufError("--temperature values must be positive")
    return tuple(ks)


def _fmt_bias(b: np.ndarray) -> str:
    return "none" if not np.any(b) else "[" + ", ".join(f"{x:+g}" for x in b) + "]"
