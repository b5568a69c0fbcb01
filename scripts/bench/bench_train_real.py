"""The expert step on the real base's shape against what a laptop user runs instead, in one run.

At SmolLM2-135M-Instruct's shape (30 x 576, heads 9/3, FFN 1536 = anchor 1344 + seed 192,
vocabulary 49,152, tied head), same precision (bf16 autocast where the CPU has it natively, else
fp32), same batch and context, each configuration in its own process (its own peak RSS):

  - mfgguf's expert step (train/engine/loop.py's InMemorySteps on the imported base, real tokens): as
    `train-expert` runs it (train/whole/trunk.py's plan_activations: micro-batches of 2 sequences, no
    recompute), the whole batch at once, and recompute with the heap limit it needs (what
    `train-expert` ran before micro-batches);
  - transformers' LlamaForCausalLM full fine-tune (AdamW on every parameter), with and without
    gradient checkpointing;
  - peft LoRA, rank 16 on every linear (q, k, v, o, gate, up, down), with and without it; and with its
    frozen base loaded in bf16 as a practitioner loads it (`lora-bf16`), the whole batch or micro-batches of 2
    (`lora-bf16-micro2`, as the expert step takes them);
  - the recipe's step (`expert-attn`: 768-unit experts with attention copies, `train-experts --shared attn`,
    on the base imported with `--expert-ff 768`), eager and compiled (`expert-attn-compile`);
  - the matmul peak of the precision in use (2048 x 2048, this run).

Prints JSON lines: tokens/s, FLOPs per token counted honestly (mfgguf/flops.py: matmuls only; a
frozen tensor gets no weight gradient; recompute's second forward is not counted as work), the
fraction of the peak, peak RSS, and at the end the expert step's ratio to the fastest full
fine-tune and the fastest LoRA.

    make smollm2 && python scripts/bench/bench_train_real.py                # ~20 minutes on 2 cores
    python scripts/bench/bench_train_real.py --batch 8 --ctx 256 --steps 2
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts" / "studies"), str(ROOT / "scripts")]

CONFIGS = ("expert", "expert-whole-batch", "expert-recompute", "expert-attn", "full", "full-ckpt", "full-micro2",
           "lora", "lora-ckpt", "lora-bf16", "lora-bf16-micro2")
LEVERS = ("expert-compile", "expert-attn-compile", "expert-unfused-head", "expert-micro1", "expert-micro2",
          "expert-micro4", "expert-micro8", "expert-short-head")  # measured on request (--configs): none is train-expert's default
LORA_RANK = 16


def hwm_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024
    return float("nan")


def smol_cfg(ctx: int):
    """mfgguf's ModelConfig of the imported base (anchor + seed) and the dense one (the whole FFN)."""
    from mfgguf.config import ModelConfig

    kw = dict(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ctx_len=ctx, rope_theta=1e5, norm_eps=1e-5)
    return ModelConfig(anchor_ff=1344, expert_ff=192, seed_expert=True, **kw), ModelConfig(anchor_ff=1536, expert_ff=192, **kw)


def wide_run(run: Path) -> Path:
    """The base imported with the recipe's 768-unit experts (`--expert-ff 768`), beside RUN."""
    return run.with_name(run.name + "-768")


def flops(kind: str, ctx: int, run: Path) -> float:
    """Matmul FLOPs per training token (mfgguf/flops.py's conventions)."""
    from mfgguf.flops import continued_step_flops, expert_step_flops, trunk_step_flops

    from mfgguf.config import ModelConfig, shared_tensor_names
    from mfgguf.run import RunDir, read_module_meta

    ours, dense = smol_cfg(ctx)
    if kind.startswith("expert-attn"):  # the imported shape itself (anchor 768 + expert 768), not a copy of it here
        wide = ModelConfig.from_dict(read_module_meta(RunDir(wide_run(run)), 0)["config"])
        return expert_step_flops(wide, shared_tensor_names(wide, "attn")).total
    if kind.startswith("expert"):
        return expert_step_flops(ours).total
    if kind.startswith("full"):
        return trunk_step_flops(dense).total
    return continued_step_flops(dense, "lora", rank=LORA_RANK).total  # peft's LoRA on every linear of the base


def batches(tokens, batch: int, ctx: int, n: int):
    import numpy as np
    import torch

    rng = np.random.default_rng(0)
    for _ in range(n):
        starts = rng.integers(0, len(tokens) - ctx - 1, batch)
        w = torch.from_numpy(np.stack([np.asarray(tokens[s : s + ctx + 1], dtype=np.int64) for s in starts]))
        yield w[:, :-1], w[:, 1:]


def child(kind: str, run: Path, batch: int, ctx: int, steps: int, warm: int, peer_config=None) -> dict:
    """One configuration's timed steps in this process. `peer_config`: the transformers config the peers
    build (another base's shape, scripts/bench/bench_bases.py); SmolLM2's when None."""
    import numpy as np
    import torch

    from mfgguf.run import RunDir
    from mfgguf.train.engine.loop import resolve_precision

    torch.set_num_threads(os.cpu_count() or 1)
    prec = resolve_precision("auto", torch.device("cpu"))
    if kind.startswith("expert-attn"):
        run = wide_run(run)
    data = np.load(RunDir(run).shard(1), mmap_mode="r")
    if kind.startswith("expert"):
        step = _ours(run, kind, batch, ctx, prec)
    else:
        step = _peer(kind, prec, peer_config)
    it = batches(data, batch, ctx, warm + steps)
    t0 = time.perf_counter()
    for _ in range(warm):
        step(*next(it))
    warm_s = time.perf_counter() - t0  # with --compile on: the compiling (inductor's cache makes a second run's short)
    t0 = time.perf_counter()
    for _ in range(steps):
        step(*next(it))
    dt = (time.perf_counter() - t0) / steps
    return {"config": kind, "precision": prec, "batch": batch, "ctx": ctx, "steps": steps, "warm_s": round(warm_s, 1), "s_per_step": round(dt, 3),
            "tokens_per_s": round(batch * ctx / dt, 1), "peak_rss_mb": round(hwm_mb(), 1)}


def _ours(run: Path, kind: str, batch: int, ctx: int, prec: str):
    import torch

    from mfgguf.config import ModelConfig, get_preset
    from mfgguf.run import RunDir, read_module_meta
    from mfgguf.train.experts.expert import build_expert_model, expert_params
    from mfgguf.train.experts.shared import lr_scales, shared_names, shared_params
    from mfgguf.train.engine.loop import InMemorySteps, limit_heap_retention
    from mfgguf.train.engine.records import Checkpoints, StepSetup
    from mfgguf.train.whole.trunk import plan_activations

    rd = RunDir(run)
    cfg = ModelConfig.from_dict(read_module_meta(rd, 0)["config"])
    tc = replace(get_preset("small").expert, batch_size=batch, compile="off")
    dev = torch.device("cpu")
    plan = plan_activations(cfg, batch)
    plan_of = {"whole-batch": (False, batch), "recompute": (True, batch), "micro1": (False, 1), "micro2": (False, 2),
               "micro4": (False, 4), "micro8": (False, 8)}
    recompute, micro = next((v for k, v in plan_of.items() if f"-{k}" in kind), plan)  # expert-micro2-unfused-head: both
    if kind.endswith("-compile"):
        tc = replace(tc, compile="on")
    if kind.startswith("expert-attn"):  # the recipe's step: attention copies at 0.3x the LR
        tc = replace(tc, shared="attn", shared_lr_scale=0.3)
    if recompute:
        limit_heap_retention()  # as train-expert does when it recomputes
    copies = list(shared_names(cfg, tc.shared)) if tc.shared != "none" else []
    model = build_expert_model(rd, cfg, 1, dev, bf16_trunk=prec == "bf16", init="seed", trainable=copies)
    named = {**expert_params(model), **(shared_params(model, tc.shared) if copies else {})}
    setup = StepSetup(dev, prec, "single", recompute=recompute, micro=micro,
                      lr_scale=lr_scales(model, tc) if copies else None)
    impl = InMemorySteps(model, named, tc, setup, Checkpoints(Path(run) / "bench-ckpt", {}))
    impl.resume()
    if kind.endswith("-short-head"):  # the head's chunks of LOGITS_CHUNK logits in fp32 too (85 positions at SmolLM2)
        import mfgguf.head_loss

        mfgguf.head_loss.FP32_CHUNK_ROWS = 0
    if kind.endswith("-unfused-head"):
        impl._fwd = lambda xm, ym, route: unfused_head_loss(model, xm, ym, route)
    model.train()
    state = {"s": 0}

    def step(x, y):
        impl.step(state["s"], x, y, lr=tc.lr)
        state["s"] += 1

    return step


def unfused_head_loss(model, idx, targets, route: str):
    """The micro-batch's mean loss as autograd makes it from the whole (B, T, V) logits (what the model did
    before mfgguf/head_loss.py), the blocks as usual."""
    import torch.nn.functional as F

    logits = model(idx, route=route)  # (B, T, V)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.reshape(-1))


def _peer(kind: str, prec: str, cfg=None):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = cfg or LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
                             rope_theta=1e5, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    if "bf16" in kind and prec == "bf16":  # the frozen base as a practitioner loads it (peft keeps the adapters f32)
        model = model.to(torch.bfloat16)
    micro = 2 if kind.endswith("micro2") else None
    if kind.endswith("ckpt"):
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    if kind.startswith("lora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        if kind.endswith("ckpt"):
            model.enable_input_require_grads()
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    dtype = torch.bfloat16 if prec == "bf16" else torch.float32

    def step(x, y):
        m = micro or x.shape[0]
        # one autocast region a step, backward with it off: the f32 weights are cast once a step, as mfgguf's step does
        with torch.autocast("cpu", dtype=dtype, enabled=prec == "bf16"):
            for s in range(0, x.shape[0], m):  # gradient accumulation over micro-batches of m sequences
                loss = model(input_ids=x[s : s + m], labels=x[s : s + m]).loss  # labels shift inside: next-token loss
                with torch.autocast("cpu", enabled=False):
                    (loss * (m / x.shape[0])).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warm", type=int, default=1)
    ap.add_argument("--passes", type=int, default=1, help="run the configurations this many times in turn;"
                    " the ratios take each one's fastest pass")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"of {CONFIGS + LEVERS}")
    ap.add_argument("--work", type=Path, default=ROOT / "bench-out" / "train-real")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    run = a.work / "run"
    if a.child:
        print(json.dumps(child(a.child, run, a.batch, a.ctx, a.steps, a.warm)))
        return

    from bench_train import cpu_flags, matmul_peak

    from mfgguf.stages import run_stage

    for r, ff in ((run, []), (wide_run(run), ["--expert-ff", "768"])):  # the recipe's experts
        if not (r / "run.json").is_file():
            run_stage("import-base", ["import-base", "smollm2", "--out", r, "--force", "--ctx-len", a.ctx, *ff])
            run_stage("prepare", ["prepare", "builtin", "--out", r, "--experts", 1, "--max-chars-per-domain", 400_000,
                                  "--no-progress", "--force"])
    peak = matmul_peak()
    head = {"bench": "train_real", **cpu_flags(), **peak}
    print(json.dumps(head), flush=True)
    rows = {}
    # passes in turn (A B C A B C), each configuration's fastest kept: the machine's speed drifts over
    # minutes (a shared host), and a drift must not land on one configuration only
    for kind in [k for _ in range(a.passes) for k in a.configs.split(",")]:
        out = subprocess.run([sys.executable, __file__, "--child", kind, "--batch", str(a.batch), "--ctx", str(a.ctx),
                              "--steps", str(a.steps), "--warm", str(a.warm), "--work", str(a.work)],
                             capture_output=True, text=True)
        if out.returncode != 0:
            print(json.dumps({"config": kind, "error": out.stderr.strip().splitlines()[-1:]}), flush=True)
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        fpt = flops(kind, a.ctx, run)
        pk = peak["bf16_gflops" if r["precision"] == "bf16" else "fp32_gflops"]
        r.update(flops_per_token=round(fpt), gflops=round(fpt * r["tokens_per_s"] / 1e9, 1), peak_gflops=pk,
                 frac_of_peak=round(fpt * r["tokens_per_s"] / 1e9 / pk, 3))
        print(json.dumps(r), flush=True)
        if kind not in rows or r["tokens_per_s"] > rows[kind]["tokens_per_s"]:
            rows[kind] = r
    ours = max((rows[k]["tokens_per_s"] for k in rows if k.startswith("expert") and k != "expert-attn"
                and k not in LEVERS), default=None)
    for k in LEVERS:
        ref = "expert-attn" if k.startswith("expert-attn") else "expert"
        if k in rows and ref in rows:
            print(json.dumps({"ratio": f"{k} / {ref}", "value": round(rows[k]["tokens_per_s"] / rows[ref]["tokens_per_s"], 3),
                              "peak_rss_mb": [rows[k]["peak_rss_mb"], rows[ref]["peak_rss_mb"]]}), flush=True)
    if "expert-attn" in rows and "expert" in rows:  # per FLOP: the recipe's step against the FFN-only one
        per = {k: rows[k]["gflops"] for k in ("expert-attn", "expert")}
        print(json.dumps({"ratio": "expert-attn / expert, per FLOP", "goal": ">= 1.0",
                          "value": round(per["expert-attn"] / per["expert"], 3)}), flush=True)
    for peer in ("full", "lora"):
        best = max((rows[k]["tokens_per_s"] for k in rows if k.startswith(peer)), default=None)
        if ours and best:
            print(json.dumps({"ratio": f"expert / fastest {peer}", "value": round(ours / best, 3),
                              "goal": ">= 1.5" if peer == "full" else ">= 1.3"}), flush=True)
            for k in ("expert-attn", *LEVERS):
                if k in rows:
                    goal = {"goal": ">= 1.2"} if (k, peer) == ("expert-attn", "lora") else {}
                    print(json.dumps({"ratio": f"{k} / fastest {peer}", "value": round(rows[k]["tokens_per_s"] / best, 3),
                                      **goal}), flush=True)


if __name__ == "__main__":
    main()
