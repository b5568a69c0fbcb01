"""Benchmark training: step throughput against this CPU's measured matmul peak, expert memory on `1b`, expert gain.

Prints JSON lines:
  {"bench": "cpu", "model": ..., "avx512": ..., "bf16_native": ..., "amx": ..., "precision": ...}
  {"bench": "peak", "bf16_gflops": ..., "fp32_gflops": ..., "peak_gflops": ...}   2048x2048 matmuls, this run;
      peak_gflops is the precision training uses here (bf16 where the CPU has it natively, else fp32)
  {"bench": "step", "preset": ..., "module": "trunk"|"expert", "mode": "before"|"eager"|"compiled",
   "tokens_per_s": ..., "gflops": ..., "frac_of_peak": ..., "speedup_vs_before": ..., ...}
      the in-memory training step itself (train/engine/loop.py's InMemorySteps) on random tokens, after
      warm-up steps (compilation included in warm-up, reported as warmup_s). FLOPs per token follow
      mfgguf/flops.py (matmuls only, causal attention). "before" is the step as it was before fused
      AdamW and torch.compile (eager, one AdamW kernel per operation): the reference for speed-ups
  {"bench": "throughput", ...}   a real `small` trunk and expert training run (--real-small)
  {"bench": "gain", "domain": ..., "trunk_validation": ..., "expert_validation": ..., "lower": true}
  {"bench": "rss_1b", "peak_rss_mb": ..., "vmhwm_mb": ..., "goal_mb": 1536, ...}  train-expert in a subprocess
  (with --shared-1b attn: the same expert also training its private copy of the trunk's norms and
  attention, `train-expert --shared attn`; goal 2048 MB)

The step RUNs are built by hand: a trunk of random weights (std 0.02, written by run.write_module)
and uniformly random token ids (no tokenizer is needed to train). `tiny` runs at the study's batch
(64 sequences).

    python scripts/bench/bench_train.py                    # steps of tiny, small (and 1b: --presets tiny,small,1b)
    python scripts/bench/bench_train.py --real-small       # also a real small trunk + expert training run
    python scripts/bench/bench_train.py --rss-1b --shared-1b attn   # 1b memory of an expert with --shared attn
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def emit(**kw) -> None:
    """One JSON line; the 1-minute load average says how much the (shared) CPU was busy meanwhile."""
    print(json.dumps({**kw, "loadavg_1m": round(os.getloadavg()[0], 2)}), flush=True)


# ---- (a) peak ------------------------------------------------------------------------------------


def matmul_peak(n: int = 2048, seconds: float = 3.0) -> dict:
    import torch

    from mfgguf.train.engine.loop import resolve_precision

    torch.set_num_threads(os.cpu_count() or 1)
    native = resolve_precision("auto", torch.device("cpu")) == "bf16"
    out = {}
    for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        m = n if name == "fp32" or native else 256  # emulated bf16 runs hundreds of times slower: a small product says so
        a, b = torch.randn(m, m, dtype=dt), torch.randn(m, m, dtype=dt)
        for _ in range(3):
            a @ b  # warm-up
        it, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a @ b
            it += 1
        out[f"{name}_gflops"] = 2 * m**3 * it / (time.perf_counter() - t0) / 1e9
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
    from mfgguf.train.experts.expert import train_expert
    from mfgguf.train.whole.trunk import train_trunk

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
             peak_gflops=round(peak, 1), frac_of_peak=round(gf / peak, 3), goal_frac=0.50, formula=formula)
    own = list(expert["shard_domains"])
    for d in own:
        emit(bench="gain", preset="small", partition=info["partition"], expert=1, domain=d,
             trunk_validation=round(trunk["validation_loss"][d], 4), expert_validation=round(expert["validation_loss"][d], 4),
             lower=expert["validation_loss"][d] < trunk["validation_loss"][d],
             other_domains={k: [round(trunk["validation_loss"][k], 4), round(v, 4)]
                            for k, v in expert["validation_loss"].items() if k not in own})


# ---- (c) 1b expert RSS ---------------------------------------------------------------------------

_BUILD_1B = r"""
import sys, numpy as np
from dataclasses import replace
from pathlib import Path
from mfgguf.config import get_preset
from mfgguf.model import trunk_shapes
from mfgguf.run import RUN_FORMAT, RUN_VERSION, RunDir, write_json, write_module
rd = RunDir(Path(sys.argv[1])); rd.test_dir.mkdir(parents=True, exist_ok=True)
cfg = get_preset("1b").model
rng = np.random.default_rng(0)
V = cfg.vocab_size
np.save(rd.train_tokens, rng.integers(0, V, 16384, dtype=np.uint16))
np.save(rd.shard(1), rng.integers(0, V, 16384, dtype=np.uint16))
np.save(rd.test("d1"), rng.integers(0, V, 4096, dtype=np.uint16))
write_json(rd.run_json, {"format": RUN_FORMAT, "version": RUN_VERSION, "n_experts": cfg.n_experts, "vocab_size": V,
    "eos_id": 0, "token_dtype": "uint16", "domains": ["d1"], "partition": "random-tokens",
    "shards": [{"id": 1, "domains": {"d1": 16384}}]})
t = {k: (np.ones(s, np.float32) if len(s) == 1 else (rng.standard_normal(s, dtype=np.float32) * 0.02))
     for k, s in trunk_shapes(cfg).items()}
write_module(rd, 0, t, {"kind": "trunk", "preset": "1b", "config": cfg.to_dict(), "validation_loss": {}, "synthetic": True})
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


# ---- (e) training steps of every preset ----------------------------------------------------------------


def cpu_flags() -> dict:
    """The CPU's model name and the instruction sets speed depends on (from /proc/cpuinfo; no torch, so a
    parent process that spawns measured children stays light)."""
    from mfgguf import machine  # torch-free

    c = machine.cpu()
    flags = set(c["flags"])
    return {"model": c["model"], "avx2": "avx2" in flags, "avx512": "avx512f" in flags, "bf16_native": "avx512_bf16" in
            flags or "amx_bf16" in flags, "amx": "amx_tile" in flags, "cores": os.cpu_count(), "flags": c["flags"],
            **({"held_to": c["held_to"]} if "held_to" in c else {})}


def cpu_info() -> dict:
    """`cpu_flags()` and the kernels torch picks on this CPU."""
    import torch

    return {**cpu_flags(), "torch_capability": torch.backends.cpu.get_cpu_capability()}


def _random_run(root: Path, preset: str, vocab: int, trunk: bool) -> "object":
    """A RUN with uniformly random tokens and (for expert steps) a trunk module of random weights."""
    import numpy as np

    from mfgguf.config import get_preset
    from mfgguf.model import trunk_shapes
    from mfgguf.run import RUN_FORMAT, RUN_VERSION, RunDir, write_json, write_module
    from dataclasses import replace

    rd = RunDir(root)
    rd.test_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    np.save(rd.train_tokens, rng.integers(0, vocab, 1 << 18, dtype=np.uint16))
    write_json(rd.run_json, {"format": RUN_FORMAT, "version": RUN_VERSION, "n_experts": 1, "vocab_size": vocab,
                             "eos_id": 0, "token_dtype": "uint16", "domains": ["d1"], "partition": "random-tokens",
                             "shards": [{"id": 1, "domains": {"d1": 1 << 18}}]})
    cfg = replace(get_preset(preset).model, vocab_size=vocab, n_experts=1)
    if trunk:
        t = {k: (np.ones(sh, np.float32) if len(sh) == 1 else rng.standard_normal(sh, dtype=np.float32) * 0.02)
             for k, sh in trunk_shapes(cfg).items()}
        write_module(rd, 0, t, {"kind": "trunk", "preset": preset, "config": cfg.to_dict(), "validation_loss": {}})
    return rd, cfg


def bench_step(work: Path, preset: str, module: str, mode: str, batch: int | None, n: int, peak: float,
               before_tps: float | None) -> float:
    """Time `n` in-memory training steps of `preset`'s trunk or expert after warm-up; emit one line."""
    import numpy as np
    import torch
    from dataclasses import replace

    from mfgguf.config import get_preset
    from mfgguf.flops import expert_step_flops, trunk_step_flops
    from mfgguf.model import trunk_model
    from mfgguf.train.engine.driver import get_batch
    from mfgguf.train.experts.expert import build_expert_model, expert_params
    from mfgguf.train.engine.loop import InMemorySteps, resolve_device, resolve_precision
    from mfgguf.train.engine.records import Checkpoints, StepSetup
    from mfgguf.train.whole.trunk import wants_recompute

    p = get_preset(preset)
    vocab = p.model.vocab_size if preset == "1b" else 4096
    rd, cfg = _random_run(work / f"{preset}-{module}", preset, vocab, trunk=module == "expert")
    tc = p.trunk if module == "trunk" else p.expert
    tc = replace(tc, batch_size=batch or tc.batch_size, compile="on" if mode == "compiled" else "off")
    dev = resolve_device("cpu")
    prec = resolve_precision("auto", dev)
    rec = wants_recompute(cfg, tc.batch_size)
    if module == "trunk":
        model, route = trunk_model(cfg)
        named = {k: v for k, v in model.named_parameters() if v.requires_grad}
        fpt = trunk_step_flops(cfg).total
    else:
        model, route = build_expert_model(rd, cfg, 1, dev, bf16_trunk=prec == "bf16", init="random"), "single"
        named = expert_params(model)
        fpt = expert_step_flops(cfg).total
    impl = InMemorySteps(model, named, tc, StepSetup(dev, prec, route, recompute=rec), Checkpoints(work / "ckpt", {}))
    impl.resume()
    if mode == "before":  # one AdamW kernel per arithmetic operation, as before fused AdamW
        impl.opt = torch.optim.AdamW(impl.opt.param_groups, lr=tc.lr, betas=(0.9, 0.95), eps=tc.adam_eps, foreach=False)
    data = np.load(rd.train_tokens, mmap_mode="r")
    model.train()
    warm = 2 if mode == "compiled" else 1
    t0 = time.perf_counter()
    for s in range(warm):
        impl.step(s, *get_batch(data, 0, 0, s, tc.batch_size, cfg.ctx_len), lr=tc.lr)
    warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for s in range(warm, warm + n):
        impl.step(s, *get_batch(data, 0, 0, s, tc.batch_size, cfg.ctx_len), lr=tc.lr)
    dt = (time.perf_counter() - t0) / n
    tps = tc.batch_size * cfg.ctx_len / dt
    gf = fpt * tps / 1e9
    emit(bench="step", preset=preset, module=module, mode=mode, precision=prec, compiled=impl.compiled, recompute=rec,
         batch=tc.batch_size, ctx=cfg.ctx_len, steps=n, s_per_step=round(dt, 4), tokens_per_s=round(tps, 1),
         flops_per_token=fpt, gflops=round(gf, 1), peak_gflops=round(peak, 1), frac_of_peak=round(gf / peak, 3),
         warmup_s=round(warm_s, 1), speedup_vs_before=round(tps / before_tps, 2) if before_tps else None)
    return tps


def shape_ceiling(preset: str, batch: int | None, prec: str, peak: float, seconds: float = 2.0) -> None:
    """GFLOP/s of the trunk step's own matmuls alone (forward, input and weight gradients of every weight
    at its real shape): the most a step of this preset could reach with perfect everything else."""
    import torch
    from dataclasses import replace

    from mfgguf.config import get_preset

    p = get_preset(preset)
    cfg = replace(p.model, vocab_size=p.model.vocab_size if preset == "1b" else 4096, seed_expert=True)
    dt = torch.bfloat16 if prec == "bf16" else torch.float32
    M = (batch or p.trunk.batch_size) * cfg.ctx_len
    hd = cfg.head_dim
    shapes = [(cfg.n_heads * hd, cfg.dim), (cfg.n_kv_heads * hd, cfg.dim), (cfg.n_kv_heads * hd, cfg.dim),
              (cfg.dim, cfg.n_heads * hd), (cfg.trunk_ff, cfg.dim), (cfg.trunk_ff, cfg.dim), (cfg.dim, cfg.trunk_ff)]
    shapes = shapes * cfg.n_layers + [(cfg.vocab_size, cfg.dim)]
    ws = [torch.randn(o, i, dtype=dt) for o, i in shapes]
    xs = {i: torch.randn(M, i, dtype=dt) for _, i in shapes}
    gs = {o: torch.randn(M, o, dtype=dt) for o, _ in shapes}

    def once():
        for w in ws:
            o, i = w.shape
            xs[i] @ w.T, gs[o] @ w, gs[o].T @ xs[i]  # forward, input gradient, weight gradient

    once()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        once()
        n += 1
    flops = 6 * M * sum(o * i for o, i in shapes) * n
    gf = flops / (time.perf_counter() - t0) / 1e9
    emit(bench="shape_ceiling", preset=preset, precision=prec, tokens_per_step=M, gflops=round(gf, 1),
         peak_gflops=round(peak, 1), frac_of_peak=round(gf / peak, 3),
         note="the trunk step's matmuls alone at their real shapes (M = tokens per step); attention scores not included")


def bench_steps(work: Path, presets: list[str], peak: float) -> None:
    """Every preset's trunk and expert step: before, eager and compiled (1b: before and eager only)."""
    steps = {"tiny": 20, "small": 8, "1b": 2}
    from mfgguf.train.engine.loop import resolve_precision

    import torch

    prec = resolve_precision("auto", torch.device("cpu"))
    for preset in presets:
        shape_ceiling(preset, 64 if preset == "tiny" else None, prec, peak)
        for module in ("trunk", "expert"):
            modes = ["before", "eager"] + ([] if preset == "1b" else ["compiled"])
            before = None
            for mode in modes:
                tps = bench_step(work, preset, module, mode, 64 if preset == "tiny" else None, steps[preset], peak, before)
                before = before or tps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="tiny,small", help="presets whose steps to time (tiny, small, 1b)")
    ap.add_argument("--real-small", action="store_true", help="also a real small trunk + expert training run")
    ap.add_argument("--quick", action="store_true", help="the real small run short (200k trunk / 100k expert tokens)")
    ap.add_argument("--rss-1b", action="store_true", help="the 1b expert memory check (a train-expert process)")
    ap.add_argument("--steps-1b", type=int, default=2, help="training steps in the 1b memory check")
    ap.add_argument("--shared-1b", default="none", help="train-expert --shared in the 1b memory check (none, norms, attn, all)")
    ap.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    a = ap.parse_args()
    work = a.dir or Path(tempfile.mkdtemp(prefix="mfgguf-bench-train-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        from mfgguf.train.engine.loop import resolve_precision

        import torch

        info = cpu_info()
        prec = resolve_precision("auto", torch.device("cpu"))
        emit(bench="cpu", precision=prec, threads=os.cpu_count(), **info)
        peak = matmul_peak()
        peak["peak_gflops"] = peak[f"{prec}_gflops"]
        emit(bench="peak", n=2048, threads=os.cpu_count(), precision=prec, **{k: round(v, 1) for k, v in peak.items()})
        if a.presets:
            bench_steps(work, [x for x in a.presets.split(",") if x], peak["peak_gflops"])
        if a.rss_1b:
            bench_1b(work, a.steps_1b, peak["peak_gflops"], a.shared_1b)
        if a.real_small:
            bench_small(work, a.quick, peak["peak_gflops"])
    finally:
        if a.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
