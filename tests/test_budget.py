"""The demo's time budget: token counts scaled to fit a wall-clock budget from a measured speed."""

from __future__ import annotations

import pytest

from mfgguf.budget import FINAL_S, plan_tokens
from mfgguf.errors import MfggufError

DEMO = dict(trunk_tokens=1_200_000, expert_tokens=320_000, n_experts=3, rounds=4, eval_tokens=16384, n_domains=3)


def test_a_fast_cpu_trains_every_token():
    plan = plan_tokens(budget_s=780, elapsed_s=20, trunk_tps=20_000, expert_tps=20_000, **DEMO)
    assert plan.factor == 1.0 and plan.trunk_tokens == 1_200_000 and plan.expert_tokens == 320_000
    assert plan.predicted_s < 780


@pytest.mark.parametrize("tps", [2_000, 3_000, 4_000])
def test_a_slow_cpu_scales_both_token_counts_to_the_budget(tps):
    plan = plan_tokens(budget_s=780, elapsed_s=20, trunk_tps=tps, expert_tps=tps, **DEMO)
    assert 0.2 <= plan.factor < 1.0
    assert plan.predicted_s == pytest.approx(780, abs=1.0)  # it uses the budget, no more
    assert plan.trunk_tokens / 1_200_000 == pytest.approx(plan.expert_tokens / 320_000, rel=1e-4)
    slower = plan_tokens(budget_s=780, elapsed_s=20, trunk_tps=tps * 0.9, expert_tps=tps * 0.9, **DEMO)
    assert slower.trunk_tokens < plan.trunk_tokens


def test_a_budget_too_small_for_the_recipe_says_how_many_minutes_it_needs():
    with pytest.raises(MfggufError, match=r"needs about \d+ minutes.*pass --minutes \d+ or more"):
        plan_tokens(budget_s=FINAL_S + 10, elapsed_s=20, trunk_tps=5_000, expert_tps=5_000, **DEMO)
