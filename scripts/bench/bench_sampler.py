"""Validation loss of training on shuffled epochs (driver.get_batch) against random windows drawn with replacement
(the sampler before it), at the same tokens.

One RUN is prepared from the built-in corpus (3 label experts, vocabulary 512, as the tests' run). For each
seed a copy trains a `tiny` trunk (the preset's tokens, with the epoch sampler); then for each sampler a copy of
that run trains the three experts with --tokens given in passes over their shards, where the samplers differ: a
pass drawn with replacement leaves about e^-1 of the tokens unseen. The baseline sampler is the old get_batch,
restored in this process only. Prints one JSON line per (seed, sampler):

  {"sampler": "epochs" | "random", "seed": s, "expert_epochs": ..., "trunk_val": {domain: loss},
   "expert_val": {domain: validation loss of the expert trained on that domain}, "expert_val_mean": ...,
   "eval_tokens": ..., "train_s": seconds of the experts' training, "cpu": {...}}

    python scripts/bench/bench_sampler.py --out /tmp/sampler --seeds 0,1 --expert-epochs 1 --experts 1,2,3
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path[:0] = [str(ROOT / "scripts" / "bench")]

from bench_train import cpu_flags  # noqa: E402


def random_windows(tokens, seed: int, stream: int, step: int, batch_size: int, ctx_len: int):
    """The sampler before epochs: batch_size windows at uniform random starts, with replacement."""
    import numpy as np
    import torch

    n = len(tokens)
    rng = np.random.default_rng([seed, stream, step])
    starts = rng.integers(0, n - ctx_len - 1, size=batch_size)
    w = np.stack([np.asarray(tokens[s: s + ctx_len + 1], dtype=np.int64) for s in starts])  # (B, T+1)
    w = torch.from_numpy(w)
    return w[:, :-1], w[:, 1:]  # (B, T), (B, T)


def trunk_run(prepared: Path, out: Path, seed: int, eval_tokens: int) -> tuple[Path, dict]:
    """A copy of the prepared RUN with a tiny trunk trained at `seed`."""
    from mfgguf.options import TrainOptions
    from mfgguf.train.whole.trunk import train_trunk

    from mfgguf.run import RunDir, read_module_meta

    root = out / f"trunk-s{seed}"
    if RunDir(root).module_meta(0).is_file():  # kept from an earlier invocation
        return root, read_module_meta(RunDir(root), 0)
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(prepared, root)
    return root, train_trunk(root, preset="tiny", progress=False, options=TrainOptions(seed=seed, eval_tokens=eval_tokens))


def experts(trunk: Path, out: Path, sampler: str, seed: int, epochs: float, eval_tokens: int, ids: list[int]) -> dict:
    """Experts `ids` of a copy of `trunk`, each trained `epochs` passes over its shard with `sampler` (one an
    earlier invocation finished is read back)."""
    import numpy as np

    from mfgguf.options import TrainOptions
    from mfgguf.run import RunDir, read_module_meta
    from mfgguf.train.engine import driver
    from mfgguf.train.experts.expert import train_expert

    root = out / f"{sampler}-s{seed}"
    if not root.exists():
        shutil.copytree(trunk, root, ignore=shutil.ignore_patterns("checkpoints"))
    rd = RunDir(root)
    driver.get_batch = random_windows if sampler == "random" else kept  # train_steps reads the module's name
    t0, val = time.perf_counter(), {}
    for i, shard in enumerate(rd.info()["shards"], start=1):
        if i not in ids:
            continue
        n = len(np.load(rd.shard(i), mmap_mode="r"))
        tokens = int(epochs * n)
        m = read_module_meta(rd, i) if rd.module_meta(i).is_file() else {}
        if (m.get("train") or {}).get("tokens") != tokens or m["train"].get("seed") != seed:
            m = train_expert(root, i, progress=False, options=TrainOptions(  # resumes a killed one
                tokens=tokens, seed=seed, eval_tokens=eval_tokens))
        for d in shard["domains"]:
            val[d] = m["validation_loss"][d]
    driver.get_batch = kept
    return {"sampler": sampler, "seed": seed, "expert_epochs": epochs, "expert_val": val,
            "expert_val_mean": sum(val.values()) / len(val), "eval_tokens": eval_tokens,
            "train_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--expert-epochs", type=float, default=1.0)
    ap.add_argument("--experts", default="1,2,3", help="which experts (domains) to train")
    ap.add_argument("--eval-tokens", type=int, default=32768, help="validation tokens scored per domain")
    a = ap.parse_args()
    from mfgguf.data.prepare import prepare

    prepared = a.out / "prepared"
    if not (prepared / "run.json").is_file():
        shutil.rmtree(prepared, ignore_errors=True)
        prepare(["builtin"], prepared, n_experts=3, partition="label", vocab_size=512, max_chars_per_domain=400_000,
                seed=0)
    cpu = {k: v for k, v in cpu_flags().items() if k != "flags"}
    for seed in map(int, a.seeds.split(",")):
        trunk, meta = trunk_run(prepared, a.out, seed, a.eval_tokens)
        for sampler in ("random", "epochs"):
            row = experts(trunk, a.out, sampler, seed, a.expert_epochs, a.eval_tokens,
                          [int(i) for i in a.experts.split(",")])
            print(json.dumps({**row, "trunk_val": meta["validation_loss"], "cpu": cpu}), flush=True)


if __name__ == "__main__":
    from mfgguf.train.engine.driver import get_batch as kept

    main()
