"""Which experts answered, two ways: llama.cpp's graph (`mfgguf route`) against the PyTorch reference, on real text.

For an assembled file and the RUN it came from, the test split's text of each domain (its first --tokens tokens, in
windows of the model's context at most) is routed by llama.cpp (runtime/route.py reads the router's top-k from its
graph) and by the reference forward of the same modules and router rows (mfgguf/reference.py); the share of
token-layers where both chose the same experts, and the largest weight difference where they did. At f32 the two
compute the same function; a quantized file's routing moves where two experts' logits are close.

Prints JSON lines (one per domain, then the whole) and appends them to OUT/bench_route.jsonl.

    python scripts/bench/bench_route.py smol/run smol/moe-f32.gguf --tokens 2048
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def emit(out: Path, **rec) -> dict:
    print(json.dumps(rec), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "bench_route.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


def main(argv=None) -> None:
    from mfgguf.reference import reference_routes
    from mfgguf.run import RunDir
    from mfgguf.runtime.llm import read_header
    from mfgguf.runtime.route import routes

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--tokens", type=int, default=2048, help="test tokens routed a domain")
    ap.add_argument("--window", type=int, default=512, help="tokens routed at a time (at most the model's context)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench-out" / "route")
    a = ap.parse_args(argv)
    window = min(a.window, read_header(a.gguf)["context_length"])
    total, agree_all = 0, 0
    for d, toks in RunDir(a.run).test_tokens(a.tokens).items():
        agree, worst, n = 0, 0.0, 0
        for w in range(0, len(toks) - 1, window):
            ids = [int(t) for t in toks[w: w + window]]
            r = routes(a.gguf, ids=ids)
            slots, weights = reference_routes(a.run, a.gguf, ids)
            same = (np.sort(slots, -1) == np.sort(r.slots, -1)).all(-1)  # (T, L) the same set of experts
            agree, n = agree + int(same.sum()), n + same.size
            order = np.argsort(r.slots, -1)
            if same.any():
                a_w = np.take_along_axis(r.weights, order, -1)[same]
                b_w = np.take_along_axis(weights, np.argsort(slots, -1), -1)[same]
                worst = max(worst, float(np.abs(a_w - b_w).max()))
        emit(a.out, domain=d, token_layers=n, agreement=agree / n, max_weight_difference=worst, model=a.gguf.name)
        total, agree_all = total + n, agree_all + agree
    emit(a.out, domain="all", token_layers=total, agreement=agree_all / total, model=a.gguf.name)


if __name__ == "__main__":
    main()
