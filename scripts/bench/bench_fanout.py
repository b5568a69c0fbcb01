"""Benchmark `train-experts`: 1 vs 2 local workers, Ray vs plain processes, and the `1b` fan-out estimate.

Prints JSON lines:
  {"bench": "fanout", "preset": "tiny"|"small", "backend": "local"|"ray", "workers": 1|2, "jobs": 4,
   "wall_s": ..., "per_job_s": ..., "peak_rss_mb_max": ..., "speedup_vs_1": ...}   same RUN, same experts
  {"bench": "ray_overhead", "preset": ..., "per_job_s": (ray wall - local 2-worker wall) / jobs}
  {"bench": "estimate_1b", "machines": 10|100, "rounds": 1|4, "shared": ..., "wall_h": ..., "bytes_moved_gb": ...}
     from the measured expert throughput (FLOP/s of a `small` expert job here) and the `1b` shapes

The estimate: each machine trains ceil(100 / machines) experts one after another (one job per
machine, all its cores); an expert job's time = its training FLOPs / the FLOP rate measured here;
with R rounds, every round waits for the slowest machine, plus a sync (the merge reads every
expert's shared copy: R x N x copy bytes). Bytes moved: per machine the trunk once per round
(cached by hash on the node) and each job's shard; back, each module (FFN + statistics) and, with
`--shared`, each expert's copy every round.

    python scripts/bench/bench_fanout.py                 # tiny and small, 4 experts each
    python scripts/bench/bench_fanout.py --presets tiny --no-ray
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SETUP = {  # preset -> (vocab, chars per domain, trunk tokens, expert tokens)
    "tiny": (512, 200_000, 10_240, 20_480),
    "small": (2048, 400_000, 65_536, 65_536),
}


def emit(**kw) -> None:
    print(json.dumps({**kw, "loadavg_1m": round(os.getloadavg()[0], 2)}), flush=True)


def prepared(preset: str, work: Path, n: int) -> Path:
    from mfgguf.data.prepare import prepare
    from mfgguf.options import TrainOptions
    from mfgguf.train.whole.trunk import train_trunk

    vocab, chars, trunk_tokens, _ = SETUP[preset]
    root = work / f"{preset}-base"
    if not (root / "modules" / "trunk.json").is_file():
        shutil.rmtree(root, ignore_errors=True)
        prepare(["builtin"], root, n_experts=n, partition="random", vocab_size=vocab, max_chars_per_domain=chars, seed=0)
        train_trunk(root, preset=preset, options=TrainOptions(tokens=trunk_tokens), progress=False)
    return root


def one(preset: str, base: Path, work: Path, **kw) -> dict:
    from mfgguf.options import JobOptions, TrainOptions
    from mfgguf.train.fanout.schedule import train_experts

    run = work / f"{preset}-{kw.get('ray') or 'local'}-{kw.get('workers')}"
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(base, run, ignore=shutil.ignore_patterns("checkpoints", "logs"))
    t0 = time.perf_counter()
    s = train_experts(run, job=JobOptions(TrainOptions(tokens=SETUP[preset][3])), progress=False, **kw)
    wall = time.perf_counter() - t0
    shutil.rmtree(run, ignore_errors=True)
    return {"wall_s": round(wall, 2), "jobs": len(s["jobs"]), "per_job_s": round(wall / max(1, len(s["jobs"])), 2),
            "job_wall_s": [j["wall_s"] for j in s["jobs"]], "peak_rss_mb_max": round(max(j["peak_rss_mb"] for j in s["jobs"]), 1),
            "backend": s["backend"]}


def measured_rate(preset: str, base: Path) -> float:
    """Training FLOP/s of one expert job of `preset` here (all cores), from its own metadata."""
    from mfgguf.flops import module_flops
    from mfgguf.options import TrainOptions
    from mfgguf.train.experts.expert import train_expert

    run = base.parent / f"{preset}-rate"
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(base, run, ignore=shutil.ignore_patterns("checkpoints", "logs"))
    meta = train_expert(run, 1, options=TrainOptions(tokens=SETUP[preset][3]), progress=False)
    rate = module_flops(meta) / meta["train_s"] if meta.get("train_s") else module_flops(meta) / meta["wall_s"]
    shutil.rmtree(run, ignore_errors=True)
    return rate


def estimate_1b(rate: float) -> None:
    from mfgguf.config import get_preset, shared_tensor_names
    from mfgguf.flops import expert_step_flops
    from mfgguf.model import trunk_shapes

    p = get_preset("1b")
    cfg, tc = p.model, p.expert
    n = cfg.n_experts
    trunk_bytes = 4 * sum(math.prod(s) for s in trunk_shapes(cfg).values())
    module_bytes = 4 * (cfg.expert_params() + cfg.n_layers * cfg.dim * (cfg.dim + 1))  # FFN + router statistics
    shard_bytes = 2 * tc.tokens  # uint16 token ids
    for shared in ("none", "attn"):
        names = shared_tensor_names(cfg, shared)
        copy_bytes = 4 * sum(math.prod(trunk_shapes(cfg)[k]) for k in names)
        job_s = tc.tokens * expert_step_flops(cfg, names).total / rate
        for machines in (10, 100):
            per_machine = math.ceil(n / machines)
            for rounds in ((1,) if shared == "none" else (1, 4)):
                sync_s = 0.0 if shared == "none" else rounds * n * copy_bytes / 200e6  # merge reads copies at ~200 MB/s
                wall = per_machine * job_s + sync_s
                moved = (machines * rounds * trunk_bytes + n * shard_bytes + n * module_bytes
                         + rounds * n * copy_bytes * (2 if rounds > 1 else 1))
                emit(bench="estimate_1b", machines=machines, experts=n, rounds=rounds, shared=shared,
                     expert_job_h=round(job_s / 3600, 2), wall_h=round(wall / 3600, 2),
                     bytes_moved_gb=round(moved / 1e9, 1), flop_rate_gflops=round(rate / 1e9, 1),
                     assumes="one job per machine at the FLOP rate measured here; sync at 200 MB/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temp dir)")
    a = ap.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="bench-fanout-"))
    work.mkdir(parents=True, exist_ok=True)
    rate = None
    for preset in a.presets.split(","):
        base = prepared(preset, work, a.experts)
        r1 = one(preset, base, work, workers=1)
        emit(bench="fanout", preset=preset, workers=1, **r1, speedup_vs_1=1.0)
        r2 = one(preset, base, work, workers=2)
        emit(bench="fanout", preset=preset, workers=2, **r2, speedup_vs_1=round(r1["wall_s"] / r2["wall_s"], 3))
        if not a.no_ray:
            rr = one(preset, base, work, ray="local")
            emit(bench="fanout", preset=preset, workers="ray", **rr, speedup_vs_1=round(r1["wall_s"] / rr["wall_s"], 3))
            emit(bench="ray_overhead", preset=preset,
                 per_job_s=round((rr["wall_s"] - r2["wall_s"]) / max(1, rr["jobs"]), 2),
                 note="includes starting the local cluster (once per command)")
        if preset == "small":
            rate = measured_rate(preset, base)
    if rate:
        estimate_1b(rate)
    if a.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
