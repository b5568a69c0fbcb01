"""Dense baselines trained from scratch for `mfgguf eval`, budgeted in training FLOPs (eval/training_flops.py),
not in tokens: the side of a trunk this RUN trained (an imported base's side: eval/baselines/imported.py).

Each baseline is a trunk (every parameter trains, anchor FFN only) trained from scratch with the same
code (`train-trunk` on a copy of the RUN that shares its data) and the trunk's hyperparameters:
  - flop:      the MoE's active FFN width per token (anchor_ff + expert_ff) for as many tokens as
               spend the modular run's total training FLOPs: trunk + every expert job, each at its
               own cost per token;
  - wallclock: the same shape for the FLOPs of the critical path only: trunk + R x one round of the
               longest expert job, as if every expert ran on its own machine (the parallel promise);
  - total:     the MoE's total FFN width (anchor_ff + N * expert_ff), FLOP-matched like `flop`.
               Trained by default only while that width is at most TOTAL_MAX_RATIO x anchor_ff:
               wider, it is a much bigger model than anything the modular run ever held in memory,
               which is the point of building it modularly.
Tokens are rounded to whole optimizer steps, so a baseline's FLOPs are within half a step of its budget.
Each baseline trains with every LR schedule asked for (`--dense-schedules`, default cosine and wsd, the
trunk's cooldown share) at the same tokens, and keeps the better: the one with the lower held-out
loss its training measured (`pick_schedule`). That split is the one `eval` scores, so the choice
can only favour the dense model, never the MoE; one schedule trains each baseline once instead.

Example:
    >>> plans = plan_baselines(metas, ("flop", "wallclock"))
    >>> [(p.label, p.tokens) for p in plans]
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from mfgguf.config import SCHEDULES, ModelConfig
from mfgguf.errors import MfggufError
from mfgguf.eval.baselines.baseline import Job, Kind, Outcome, Trained, keys
from mfgguf.eval.training_flops import run_flops, tokens_for_flops
from mfgguf.flops import module_flops, trunk_step_flops
from mfgguf.run import ModuleMeta, RunDir, data_view, read_module
from mfgguf.stages import run_stage

SCRATCH = (Kind("flop", "dense, FLOP-matched", budget="total", trains="active"),
           Kind("wallclock", "dense, wall-clock-matched", budget="critical_path", trains="active"),
           Kind("total", "dense, total params, FLOP-matched", budget="total", trains="total"))
TOTAL_MAX_RATIO = 4  # train the total-parameter baseline by default while anchor_ff + N * expert_ff <= 4 x anchor_ff


@dataclass(frozen=True)
class Baseline:
    key: str  # flop, wallclock or total
    label: str  # the report's row name
    anchor_ff: int  # its FFN width
    budget_flops: float  # training FLOPs it is given
    tokens: int  # training tokens: whole steps spending budget_flops (nearest)
    flops_per_token: float  # its training step FLOPs per token


class Scratch:
    """The side of a trunk trained here: dense models trained like it, each with every schedule asked for."""

    kinds = SCRATCH

    def train(self, job: Job) -> Outcome:
        schedules = check_schedules(job.schedules) if job.schedules is not None else ()
        outcome = Outcome(sections={"dense_schedules": {}})
        for b in plan_baselines(job.metas, job.which):
            runs = {s: train_baseline(job.rd, job.metas[0], b, job.out, job.force, schedule=s, seed=job.seed)
                    for s in schedules}
            trained = {s: read_module(d, 0) for s, d in runs.items()}
            chosen, m = pick_schedule(trained)
            outcome.sections["dense_schedules"][b.label] = {
                "chosen": chosen, "validation_loss": {s: t.validation_loss_mean for s, t in trained.items()}}
            outcome.curves[b.label] = m  # report.curves reads its validation history
            outcome.trained.append(Trained(
                b.key, b.label, runs[chosen].root, runs[chosen].root.name,  # dense-<key>[-<schedule>]: the one kept
                row={"kind": "dense", "baseline": b.key, "anchor_ff": b.anchor_ff, "tokens": m.tokens_seen,
                     "schedule": chosen},
                flops={"tokens": m.tokens_seen, "flops": module_flops(m), "budget_flops": b.budget_flops,
                       "anchor_ff": b.anchor_ff, "flops_per_token": b.flops_per_token,
                       "schedule": m.schedule}))
        return outcome


def check_schedules(schedules: tuple[str, ...]) -> tuple[str, ...]:
    """The LR schedules asked for, each once; an unknown one is an error before anything trains."""
    bad = [s for s in schedules if s not in SCHEDULES]
    if bad or not schedules:
        raise MfggufError(f"bad dense schedules {','.join(schedules)!r}; choose from {', '.join(SCHEDULES)}"
                          " (comma-separated)")
    return tuple(dict.fromkeys(schedules))


def default_baselines(cfg: ModelConfig, n_experts: int) -> tuple[str, ...]:
    """flop and wallclock always; total while its FFN is at most TOTAL_MAX_RATIO x the anchor."""
    total_ff = cfg.anchor_ff + n_experts * cfg.expert_ff
    return ("flop", "wallclock") + (("total",) if total_ff <= TOTAL_MAX_RATIO * cfg.anchor_ff else ())


def plan_baselines(metas: dict[int, ModuleMeta], which: tuple[str, ...] | None = None) -> list[Baseline]:
    """The baselines to train for a modular run (metas: {0: the trunk's record, i: expert i's})."""
    trunk = metas[0]
    cfg = ModelConfig.from_dict(trunk.config)
    n = len([i for i in metas if i > 0])
    which = default_baselines(cfg, n) if which is None else tuple(k for k in which if k in keys(SCRATCH))
    fl = run_flops(metas)
    per_step = trunk.train["batch_size"] * cfg.ctx_len
    ff = {"active": cfg.anchor_ff + cfg.expert_ff, "total": cfg.anchor_ff + n * cfg.expert_ff}
    kinds = {k.key: k for k in SCRATCH}
    plans = []
    for kind in (kinds[k] for k in which):
        dense = replace(cfg, anchor_ff=ff[kind.trains], seed_expert=False)
        budget = fl[kind.budget]
        plans.append(Baseline(kind.key, kind.label, ff[kind.trains], budget, tokens_for_flops(budget, dense, per_step),
                              trunk_step_flops(dense).total))
    return plans


def train_baseline(rd: RunDir, trunk: ModuleMeta, b: Baseline, out: Path, force: bool = False,
                   schedule: str = "cosine", seed: int | None = None) -> RunDir:
    """Train (once) baseline `b` with LR `schedule` in out/dense-<key> (cosine) or out/dense-<key>-<schedule>,
    a copy of RUN sharing its data; return that RUN. `seed`: its init and data order (None: the trunk's).

    Reused when its recorded shape, tokens, schedule and seed match the plan; retrained (its directory
    replaced) when they do not, e.g. after the experts were retrained, or with `force`.
    """
    dense = RunDir(out / (f"dense-{b.key}" if schedule == "cosine" else f"dense-{b.key}-{schedule}"))
    tc = trunk.train
    seed = tc["seed"] if seed is None else int(seed)
    if dense.module_meta(0).is_file() and not force:
        m = read_module(dense, 0)
        if (m.config["anchor_ff"] == b.anchor_ff and m.tokens_seen == b.tokens
                and m.schedule == schedule and m.train.get("seed") == seed):
            return dense
        _say(f"{b.label}: the plan changed (anchor_ff {m.config['anchor_ff']} -> {b.anchor_ff},"
             f" tokens {m.tokens_seen:,} -> {b.tokens:,}, seed {m.train.get('seed')} -> {seed}); retraining")
    dense = data_view(rd, dense.root)  # our own output, not user work: a stale baseline or an interrupted one goes
    same = {"--batch-size": tc["batch_size"], "--lr": tc["lr"], "--seed": seed, "--eval-tokens": tc["eval_tokens"],
            "--eval-every": tc.get("eval_every"), "--curve-tokens": tc.get("curve_tokens"),
            "--ckpt-every": tc.get("ckpt_every")}  # None: older trunk
    args = [a for k, v in same.items() if v is not None for a in (k, v)]
    # batch_size is already the whole step's (x --accum); a streamed trunk's budget binds its baselines
    # too, and any baseline over the RAM available streams by itself (train_trunk's estimate)
    args += ["--accum", 1] + (["--memory-budget", trunk.streamed["memory_budget"]] if trunk.streamed else [])
    args += ["--schedule", schedule] + (["--cooldown", tc.get("cooldown", 0.2)] if schedule == "wsd" else [])
    _say(f"train {b.label} ({schedule}): anchor_ff {b.anchor_ff}, {b.tokens:,} tokens, {b.budget_flops:.3e} FLOPs budget")
    run_stage(f"train {b.label} ({schedule})", ["train-trunk", dense.root, "--preset", trunk.preset, "--tokens", b.tokens,
                                   "--anchor-ff", b.anchor_ff, "--precision", trunk.precision or "auto",
                                   "--no-progress", *args])
    return dense


def pick_schedule(metas: dict[str, ModuleMeta]) -> tuple[str, ModuleMeta]:
    """{schedule: a baseline's module record trained with it} -> (the better schedule: lowest held-out loss, its record)."""
    best = min(metas, key=lambda s: metas[s].validation_loss_mean)
    return best, metas[best]


def _say(msg: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[bold cyan]eval[/] {msg}", highlight=False)


__all__ = ["SCRATCH", "TOTAL_MAX_RATIO", "Baseline", "Scratch", "check_schedules", "default_baselines", "plan_baselines",
           "train_baseline", "pick_schedule"]
