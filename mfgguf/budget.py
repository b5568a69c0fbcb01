"""Fit a pipeline's training tokens to a wall-clock budget, from the speed measured on this CPU.

CPUs of the same machine kind train several times apart (docs/benchmarks.md; native bf16 and AMX, or fp32 on AVX2 alone), so
`mfgguf demo --minutes M` measures a few trunk steps first (train/engine/speed.py) and scales the trunk's
and every expert's tokens by one factor so that the whole recipe (trunk, every expert round, the
syncs, assembly, perplexity, generation) fits in M minutes. Torch-free: it only does arithmetic.

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

STAGE_S = 8.0  # fixed seconds per training process: interpreter, torch import, loading the trunk, writing
FINAL_S = 90.0  # assembly of the MoE and the trunk alone, two perplexity runs by llama.cpp, a generation
MIN_FACTOR = 0.2  # below a fifth of the preset's tokens the demo would show little: say so instead


@dataclass(frozen=True)
class TokenPlan:
    factor: float  # share of the requested tokens that fits (at most 1)
    trunk_tokens: int
    expert_tokens: int  # per expert
    predicted_s: float  # the whole run's predicted wall time with these tokens
    train_s: float  # of which training steps

    def to_dict(self) -> dict:
        return asdict(self)


def plan_tokens(*, budget_s: float, elapsed_s: float, trunk_tps: float, expert_tps: float, trunk_tokens: int,
                expert_tokens: int, n_experts: int, rounds: int, eval_tokens: int, n_domains: int,
                syncs: int | None = None) -> TokenPlan:
    """Scale trunk and expert tokens by one factor (at most 1) so the predicted run fits `budget_s`."""
    syncs = rounds if syncs is None else syncs
    forward_tokens = (n_domains * eval_tokens  # the trunk's held-out score
                      + n_experts * (n_domains + 4) * eval_tokens  # each expert's held-out score and statistics
                      + (n_experts + 1) * 4 * eval_tokens * (1 if syncs else 0))  # the final sync's pooled statistics
    fixed = (elapsed_s + STAGE_S * (1 + n_experts * rounds + syncs) + FINAL_S
             + forward_tokens / (2.5 * min(trunk_tps, expert_tps)))
    full_train = trunk_tokens / trunk_tps + n_experts * expert_tokens / expert_tps
    factor = min(1.0, max(0.0, budget_s - fixed) / full_train)
    if factor < MIN_FACTOR:
        need = (fixed + MIN_FACTOR * full_train) / 60
        raise MfggufError(f"this CPU trains {trunk_tps:,.0f} tokens/s: the recipe needs about {need:.0f} minutes even"
                          f" at {MIN_FACTOR:.0%} of its tokens; pass --minutes {need + 1:.0f} or more, or --minutes 0"
                          " to train the preset's tokens whatever the time")
    t, e = int(trunk_tokens * factor), int(expert_tokens * factor)
    train = t / trunk_tps + n_experts * e / expert_tps
    return TokenPlan(factor=factor, trunk_tokens=t, expert_tokens=e, predicted_s=fixed + train, train_s=train)
