"""Baselines for `mfgguf eval` on an imported base: the base itself trained further on the experts' data
(the side of a trunk trained here: eval/baselines/scratch.py).

A pretrained base's own training is sunk cost that counts for nobody; what a practitioner weighs
against experts is what they would do with the same data and compute instead (train/whole/continued.py,
`mfgguf train-base`), each starting from the base exactly as the experts did, on the union of the
trained experts' shards (an equal share of each):
  - flop:       continued pretraining of every parameter for the FLOPs every expert job spent
                together (mfgguf/flops.py: an expert step is its forward, the backward through the
                network and its own weight gradients; a full step is 6x the base's weights);
  - wallclock:  the same for the MoE's critical path when each expert has a machine: the slowest
                expert's wall over all its rounds (process start, scoring and statistics included) plus
                every sync's wall, x the full grid's training tokens/s (its fastest point: they all run one step);
  - lora:       a peft LoRA (rank 16, every linear layer) for the experts' FLOPs;
  - lora-domain: one such LoRA per expert's shard, each for its expert's FLOPs, served as llama.cpp
                adapters on the base and picked by domain (eval/domain_loras.py), at the LoRA grid's LR.
The peak LR of each kind is chosen by the same small grid (GRID, or eval's --full-lrs / --lora-lrs) run at the
budget it is used with:
each value trains for the experts' whole FLOPs, the lowest validation loss on the trained domains
(PyTorch, 4,096 tokens a domain) wins, and that run is the baseline (no second run); the grid's
losses are reported. A grid of one LR for the per-cluster LoRAs alone is not run: there is nothing to choose
(given the LR an earlier eval chose, `--baselines lora-domain` trains no one LoRA). The wall-clock-matched run
reuses the full grid's LR, chosen at the FLOP budget (the larger one when experts run side by side). Tokens are
whole optimizer steps. Every training takes eval's --seed (the data order and a LoRA's initialisation), so seeds
vary the baselines as they vary the experts.

Example:
    >>> plans, grid = plan_and_train(rd, metas, out)
    >>> [(p.label, p.tokens, p.lr) for p in plans]
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from mfgguf.config import ModelConfig
from mfgguf.modules.lora_adapter import ADAPTER_FILE
from mfgguf.eval.baselines.baseline import Job, Kind, Outcome, Trained, keys
from mfgguf.eval.domain_loras import LABEL as LORA_DOMAIN_LABEL
from mfgguf.eval.domain_loras import DomainAdapter, domain_owners
from mfgguf.flops import continued_step_flops, module_flops
from mfgguf.run import ModuleMeta, RunDir, SyncPlan, link_or_copy, read_json, read_module, update_manifest
from mfgguf.stages import run_stage

GRID = {"full": (1e-4, 3e-4, 1e-3), "lora": (1e-3, 3e-3, 1e-2)}  # peak LRs tried for each kind of training
# in the order they train: the wall-clock-matched run needs the FLOP-matched grid's speed
IMPORTED = (Kind("flop", "base, continued pretraining, FLOP-matched", budget="flops", trains="full"),
            Kind("lora", "base + LoRA r16, FLOP-matched", budget="flops", trains="lora"),
            Kind("lora-domain", LORA_DOMAIN_LABEL, budget="flops", trains="lora"),
            Kind("wallclock", "base, continued pretraining, wall-clock-matched", budget="seconds", trains="full"))
_KIND = {k.key: k for k in IMPORTED}


@dataclass(frozen=True)
class BasePlan:
    key: str  # flop, wallclock or lora (report.json's goals: moe_over_<key>_dense_mixed)
    label: str  # the report's row name
    mode: str  # full or lora
    tokens: int
    lr: float
    budget: float  # FLOPs (flop, lora) or seconds (wallclock)
    run: Path  # the RUN whose trunk is this baseline
    adapters: tuple[DomainAdapter, ...] = ()  # lora-domain: one llama.cpp adapter per shard, on the base (run)


def plan_and_train(rd: RunDir, metas: dict[int, ModuleMeta], out: Path, which: tuple[str, ...] | None = None,
                   force: bool = False, seed: int | None = None,
                   lrs: dict[str, tuple[float, ...]] | None = None) -> tuple[list[BasePlan], dict]:
    """Train (or reuse) the LR grid and the baselines `which` (default all) against the trained experts in `metas`
    ({0: the imported trunk, i: expert i}), every training with `seed` (train-base's --seed; None: its default),
    each kind's grid the peak LRs `lrs` gives it (GRID's where it gives none: {"full": (3e-4,)} spends a later seed
    on the LR an earlier one chose); return the plans and {mode: {lr: held-out loss on the trained domains}}."""
    which = keys(IMPORTED) if which is None else which
    lrs = {**GRID, **(lrs or {})}
    kinds = [k for k in IMPORTED if k.key in which]
    experts = {i: m for i, m in metas.items() if i > 0}
    cfg = ModelConfig.from_dict(metas[0].config)
    step = experts[min(experts)].train["batch_size"] * cfg.ctx_len
    shards = sorted(int(m.shard) for m in experts.values())
    trained = sorted({d for m in experts.values() for d in m.shard_domains or []})
    flops = sum(expert_flops(m) for m in experts.values())
    # the experts' walls, read only where a wall-clock-matched baseline is asked (planned experts have none)
    critical_s = critical_path_s(rd, experts) if any(k.budget == "seconds" for k in kinds) else 0.0
    first = first_trunk_sha256(rd)

    def train(name: str, mode: str, tokens: int, lr: float) -> ModuleMeta:
        return train_base(rd, out / name, mode=mode, tokens=tokens, lr=lr, shards=shards,
                          trunk_sha256=first, force=force, seed=seed)

    def held(m: ModuleMeta) -> float:
        return sum(m.validation_loss[d] for d in trained) / len(trained)

    def flop_tokens(mode: str) -> int:
        return matched_tokens(flops, continued_step_flops(cfg, mode).total, step)

    grid, best, runs = {}, {}, {}
    for mode in sorted({k.trains for k in kinds}):
        tokens = flop_tokens(mode)
        if len(lrs[mode]) == 1 and all(k.key == "lora-domain" for k in kinds if k.trains == mode):
            # one LR given and no baseline that is the grid's own run: there is nothing to choose, so nothing to train
            best[mode] = lrs[mode][0]
            grid[mode] = {"tokens": tokens, "validation_loss_trained_domains": {}, "chosen_lr": best[mode]}
            continue
        runs[mode] = {lr: train(f"grid-{mode}-lr{lr:g}", mode, tokens, lr) for lr in lrs[mode]}
        grid[mode] = {"tokens": tokens, "validation_loss_trained_domains": {f"{lr:g}": held(m) for lr, m in runs[mode].items()}}
        best[mode] = min(runs[mode], key=lambda lr: held(runs[mode][lr]))
        grid[mode]["chosen_lr"] = best[mode]
    plans = []
    for kind in kinds:
        mode = kind.trains
        lr = best[mode]
        if kind.key == "lora-domain":  # each shard's own LoRA at its expert's FLOPs, the union grid's LR
            ads = tuple(train_domain_loras(rd, metas, out, lr, force, seed))
            base = first_trunk_view(rd, out) or rd  # the adapters are served on the base they trained from
            plans.append(BasePlan(kind.key, kind.label, mode, sum(a.tokens for a in ads), lr, flops, base.root, ads))
            continue
        if kind.budget == "seconds":
            budget = critical_s
            # every grid point runs the same step at another LR: the fastest is the one least slowed by whatever else
            # shared the machine, and the speed this kind of training has here
            speed = max(float(m.tokens_per_s) for m in runs[mode].values())
            tokens = max(step, math.floor(speed * budget / step) * step)
            m, name = train(f"base-{kind.key}", mode, tokens, lr), f"base-{kind.key}"
        else:  # the grid's best run is the FLOP-matched baseline itself
            budget, m, name = flops, runs[mode][lr], f"grid-{mode}-lr{lr:g}"
        plans.append(BasePlan(kind.key, kind.label, mode, m.tokens_seen, lr, budget, out / name))
    return plans, grid


def first_trunk_sha256(rd: RunDir) -> str:
    """The sha256 of the trunk every baseline starts from: the imported base, before any sync merged the experts'
    attention copies into it (RunDir.first_trunk)."""
    return read_module(rd, 0, at=rd.first_trunk).sha256


def first_trunk_view(rd: RunDir, out: Path) -> RunDir | None:
    """A RUN view (out/trained-trunk) whose trunk is the one before the first sync; None if never synced. The
    per-domain LoRAs are served on it, the base they trained from, and eval scores it as the trunk as trained."""
    if rd.first_trunk[0] == rd.module_file(0):
        return None
    view = RunDir(out / "trained-trunk")
    view.modules.mkdir(parents=True, exist_ok=True)
    rd.copy_vocab_to(view)  # an imported base's vocabulary lives in base/, not tokenizer.json
    for src in rd.first_trunk:
        dst = view.modules / src.name
        dst.unlink(missing_ok=True)
        link_or_copy(src, dst)
    update_manifest(view, 0, read_module(view, 0))
    return view


def expert_flops(meta: ModuleMeta) -> float:
    """An expert's training FLOPs, the budget its baselines match: its record's (mfgguf/flops.py), or the FLOPs a
    planned expert carries (`planned_flops`: `mfgguf eval --budget-flops`, eval/baselines/budgeted.py)."""
    return float(meta.planned_flops) if meta.planned_flops is not None else module_flops(meta)


def matched_tokens(flops: float, per_token: float, step: int) -> int:
    """The tokens, in whole optimizer steps of `step` tokens (at least one), that spend `flops` at `per_token` a token."""
    return max(step, round(flops / per_token / step) * step)


def train_base(rd: RunDir, run: Path, *, mode: str, tokens: int, lr: float, shards: list[int], trunk_sha256: str,
               force: bool = False, needs: tuple[str, ...] = (), seed: int | None = None, weights: bool = True) -> ModuleMeta:
    """`mfgguf train-base` into `run`, unless `run` already holds this very training (and the files `needs` names);
    its module record either way. weights=False: only the record and `needs` are kept, and the trained trunk
    train-base writes is deleted (an adapter served unmerged never reads the merged weights)."""
    view = RunDir(run)
    # a record without a seed was trained without --seed, as seed None trains
    want = {"mode": mode, "lr": lr, "shards": shards, "from_trunk_sha256": trunk_sha256, "seed": seed}
    # a record without its weights (a study pruned them) is trained again rather than read, unless they are not wanted
    files = (view.module_meta(0), *([view.module_file(0)] if weights else []), *(run / n for n in needs))
    if not force and all(f.is_file() for f in files):
        m = read_module(view, 0, weights_kept=weights)
        # train-base trains whole steps of its own batch, which may not divide the tokens asked for: the record's
        # request is what must match (a record older than that field, its tokens seen)
        asked = m.train.get("tokens", m.tokens_seen)
        if tokens in (asked, m.tokens_seen) and all((m.continued or {}).get(k) == v for k, v in want.items()):
            return m
    run_stage(f"train-base {run.name}", ["train-base", rd.root, "-o", run, "--mode", mode, "--tokens", tokens, "--lr", lr,
                                         "--shards", ",".join(map(str, shards)), "--no-progress", "--force",
                                         *(["--seed", seed] if seed is not None else [])])
    if not weights:
        view.module_file(0).unlink(missing_ok=True)
    return read_module(view, 0, weights_kept=weights)


def train_domain_loras(rd: RunDir, metas: dict[int, ModuleMeta], out: Path, lr: float, force: bool = False,
                       seed: int | None = None) -> list[DomainAdapter]:
    """Train (or reuse) one LoRA per trained expert's shard, each for that expert's FLOPs; metas: {0: trunk, i: expert}.
    Only each adapter and its record are kept: the merged trunk a LoRA also yields is a whole base's weights, which
    at a hundred clusters would be a hundred bases on the disk."""
    cfg = ModelConfig.from_dict(metas[0].config)
    per_step = continued_step_flops(cfg, "lora").total
    first = first_trunk_sha256(rd)
    adapters = []
    for i, m in sorted((i, m) for i, m in metas.items() if i > 0):
        step = int(m.train["batch_size"]) * cfg.ctx_len
        tokens = matched_tokens(expert_flops(m), per_step, step)
        shard, run = int(m.shard), out / f"lora-shard{m.shard}"
        train_base(rd, run, mode="lora", tokens=tokens, lr=lr, shards=[shard], trunk_sha256=first,
                   force=force, needs=(ADAPTER_FILE,), seed=seed, weights=False)
        held = m.shard_domains or ()  # {domain: tokens} where run.json counts them
        weights = tuple(int(held[d]) for d in held) if isinstance(held, dict) else ()
        adapters.append(DomainAdapter(shard, tuple(held), tokens, lr, run, weights))
    return adapters


class Imported:
    """The side of an imported base: the base trained further, continued pretraining and LoRA, each LR from GRID."""

    kinds = IMPORTED

    def train(self, job: Job) -> Outcome:
        plans, grid = [], {}
        if job.schedules is not None:  # dense training asked for: the practitioner's alternatives
            _say("the trunk is an imported base: its baselines are the base trained further on the experts' data"
                 " (continued pretraining, LoRA), not dense models from scratch")
            which = tuple(k for k in job.which if k in keys(IMPORTED)) if job.which is not None else None
            plans, grid = plan_and_train(job.rd, job.metas, job.out, which, job.force, job.seed, job.lrs)
        trained = sorted({d for i, m in job.metas.items() if i for d in m.shard_domains or []})
        section = {"grid": grid, "plans": [_plan_json(p) for p in plans], "trained_domains": trained}
        return Outcome(trained=[_trained(p) for p in plans], sections={"base_baselines": section})


def _plan_json(p: BasePlan) -> dict:
    d = {**asdict(p), "run": str(p.run)}
    del d["adapters"]
    if p.adapters:
        d["adapters"] = [{"shard": a.shard, "domains": list(a.domains), "tokens": a.tokens, "run": str(a.run)}
                         for a in p.adapters]
    return d


def _trained(p: BasePlan) -> Trained:
    metas = ([read_module(RunDir(a.run), 0, weights_kept=False) for a in p.adapters]
             or [read_module(RunDir(p.run), 0)])
    spent, seen = sum(module_flops(m) for m in metas), sum(m.tokens_seen for m in metas)
    row = {"kind": "dense", "baseline": p.key, "mode": p.mode, "tokens": p.tokens, "lr": p.lr}
    if p.adapters:  # the base's GGUF, each domain scored with its shard's adapter; every one a candidate of the stream
        row["adapters"] = {d: str(a.adapter) for d, a in domain_owners(list(p.adapters)).items()}
        row["every_adapter"] = [str(a.adapter) for a in p.adapters]
    return Trained(p.key, p.label, p.run, f"base-{p.key}", row=row,
                   flops={"tokens": seen, "flops": spent, "lr": p.lr, "mode": p.mode,
                          "flops_per_token": spent / max(1, seen), f"budget_{_KIND[p.key].budget}": p.budget})


def critical_path_s(rd: RunDir, experts: dict[int, ModuleMeta]) -> float:
    """Seconds of the MoE's critical path with a machine per expert: the slowest expert's walls summed over its rounds,
    plus the wall of every sync."""
    walls, syncs = expert_walls(rd, experts)
    return max(walls.values()) + syncs


def expert_walls(rd: RunDir, experts: dict[int, ModuleMeta]) -> tuple[dict[int, float], float]:
    """({i: expert i's walls summed over its rounds}, the walls of every sync summed); experts: {i: expert i's record}.
    Each round's record is kept under rounds/sync_k/before/, each sync's wall in its plan; each wall with the start
    of the process that ran it (`startup_s`: the imports before its clock; records made before it was kept lack it)."""
    plans = sorted(rd.rounds.glob("sync_*/sync.json")) if rd.rounds.is_dir() else []
    walls = {}
    for i, m in experts.items():
        rounds = [ModuleMeta.from_json(read_json(f, "a round's expert record")) for p in plans
                  if (f := p.parent / "before" / rd.module_meta(i).name).is_file()]
        if (m.round or 1) > max(((r.round or 1) for r in rounds), default=0):
            rounds.append(m)  # a round trained since the last sync (or no sync at all); a restat keeps its round
        walls[i] = sum(float(r.wall_s or r.train_s) + float(r.startup_s or 0.0) for r in rounds)
    syncs = sum((s := SyncPlan.from_json(read_json(p, "a sync plan"))).wall_s + s.startup_s for p in plans)
    return walls, syncs


def _say(msg: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[bold cyan]eval[/] {msg}", highlight=False)


__all__ = ["GRID", "IMPORTED", "BasePlan", "Imported", "plan_and_train", "critical_path_s", "expert_flops", "expert_walls",
           "matched_tokens",
           "train_base", "train_domain_loras"]
