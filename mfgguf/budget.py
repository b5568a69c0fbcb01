"""Fit a pipeline's training tokens to a wall-clock budget, from the speed measured on this CPU.

CPUs of the same machine kind train several times apart (docs/benchmarks.md; native bf16 and AMX, or fp32 on AVX2 alone), so
`mfgguf demo --minutes M` measures a few trunk steps first (train/engine/speed.py) and scales the trunk's
and every expert's tokens by one factor (at most MAX_FACTOR: a fast CPU trains more than the default, up to
that) so that the whole recipe (trunk, every expert round, the syncs, assembly, perplexity, generation) fits
in M minutes. A few steps measured right after `prepare` can be far off the speed a long stage settles at,
so once the trunk has trained, `refit_experts` sizes the experts again from what the trunk really took: the
time left, at the trunk's own tokens/s. Torch-free: it only does arithmetic.

The time model, per stage: training tokens / tokens per second; forward-only passes (held-out
scores, router statistics) at 2.5 times the training speed (a forward is about a third of a step); a
fixed cost for each process (interpreter, torch import, loading) and for the stages that train
nothing (assembly, llama.cpp's perplexity, generation).

Example:
    >>> plan = plan_tokens(budget_s=780, elapsed_s=20, trunk_tps=5000, expert_tps=5000, trunk_tokens=1_200_000,
    ...                    expert_tokens=320_000, n_experts=3, rounds=4, eval_tokens=16384, n_domains=3)
    >>> round(plan.factor, 2) <= 1.0
    True
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mfgguf.errors import MfggufError

STAGE_S = 3.0  # fixed seconds per training stage and sync: loading the trunk, writing (measured 1.2-4.7 with bf16)
FINAL_S = 20.0  # assembly of the MoE and the trunk alone, two perplexity runs by llama.cpp, a generation (measured 13)
MIN_FACTOR = 0.2  # below a fifth of the preset's tokens the demo would show little: say so instead
MAX_FACTOR = 2.5  # at most this many times the default tokens: what the built-in corpus holds about once


@dataclass(frozen=True)
class TokenPlan:
    factor: float  # share of the requested tokens that fits (at most MAX_FACTOR)
    trunk_tokens: int
    expert_tokens: int  # per expert
    predicted_s: float  # the whole run's predicted wall time with these tokens
    train_s: float  # of which training steps

    def to_dict(self) -> dict:
        return asdict(self)


def plan_tokens(*, budget_s: float, elapsed_s: float, trunk_tps: float, expert_tps: float, trunk_tokens: int,
                expert_tokens: int, n_experts: int, rounds: int, eval_tokens: int, n_domains: int,
                syncs: int | None = None) -> TokenPlan:
    """Scale trunk and expert tokens by one factor (at most MAX_FACTOR) so the predicted run fits `budget_s`."""
    syncs = rounds if syncs is None else syncs
    fixed = elapsed_s + STAGE_S + n_domains * eval_tokens / (2.5 * trunk_tps) + _after_trunk(
        expert_tps, n_experts=n_experts, rounds=rounds, syncs=syncs, eval_tokens=eval_tokens, n_domains=n_domains)
    full_train = trunk_tokens / trunk_tps + n_experts * expert_tokens / expert_tps
    factor = min(MAX_FACTOR, max(0.0, budget_s - fixed) / full_train)
    if factor < MIN_FACTOR:
        need = (fixed + MIN_FACTOR * full_train) / 60
        raise MfggufError(f"this CPU trains {trunk_tps:,.0f} tokens/s: the recipe needs about {need:.0f} minutes even"
                          f" at {MIN_FACTOR:.0%} of its tokens; pass --minutes {need + 1:.0f} or more, or --minutes 0"
                          " to train the preset's tokens whatever the time")
    t, e = int(trunk_tokens * factor), int(expert_tokens * factor)
    train = t / trunk_tps + n_experts * e / expert_tps
    return TokenPlan(factor=factor, trunk_tokens=t, expert_tokens=e, predicted_s=fixed + train, train_s=train)


def _after_trunk(expert_tps: float, *, n_experts: int, rounds: int, syncs: int, eval_tokens: int, n_domains: int) -> float:
    """Seconds of everything after the trunk but the experts' training steps: their processes, their held-out
    scores and statistics, the syncs, the final stages."""
    # each expert's held-out score and statistics; the router's come from moments its training steps recorded
    forward_tokens = n_experts * (n_domains + 4) * eval_tokens
    return STAGE_S * (n_experts * rounds + syncs) + FINAL_S + forward_tokens / (2.5 * expert_tps)


def refit_experts(*, budget_s: float, elapsed_s: float, expert_tps: float, expert_tokens: int, n_experts: int,
                  rounds: int, eval_tokens: int, n_domains: int, syncs: int | None = None) -> TokenPlan:
    """Each expert's tokens (`expert_tokens` x a factor of at most MAX_FACTOR) that fill the budget left after
    `elapsed_s` (the trunk trained), at `expert_tps` (the trunk's measured speed x the step FLOPs' ratio); at least
    MIN_FACTOR of them, whatever the time."""
    syncs = rounds if syncs is None else syncs
    fixed = elapsed_s + _after_trunk(expert_tps, n_experts=n_experts, rounds=rounds, syncs=syncs,
                                     eval_tokens=eval_tokens, n_domains=n_domains)
    full = n_experts * expert_tokens / expert_tps
    factor = min(MAX_FACTOR, max(MIN_FACTOR, (budget_s - fixed) / full))
    e = int(expert_tokens * factor)
    return TokenPlan(factor=factor, trunk_tokens=0, expert_tokens=e, predicted_s=fixed + n_experts * e / expert_tps,
                     train_s=n_experts * e / expert_tps)
