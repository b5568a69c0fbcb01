"""The training head's speed by chunk of positions (mfgguf/head_loss.py), fp32 and (where native) bf16.

An expert's step computes its frozen head's loss and gradient a chunk of positions at a time, so the
(positions, vocabulary) logits are never whole. A chunk of LOGITS_CHUNK logits is 85 positions at SmolLM2's
49,152-token vocabulary: matmuls that short leave the fp32 kernels far from the peak. This times the
head's forward and backward (ChunkedHeadLoss: both matmuls, the softmax and its gradient) over one
micro-batch of positions for several chunk heights, as the share of the CPU's matmul peak measured in the
same run, and each chunk's speed as a ratio to the old 85-position chunk's.

Prints JSON lines: {"bench": "head_chunk", cpu...}, then per precision and chunk
{"precision", "rows", "ms", "gflops", "frac_of_peak", "vs_85"}.

    python scripts/bench/bench_head_chunk.py
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python scripts/bench/bench_head_chunk.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts" / "studies"), str(ROOT / "scripts")]


def time_head(w, positions: int, rows: int, bf16: bool, repeats: int) -> float:
    """Seconds for one forward + backward of the chunked head over `positions` positions."""
    import torch

    from mfgguf.head_loss import ChunkedHeadLoss

    g = torch.Generator().manual_seed(0)
    x = torch.randn(positions, w.shape[1], generator=g).requires_grad_(True)  # (N, C)
    y = torch.randint(0, w.shape[0], (positions,), generator=g)  # (N,)

    def once():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = ChunkedHeadLoss.apply(x, w, y, rows)
        loss.backward()

    once()
    t = time.perf_counter()
    for _ in range(repeats):
        once()
    return (time.perf_counter() - t) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--dim", type=int, default=576)
    ap.add_argument("--positions", type=int, default=512, help="one micro-batch: 2 sequences of 256")
    ap.add_argument("--rows", default="85,128,256,512")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()

    import torch
    from bench_train import cpu_flags, matmul_peak

    from mfgguf.train.engine.loop import resolve_precision

    precisions = ["fp32"] + (["bf16"] if resolve_precision("auto", torch.device("cpu")) == "bf16" else [])
    peak = {k: round(v, 1) for k, v in matmul_peak().items()}
    print(json.dumps({"bench": "head_chunk", **cpu_flags(), **peak}), flush=True)
    flops = 4 * a.positions * a.vocab * a.dim  # logits and x's gradient: two (N, C) x (C, V) products
    for prec in precisions:
        w = torch.randn(a.vocab, a.dim) * 0.02  # (V, C): the frozen head, bf16 as an expert holds it under bf16
        w = w.to(torch.bfloat16) if prec == "bf16" else w
        ref = None
        for rows in map(int, a.rows.split(",")):
            s = time_head(w, a.positions, rows, prec == "bf16", a.repeats)
            ref = ref or (s if rows == 85 else None)
            gf = flops / s / 1e9
            print(json.dumps({"precision": prec, "rows": rows, "ms": round(s * 1e3, 1), "gflops": round(gf, 1),
                              "frac_of_peak": round(gf / peak[f"{prec}_gflops"], 3),
                              "vs_85": round(ref / s, 3) if ref else None}), flush=True)


if __name__ == "__main__":
    main()
