"""Scoring's speed (held-out losses, the statistics passes' forward) on a RUN's trunk, by output-head variant.

Every validation score, sync and `eval` pass runs `train/engine/loop.py`'s `evaluate`. Its output head
was F.cross_entropy over f32 logits of 680 positions at a time; it is now log-sum-exp less the
target's logit over 170 positions with the head cast once per pass (`score_head`, `EVAL_HEAD_CHUNKS`). This times both, alternating, on
the same tokens of RUN's validation split, and prints JSON lines: tokens/s and the mean loss of each
(they must agree), then the ratio.

    python scripts/bench/bench_scoring.py RUN --tokens 16384 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    import numpy as np
    import torch
    import torch.nn.functional as F

    from mfgguf.config import ModelConfig
    from mfgguf.run import RunDir, read_module_meta
    from mfgguf.train.engine import loop
    from mfgguf.train.engine.weights import trunk_alone

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--tokens", type=int, default=16_384, help="validation tokens scored per timing")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rd = RunDir(args.run)
    cfg = ModelConfig.from_dict(read_module_meta(rd, 0)["config"])
    dev = torch.device("cpu")
    model, route = trunk_alone(rd.module_file(0), cfg, dev)
    tokens = np.concatenate([loop.load_tokens(f, f.stem) for f in sorted(rd.validation_dir.glob("*.npy"))])
    precision = loop.resolve_precision("auto", dev)
    from mfgguf import machine

    cpu = machine.cpu()["model"]
    print(json.dumps({"cpu": cpu, "run": str(rd.root), "tokens": args.tokens, "precision": precision}), flush=True)

    def cross_entropy_head(model, x, y, weight):  # the head before: cast per chunk, the (N, V) log-softmax written
        return F.cross_entropy(model.output(model.output_norm(x)).float(), y, reduction="sum")

    variants = {"cross_entropy, 680 rows": (cross_entropy_head, 8), "score_head, 170 rows": (loop.score_head, 2)}
    best: dict[str, tuple[float, float]] = {}
    saved = loop.score_head, loop.EVAL_HEAD_CHUNKS
    try:
        loop.evaluate(model, tokens, 4096, route, dev, precision)  # warm-up
        for _ in range(args.repeats):
            for name, (head, chunks) in variants.items():
                loop.score_head, loop.EVAL_HEAD_CHUNKS = head, chunks
                t = time.perf_counter()
                loss, n = loop.evaluate(model, tokens, args.tokens, route, dev, precision)
                tps = n / (time.perf_counter() - t)
                best[name] = (max(tps, best.get(name, (0.0, 0.0))[0]), loss)
    finally:
        loop.score_head, loop.EVAL_HEAD_CHUNKS = saved
    for name, (tps, loss) in best.items():
        print(json.dumps({"head": name, "tokens_per_s": round(tps, 1), "loss": round(loss, 6)}), flush=True)
    (old, _), (new, _) = best.values()
    print(json.dumps({"ratio": "score_head / cross_entropy", "speed": round(new / old, 3)}), flush=True)


if __name__ == "__main__":
    main()
