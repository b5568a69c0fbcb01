"""Peak RSS and wall of `mfgguf router-stats` (the router's pooled second moment) against the number of experts.

The pass holds the trunk and one expert, and adds each expert's FFN inputs over a sample of its shard to one
dim x dim moment per layer; its memory should not grow with N, as assembly's does not. This builds one
synthetic RUN (scripts/synthetic_run.py: random weights of the preset's shape, written by the real module
writer) with the largest N, gives each expert a shard of random tokens and the JSON record a real training
writes (precision, options, a loss history of the preset's schedule length), then runs the pass over the
first N experts for each N, each in a fresh process, and prints JSON lines:

  {"experts": N, "preset": ..., "dim": ..., "layers": ..., "tokens_per_expert": ..., "peak_rss_mb": ..., "wall_s": ...}

A small vocabulary keeps the trunk's head small (it is the same for every N); `--tokens` is each expert's
sample (one context window is the least the pass scores).

    python scripts/bench/bench_pool_stats.py OUT --preset 1b --experts 8,32,100 --vocab 512 --tokens 512 [--anchor-ff 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts" / "studies"), str(ROOT / "scripts")]

from bench_train import cpu_flags  # noqa: E402

POOL = """
import sys
from pathlib import Path
from mfgguf.train.experts.pooled import pool_router_stats
pool_router_stats(Path(sys.argv[1]), experts=list(range(1, int(sys.argv[2]) + 1)), tokens=int(sys.argv[3]),
                  progress=False)
"""


def build(out: Path, preset: str, n: int, vocab: int, anchor_ff: int | None) -> None:
    """The synthetic RUN with `n` experts, shards and training records (skipped where it is already there)."""
    from dataclasses import asdict

    from mfgguf.config import get_preset
    from mfgguf.run import RunDir, read_json, write_json
    from synthetic_run import build as synthetic

    rd = RunDir(out)
    if not rd.module_meta(n).is_file():
        synthetic(out, preset=preset, n_experts=n, vocab=vocab, max_chars=300_000,
                  **({"anchor_ff": anchor_ff} if anchor_ff else {}))
    p = get_preset(preset)
    per_step = p.expert.batch_size * p.model.ctx_len
    steps = p.expert.tokens // per_step
    rng = np.random.default_rng(0)
    rd.shard(1).parent.mkdir(parents=True, exist_ok=True)
    for i in range(1, n + 1):
        np.save(rd.shard(i), rng.integers(0, vocab, 8 * p.model.ctx_len, dtype=np.uint16))
        m = read_json(rd.module_meta(i), "module")
        m.update(precision="bf16", train=asdict(p.expert), steps=steps, tokens_seen=steps * per_step,
                 history=[[s, s * per_step, 3.0 + 1.0 / s] for s in range(1, steps + 1)],
                 validation_history=[[s, s * per_step, {"d": 3.0}] for s in range(0, steps + 1, 100)])
        write_json(rd.module_meta(i), m)


def measure(out: Path, n: int, tokens: int) -> dict:
    """One pass over the first n experts in a fresh process: its peak RSS (wait4) and wall."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", POOL, str(out), str(n), str(tokens)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"the pass over {n} experts failed")
    return {"peak_rss_mb": round(usage.ru_maxrss / 1024, 1), "wall_s": round(time.perf_counter() - t0, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--experts", default="8,32,100")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=512, help="tokens of each expert's shard the pass scores")
    ap.add_argument("--anchor-ff", type=int, default=None, help="a narrower anchor FFN than the preset's: a pass N"
                    " times as fast, the same moment and expert shapes (default: the preset's)")
    a = ap.parse_args()
    ns = sorted(int(x) for x in a.experts.split(","))
    build(a.out, a.preset, ns[-1], a.vocab, a.anchor_ff)
    from mfgguf.config import get_preset

    cfg = get_preset(a.preset).model
    cpu = {k: v for k, v in cpu_flags().items() if k != "flags"}
    for n in ns:
        row = {"experts": n, "preset": a.preset, "dim": cfg.dim, "layers": cfg.n_layers, "vocab": a.vocab,
               "anchor_ff": a.anchor_ff or cfg.anchor_ff, "expert_ff": cfg.expert_ff,
               "tokens_per_expert": a.tokens, **measure(a.out, n, a.tokens), "cpu": cpu}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
