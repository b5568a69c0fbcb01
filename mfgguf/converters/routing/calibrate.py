"""Calibrate a finished MoE GGUF's routing on training tokens, without gradient training.

What llama.cpp lets a file change, and how each knob is written (so every front-end runs it):
  top-k        `{arch}.expert_used_count` (and `mfgguf.top_k`).
  temperature  folded into the router: logits = x @ (R / t).T. granitemoe, llama and qwen3moe
               renormalise the selected softmax weights, so with top-1 the weight is 1 and the
               argmax ignores t: there temperature is searched for top-k >= 2 only. qwen2moe
               weights the selected experts by their softmax probabilities as they are
               (schema.UNNORMALISED_TOPK), so t changes top-1 too and is searched at every top-k.
  weights      `{arch}.expert_weights_scale`, `_norm` and `expert_gating_func` are not read by
               llama.cpp's granitemoe or llama graphs (they hard-code softmax, renormalised top-k,
               no scale; tests/converters/routing/test_calibrate.py checks a file with them set computes
               the same logits), so they are not calibrated: writing them would change nothing.

Search: the settings that minimise perplexity, computed by llama.cpp, on a calibration sample of
the RUN's training tokens (data/train.npy: evenly spaced windows, `tokens` in all). The held-out
split (data/test/) is never opened. Each candidate rewrites only the router tensors and
the top-k key of one scratch copy in place; the grid is every top-k with every temperature.
The settings the file had are a candidate too, so calibration never makes the sample's perplexity
worse. The written file is
scored again and its `mfgguf.calibration` key (JSON) records the settings and both perplexities.

Example:
    >>> calibrate(Path("model.gguf"), Path("RUN"), Path("calibrated.gguf"))["chosen"]
    {'top_k': 2, 'temperature': 1.0}
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
from mfgguf.run import RunDir, atomic_path
from mfgguf.gguf.edit import copy_with_kv, read_f32, read_kv, set_f32, set_scalar, write_edited
from mfgguf.gguf.schema import CALIBRATION_KEY, UNNORMALISED_TOPK


@dataclass(frozen=True)
class CalibrationGrid:
    top_k: tuple[int, ...] | None = None  # None: 1 .. min(experts, 4)
    temperature: tuple[float, ...] = (0.5, 1.0, 2.0)  # router temperatures tried with top-k >= 2


def calibrate(model: Path, run: Path, out: Path, *, grid: CalibrationGrid = CalibrationGrid(), tokens: int = 8192,
              ctx: int | None = None, threads: int | None = None, force: bool = False, progress: bool = True) -> dict:
    """Choose top-k and router temperature on training tokens; write them into a GGUF copy.

    MODEL is a MoE GGUF written by `mfgguf assemble` from RUN. The calibration sample is `tokens`
    tokens of RUN/data/train.npy (the trunk's training mix; the held-out split is never read),
    scored by llama.cpp in windows of --ctx (default: the model's context). Candidates rewrite
    only the router tensors and expert_used_count of a scratch copy; the best is written to OUT
    (top-k as the file's expert_used_count, temperature folded into the router tensor,
    the record in `mfgguf.calibration`), so every llama.cpp front-end runs the calibrated model.
    Returns the chosen settings, the calibration
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
    k0 = int(kv[f"{arch}.expert_used_count"])
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if progress else (lambda s: None)

    with tempfile.TemporaryDirectory(prefix=f".{out.name}.calib.", dir=out.parent if out.parent.is_dir() else None) as td:
        scratch = Path(td) / "candidate.gguf"
        copy_with_kv(model, scratch, [])
        seen: dict[tuple, float] = {}

        def score(k: int, t: float) -> float:
            if (k, t) not in seen:
                set_scalar(scratch, f"{arch}.expert_used_count", k)
                set_f32(scratch, routers(R, t))
                seen[(k, t)] = perplexity(scratch, sample, ctx=ctx, threads=threads)["nll"]
                say(f"calibrate: top-{k} temperature {t:g}: ppl {math.exp(seen[(k, t)]):.4f}")
            return seen[(k, t)]

        best = _search(score, grid, ks, k0, every_k=arch in UNNORMALISED_TOPK)
        before = seen[(k0, 1.0)]
        candidates = [{"top_k": k, "temperature": t, "ppl": math.exp(v)} for (k, t), v in seen.items()]

    _, k, t = best
    chosen = {"top_k": k, "temperature": t}
    record = {**chosen, "sample": "data/train.npy", "tokens": int(len(sample)), "ctx": ctx,
              "ppl_before": math.exp(before), "ppl_after": None, "previous": kv.get(CALIBRATION_KEY)}
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out, suffix=f".{os.getpid()}") as tmp:
        _write(model, tmp, arch, k, routers(R, t), record)
        record["ppl_after"] = math.exp(perplexity(tmp, sample, ctx=ctx, threads=threads)["nll"])
        _write(model, tmp, arch, k, routers(R, t), record)  # the same file, the measured figure recorded
        os.chmod(tmp, 0o644)
    return {"path": str(out), "model": str(model), "chosen": chosen, "ppl_before": record["ppl_before"],
            "ppl_after": record["ppl_after"], "tokens": record["tokens"], "ctx": ctx, "candidates": candidates}


def _check_paths(rd: RunDir, out: Path, tokens: int, force: bool) -> None:
    if not rd.root.is_dir():
        raise MfggufError(f"RUN directory not found: {rd.root}; pass the RUN the model was assembled from")
    if out.is_dir():
        raise MfggufError(f"{out} is a directory; give a file name such as {out / 'calibrated.gguf'}")
    if out.exists() and not force:
        raise MfggufError(f"{out} already exists; pass --force to overwrite it")
    if tokens < 1:
        raise MfggufError(f"--tokens {tokens} is too small; pass a positive number of calibration tokens")


def _search(score: Callable[[int, float], float], grid: CalibrationGrid, ks: tuple[int, ...], k0: int,
            every_k: bool = False) -> tuple[float, int, float]:
    """(nll, top-k, temperature) of the best candidate: the file's own top-k first, then each top-k with
    each temperature (top-1 only at t = 1 unless `every_k`: a graph that renormalises makes t idle there)."""
    best = (score(k0, 1.0), k0, 1.0)
    for k in ks:
        for t in ((1.0,) if k == 1 and not every_k else grid.temperature):
            nll = score(k, float(t))
            if nll < best[0]:
                best = (nll, k, float(t))
    return best


def _write(model: Path, dst: Path, arch: str, k: int, rows: dict[str, np.ndarray], record: dict) -> None:
    write_edited(model, dst, [(f"{arch}.expert_used_count", "UINT32", k), ("mfgguf.top_k", "UINT32", k),
                              (CALIBRATION_KEY, "STRING", json.dumps(record, sort_keys=True))], rows, "the calibrated file")
    if int(read_kv(dst)[f"{arch}.expert_used_count"]) != k:
        raise MfggufError(f"the calibrated file {dst} did not read back as written; check the disk and retry")


def routers(R: dict[str, np.ndarray], t: float) -> dict[str, np.ndarray]:
    """Router rows with temperature t folded in: R / t per layer, (N, dim) f32."""
    return {name: (r.astype(np.float64) / t).astype(np.float32) for name, r in R.items()}


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


def bias_direction(m: np.ndarray) -> np.ndarray:
    """u = m / |m|^2 per layer for pooled mean FFN inputs m (L, dim): x . u is 1 at the mean, so adding b u to a
    router row adds about b nats to that expert's logit (guard.py's gate)."""
    return m / np.maximum((m * m).sum(1, keepdims=True), 1e-12)  # (L, dim)


def _top_ks(grid: CalibrationGrid, n_exp: int) -> tuple[int, ...]:
    ks = grid.top_k or tuple(range(1, min(n_exp, 4) + 1))
    bad = [k for k in ks if not 1 <= k <= n_exp]
    if bad:
        raise MfggufError(f"--top-k {bad[0]} is out of range; this model has {n_exp} experts, use 1..{n_exp}")
    if any(t <= 0 for t in grid.temperature):
        raise MfggufError("--temperature values must be positive")
    return tuple(ks)
