"""Baselines for `mfgguf eval` on an imported base: the base itself trained further on the experts' data.

A pretrained base's own training is sunk cost that counts for nobody; what a practitioner weighs
against experts is what they would do with the same data and compute instead (train/continued.py,
`mfgguf train-base`), each starting from the base exactly as the experts did, on the union of the
trained experts' shards (an equal share of each):
  - flop:       continued pretraining of every parameter for the FLOPs every expert job spent
                together (mfgguf/flops.py: an expert step is its forward, the backward through the
                network and its own weight gradients; a full step is 6x the base's weights);
  - wallclock:  the same for the wall time of the longest expert job (the critical path when each
                expert has a machine): its training seconds x the FLOP-matched run's own tokens/s;
  - lora:       a peft LoRA (rank 16, every linear layer) for the experts' FLOPs.
The peak LR of each kind is chosen by the same small grid (GRID): each value trains on half as
many tokens as the longest expert did, and the lowest held-out loss on the trained domains
(PyTorch, 4,096 tokens a domain) wins; the grid's losses are reported. Tokens are whole optimizer
steps.

Example:
    >>> plans, grid = plan_and_train(rd, metas, out)
    >>> [(p.label, p.tokens, p.lr) for p in plans]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from .config import ModelConfig
from .flops import continued_step_flops, module_flops
from .run import RunDir, read_module_meta
from .stages import run_stage

GRID = {"full": (1e-4, 3e-4, 1e-3), "lora": (1e-3, 3e-3, 1e-2)}  # peak LRs tried for each kind of training
BASE_BASELINES = ("flop", "wallclock", "lora")
LABELS = {"flop": "base, continued pretraining, FLOP-matched", "wallclock": "base, continued pretraining, wall-clock-matched",
          "lora": "base + LoRA r16, FLOP-matched"}
MODE = {"flop": "full", "wallclock": "full", "lora": "lora"}


@dataclass(frozen=True)
class BasePlan:
    key: str  # flop, wallclock or lora (report.json's goals: moe_over_<key>_dense_mixed)
    label: str  # the report's row name
    mode: str  # full or lora
    tokens: int
    lr: float
    budget: float  # FLOPs (flop, lora) or seconds (wallclock)
    run: Path  # the RUN whose trunk is this baseline


def plan_and_train(rd: RunDir, metas: dict, out: Path, which: tuple[str, ...] | None = None,
                   force: bool = False) -> tuple[list[BasePlan], dict]:
    """Train (or reuse) the LR grid and the baselines `which` (default all) against the trained experts in `metas`
    ({0: the imported trunk, i: expert i}); return the plans and {mode: {lr: held-out loss on the trained domains}}."""
    which = BASE_BASELINES if which is None else which
    experts = {i: m for i, m in metas.items() if i > 0}
    cfg = ModelConfig.from_dict(metas[0]["config"])
    step = experts[min(experts)]["train"]["batch_size"] * cfg.ctx_len
    shards = sorted(int(m["shard"]) for m in experts.values())
    trained = sorted({d for m in experts.values() for d in m.get("shard_domains") or []})
    flops = sum(module_flops(m) for m in experts.values())
    longest = max(experts.values(), key=lambda m: m["train_s"])
    grid_tokens = max(step, max(m["tokens_seen"] for m in experts.values()) // 2 // step * step)

    def train(name: str, mode: str, tokens: int, lr: float) -> dict:
        view = RunDir(out / name)
        want = {"mode": mode, "lr": lr, "shards": shards, "from_trunk_sha256": metas[0]["sha256"]}
        if not force and view.module_meta(0).is_file():
            m = read_module_meta(view, 0)
            if m.get("tokens_seen") == tokens and all(m["continued"].get(k) == v for k, v in want.items()):
                return m
        run_stage(f"train-base {name}", ["train-base", rd.root, "-o", view.root, "--mode", mode, "--tokens", tokens,
                                         "--lr", lr, "--shards", ",".join(map(str, shards)), "--no-progress", "--force"])
        return read_module_meta(view, 0)

    def held(m: dict) -> float:
        return sum(m["heldout_loss"][d] for d in trained) / len(trained)

    grid, best = {}, {}
    for mode in sorted({MODE[k] for k in which}):
        runs = {lr: train(f"grid-{mode}-lr{lr:g}", mode, grid_tokens, lr) for lr in GRID[mode]}
        grid[mode] = {"tokens": grid_tokens, "heldout_loss_trained_domains": {f"{lr:g}": held(m) for lr, m in runs.items()}}
        best[mode] = min(runs, key=lambda lr: held(runs[lr]))
        grid[mode]["chosen_lr"] = best[mode]
    plans = []
    for key in [k for k in ("flop", "lora", "wallclock") if k in which]:  # wallclock needs the full run's speed
        mode = MODE[key]
        if key == "wallclock":
            flop_run = next((p for p in plans if p.key == "flop"), None)
            speed = (read_module_meta(RunDir(flop_run.run), 0)["tokens_per_s"] if flop_run else
                     grid_speed(out, mode, best[mode]))
            budget = float(longest["train_s"])
            tokens = max(step, math.floor(speed * budget / step) * step)
        else:
            budget = flops
            tokens = max(step, round(flops / continued_step_flops(cfg, mode).total / step) * step)
        m = train(f"base-{key}", mode, tokens, best[mode])
        plans.append(BasePlan(key, LABELS[key], mode, m["tokens_seen"], best[mode], budget, out / f"base-{key}"))
    return plans, grid


def grid_speed(out: Path, mode: str, lr: float) -> float:
    """Training tokens/s the grid's run of `mode` at `lr` measured."""
    return float(read_module_meta(RunDir(out / f"grid-{mode}-lr{lr:g}"), 0)["tokens_per_s"])
