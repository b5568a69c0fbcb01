"""How fast this machine trains: a few timed in-memory steps of a model shape, for planning.

The demo sizes its token counts to a time budget with it (`mfgguf demo --minutes`): CPUs of the
same machine kind differ severalfold (native bf16 and AMX, or fp32 on AVX2 alone; docs/benchmarks.md). The step timed is
the real one (loop.InMemorySteps, eager, the precision this CPU trains in) on random weights and
random tokens; a trunk with a seed FFN trains the same graph as an expert that trains a private
copy of the whole trunk (`--shared all`), so one measurement serves both.

Run as a process of its own, it prints one JSON line:
    python -m mfgguf.train.engine.speed small --vocab-size 4096 --seed-expert
    {"preset": "small", "precision": "bf16", "tokens_per_s": 9876.5, "s_per_step": 0.415, ...}
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from mfgguf.config import get_preset
from mfgguf.model import trunk_model
from mfgguf.train.engine.driver import get_batch
from mfgguf.train.engine.loop import InMemorySteps, resolve_device, resolve_precision
from mfgguf.train.engine.records import Checkpoints, StepSetup


def measure_steps(preset: str, *, vocab_size: int, seed_expert: bool, batch_size: int | None = None,
                  steps: int = 5, precision: str = "auto") -> dict:
    """Seconds per in-memory trunk step of `preset` (eager), the median of `steps` after two warm-up steps (the
    first steps allocate and tune; a mean over three after one read half the speed a long run settles at).

    Example:
        >>> measure_steps("tiny", vocab_size=512, seed_expert=True)["tokens_per_s"] > 0
        True
    """
    p = get_preset(preset)
    cfg = replace(p.model, vocab_size=vocab_size, seed_expert=seed_expert)
    tc = replace(p.trunk, batch_size=batch_size or p.trunk.batch_size, compile="off")
    dev = resolve_device("cpu")
    prec = resolve_precision(precision, dev)
    torch.manual_seed(0)
    model, route = trunk_model(cfg)
    named = {n: q for n, q in model.named_parameters() if q.requires_grad}
    data = np.random.default_rng(0).integers(0, vocab_size, 1 << 16, dtype=np.uint16)
    with tempfile.TemporaryDirectory(prefix="mfgguf-speed-") as tmp:
        impl = InMemorySteps(model, named, tc, StepSetup(dev, prec, route), Checkpoints(Path(tmp), {}))
        impl.resume()
        model.train()
        for s in range(2):  # warm-up
            impl.step(s, *get_batch(data, 0, 0, s, tc.batch_size, cfg.ctx_len), lr=tc.lr)
        times = []
        for s in range(2, steps + 2):
            t0 = time.perf_counter()
            impl.step(s, *get_batch(data, 0, 0, s, tc.batch_size, cfg.ctx_len), lr=tc.lr)
            times.append(time.perf_counter() - t0)
        dt = float(np.median(times))
    return {"preset": preset, "precision": prec, "batch_size": tc.batch_size, "ctx_len": cfg.ctx_len,
            "s_per_step": dt, "tokens_per_s": tc.batch_size * cfg.ctx_len / dt}


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("preset")
    ap.add_argument("--vocab-size", type=int, required=True)
    ap.add_argument("--seed-expert", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    json.dump(measure_steps(a.preset, vocab_size=a.vocab_size, seed_expert=a.seed_expert, steps=a.steps), sys.stdout)
    print()
