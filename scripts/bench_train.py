"""Benchmark training: throughput against this CPU's measured bf16 peak, expert memory on `1b`, expert gain.

Prints JSON lines:
  {"bench": "peak", "bf16_gflops": ..., "fp32_gflops": ...}          2048x2048 matmuls, this run
  {"bench": "throughput", "module": "trunk"|"expert", "tokens_per_s": ..., "gflops": ..., "frac_of_peak": ...,
   "flops_per_token": ..., "formula": "..."}                           `small` preset, real text
  {"bench": "gain", "domain": ..., "trunk_heldout": ..., "expert_heldout": ..., "lower": true}
  {"bench": "rss_1b", "peak_rss_mb": ..., "vmhwm_mb": ..., "goal_mb": 1536, ...}  train-expert in a subprocess
  (with --shared-1b attn: the same expert also training its private copy of the trunk's norms and
  attention, `train-expert --shared attn`; goal 2048 MB)

The `1b` RUN is built by hand: a trunk of random weights (std 0.02, written by run.write_module)
and uniformly random token ids below 32768 (no tokenizer is needed to train). The `small` RUN
comes from `prepare` on the built-in corpus (label partition, vocab 4096).

    python scripts/bench_train.py --quick            # short small runs, then the 1b RSS check
    python scripts/bench_train.py --skip-1b          # full small runs only
    python scripts/bench_train.py --skip-small --shared-1b attn   # 1b memory of an expert with --shared attn
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def emit(**kw) -> None:
    """One JSON line; the 1-minute load average says how much the (shared) CPU was busy meanwhile."""
    print(json.dumps({**kw, "loadavg_1m": round(os.getloadavg()[0], 2)}), flush=True)


# ---- (a) peak ------------------------------------------------------------------------------------


def matmul_peak(n: int = 2048, seconds: float = 3.0) -> dict:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    out = {}
    for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
        for _ in range(3):
            a @ b  # warm-up
        it, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a @ b
            it += 1
        out[f"{name}_gflops"] = 2 * n**3 * it / (time.perf_counter() - t0) / 1e9
    return out


# ---- (b) FLOP accounting -------------------------------------------------------------------------


def flops_per_token(cfg, kind: str, recompute: bool) -> tuple[float, str]:
    """Forward + backward FLOPs per trained token that the loop actually performs."""
    L, C, T, hd = cfg.n_layers, cfg.dim, cfg.ctx_len, cfg.head_dim
    attn_w = L * (2 * C * cfg.n_heads * hd + 2 * C * cfg.n_kv_heads * hd)  # q, o, k, v weights
    anchor = L * 3 * C * cfg.anchor_ff
    head = cfg.vocab_size * C
    expert = L * 3 * C * cfg.expert_ff
    attn = L * 2 * C * T  # causal QK^T + AV per token: 2 * (2 * C * T/2)
    if kind == "trunk":
        fwd = 2 * (attn_w + anchor + head) + attn
        total = 3 * fwd + (fwd if recompute else 0)
        f = ("trunk: 3*fwd (+1 fwd if recompute), fwd = 2*(attn_w+anchor+head) + 2*L*dim*ctx (causal attention);"
             " embedding lookups not counted")
        return total, f
    fwd = 2 * (attn_w + anchor + head + expert) + attn
    frac = (L - 1) / L  # layer 0's attention and anchor need no input gradient: nothing below trains
    bwd = 2 * head + frac * (2 * (attn_w + anchor) + 2 * attn) + 4 * expert - 2 * expert / L
    total = fwd + bwd + (fwd if recompute else 0)
    f = ("expert: fwd + bwd (+1 fwd if recompute), fwd = 2*(attn_w+anchor+head+expert) + 2*L*dim*ctx;"
         " bwd = 2*head + (L-1)/L*(2*(attn_w+anchor) + 4*L*dim*ctx) + 4*expert - 2*expert/L"
         " (frozen weights: input gradients only, none below layer 0's expert)")
    return total, f


# ---- (b) + (d) small ---------------------------------------------------------------------------


def bench_small(work: Path, quick: bool, peak: float) -> None:
    from mfgguf.config import ModelConfig
    from mfgguf.data.prepare import prepare
    from mfgguf.options import TrainOptions
    from mfgguf.train.expert import train_expert
    from mfgguf.train.trunk import train_trunk

    run = work / "small"
    info = prepare(["builtin"], run, n_experts=3, partition="label", vocab_size=4096, seed=0, force=True,
                   max_chars_per_domain=1_500_000 if quick else None, progress=False)
    t_tokens, e_tokens = (200_000, 100_000) if quick else (None, None)
    trunk = train_trunk(run, preset="small", options=TrainOptions(tokens=t_tokens), progress=False, restart=True)
    expert = train_expert(run, 1, options=TrainOptions(tokens=e_tokens), progress=False, restart=True)
    cfg = ModelConfig.from_dict(trunk["config"])
    for m in (trunk, expert):
        fpt, formula = flops_per_token(cfg, m["kind"], m["recompute"])
        gf = fpt * m["tokens_per_s"] / 1e9
        emit(bench="throughput", module=m["name"], preset="small", precision=m["precision"], tokens=m["tokens_seen"],
             tokens_per_s=round(m["tokens_per_s"], 1), flops_per_token=fpt, gflops=round(gf, 1),
             peak_bf16_gflops=round(peak, 1), frac_of_peak=round(gf / peak, 3), goal_frac=0.30, formula=formula)
    own = list(expert["shard_domains"])
    for d in own:
        emit(bench="gain", preset="small", partition=info["partition"], expert=1, domain=d,
             trunk_heldout=round(trunk["heldout_loss"][d], 4), expert_heldout=round(expert["heldout_loss"][d], 4),
             lower=expert["heldout_loss"][d] < trunk["heldout_loss"][d],
             other_domains={k: [round(trunk["heldout_loss"][k], 4), round(v, 4)]
                            for k, v in expert["heldout_loss"].items() if k not in own})


# ---- (c) 1b expert RSS ---------------------------------------------------------------------------

_BUILD_1B = r"""
import sys, numpy as np
from dataclasses import replace
from pathlib import Path
from mfgguf.config import get_preset
from mfgguf.model import trunk_shapes
from mfgguf.run import RUN_FORMAT, RUN_VERSION, RunDir, write_json, write_module
rd = RunDir(Path(sys.argv[1])); rd.heldout_dir.mkdir(parents=True, exist_ok=True)
cfg = get_preset("1b").model
rng = np.random.default_rng(0)
V = cfg.vocab_size
np.save(rd.train_tokens, rng.integers(0, V, 16384, dtype=np.uint16))
np.save(rd.shard(1), rng.integers(0, V, 16384, dtype=np.uint16))
np.save(rd.heldout("d1"), rng.integers(0, V, 4096, dtype=np.uint16))
write_json(rd.run_json, {"format": RUN_FORMAT, "version": RUN_VERSION, "n_experts": cfg.n_experts, "vocab_size": V,
    "eos_id": 0, "token_dtype": "uint16", "domains": ["d1"], "partition": "random-tokens",
    "shards": [{"id": 1, "domains": {"d1": 16384}}]})
t = {k: (np.ones(s, np.float32) if len(s) == 1 else (rng.standard_normal(s, dtype=np.float32) * 0.02))
     for k, s in trunk_shapes(cfg).items()}
write_module(rd, 0, t, {"kind": "trunk", "preset": "1b", "config": cfg.to_dict(), "heldout_loss": {}, "synthetic": True})
"""

_TRAIN = r"""
import atexit, sys
def _hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            print("VMHWM_KB", line.split()[1], file=sys.stderr, flush=True)
atexit.register(_hwm)
from mfgguf.cli.app import main
sys.argv = ["mfgguf"] + sys.argv[1:]
main()
"""


def bench_1b(work: Path, steps: int, peak: float, shared: str = "none") -> None:
    from mfgguf.config import ModelConfig, get_preset

    run = work / "run1b"
    shutil.rmtree(run, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", _BUILD_1B, str(run)], check=True, env=env)
    build_s = time.perf_counter() - t0
    tc = get_preset("1b").expert
    tokens = steps * tc.batch_size * get_preset("1b").model.ctx_len
    cmd = [sys.executable, "-c", _TRAIN, "train-expert", str(run), "--expert", "1", "--tokens", str(tokens),
           "--eval-tokens", "1024", "--no-progress", "--shared", shared]
    t0 = time.perf_counter()
    with open(work / "1b.out", "w+") as fo, open(work / "1b.err", "w+") as fe:
        proc = subprocess.Popen(cmd, env=env, stdout=fo, stderr=fe)
        _, status, ru = os.wait4(proc.pid, 0)  # this child's own rusage (not the builder's)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        fo.seek(0), fe.seek(0)
        out, err = fo.read(), fe.read()
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"train-expert 1b failed: {err.strip()[-2000:]}")
    hwm = [int(l.split()[1]) for l in err.splitlines() if l.startswith("VMHWM_KB")]
    meta = json.loads((run / "modules" / "expert_001.json").read_text())
    fpt, _ = flops_per_token(ModelConfig.from_dict(meta["config"]), "expert", meta["recompute"])
    goal = 1536 if shared == "none" else 2048  # a shared copy costs 16 B/param: f32 weight, grad, 2 AdamW moments
    n_shared = sum(math.prod(s) for k, s in meta["tensors"].items() if k.startswith("shared."))
    emit(bench="rss_1b", preset="1b", shared=shared, shared_params=n_shared, steps=meta["steps"], tokens=meta["tokens_seen"], precision=meta["precision"],
         recompute=meta["recompute"], vmhwm_mb=round(hwm[0] / 1024, 1) if hwm else None,
         wait4_maxrss_mb=round(ru.ru_maxrss / 1024, 1), goal_mb=goal,
         ok=bool(hwm) and hwm[0] / 1024 <= goal, trunk_file_mb=round((run / "modules/trunk.safetensors").stat().st_size / 2**20),
         tokens_per_s=round(meta["tokens_per_s"], 1), gflops=round(fpt * meta["tokens_per_s"] / 1e9, 1),
         frac_of_peak=round(fpt * meta["tokens_per_s"] / 1e9 / peak, 3), wall_s=round(wall, 1), build_s=round(build_s, 1),
         note="vmhwm_mb: the train-expert process's own peak (VmHWM at exit); wait4_maxrss_mb: its rusage"
              " ru_maxrss, which on Linux also counts the parent's RSS at fork time"
              + ("; gflops counts no weight gradients for the shared copies (an underestimate)" if n_shared else ""),
         cli=out.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short small runs (200k trunk / 100k expert tokens)")
    ap.add_argument("--skip-1b", action="store_true", help="skip the 1b expert memory check")
    ap.add_argument("--skip-small", action="store_true", help="skip the small throughput and gain runs")
    ap.add_argument("--steps-1b", type=int, default=2, help="training steps in the 1b memory check")
    ap.add_argument("--shared-1b", default="none", help="train-expert --shared in the 1b memory check (none, norms, attn, all)")
    ap.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    a = ap.parse_args()
    work = a.dir or Path(tempfile.mkdtemp(prefix="mfgguf-bench-train-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        peak = matmul_peak()
        emit(bench="peak", n=2048, threads=os.cpu_count(), **{k: round(v, 1) for k, v in peak.items()})
        if not a.skip_1b:
            bench_1b(work, a.steps_1b, peak["bf16_gflops"], a.shared_1b)
        if not a.skip_small:
            bench_small(work, a.quick, peak["bf16_gflops"])
    finally:
        if a.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
