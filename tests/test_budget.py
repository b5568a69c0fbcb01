"""The demo's time budget: token counts scaled to fit a wall-clock budget from a measured speed."""

from __future__ import annotations

import pytest

from mfgguf.budget import FINAL_S, MAX_FACTOR, MIN_FACTOR, plan_tokens, refit_experts
from mfgguf.errors import MfggufError

DEMO = dict(trunk_tokens=1_200_000, expert_tokens=320_000, n_experts=3, rounds=4, eval_tokens=16384, n_domains=3)


def test_a_very_fast_cpu_trains_the_cap_and_finishes_early():
    plan = plan_tokens(budget_s=780, elapsed_s=20, trunk_tps=20_000, expert_tps=20_000, **DEMO)
    assert plan.factor == MAX_FACTOR and plan.trunk_tokens == 1_200_000 * MAX_FACTOR
    assert plan.expert_tokens == 320_000 * MAX_FACTOR and plan.predicted_s < 780


@pytest.mark.parametrize("tps", [1_500, 2_000, 3_000])
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


def test_a_fast_cpu_trains_more_than_the_default_up_to_the_cap():
    plan = plan_tokens(budget_s=780, elapsed_s=20, trunk_tps=8_000, expert_tps=8_000, **DEMO)
    assert 1.0 < plan.factor < MAX_FACTOR and plan.predicted_s == pytest.approx(780, abs=1.0)
    capped = plan_tokens(budget_s=780, elapsed_s=20, trunk_tps=200_000, expert_tps=200_000, **DEMO)
    assert capped.factor == MAX_FACTOR and capped.predicted_s < 780


def test_the_experts_are_sized_again_from_the_time_left_after_the_trunk():
    """A first plan that read the CPU at half its speed leaves time once the trunk is done; the refit spends it."""
    first = plan_tokens(budget_s=780, elapsed_s=20, trunk_tps=1_500, expert_tps=1_500, **DEMO)
    trunk_s = 20 + first.trunk_tokens / 3_000 + 30  # the trunk really trained at twice the speed read
    e = {k: DEMO[k] for k in ("expert_tokens", "n_experts", "rounds", "eval_tokens", "n_domains")}
    refit = refit_experts(budget_s=780, elapsed_s=trunk_s, expert_tps=3_000, **e)
    assert refit.expert_tokens > first.expert_tokens and refit.predicted_s == pytest.approx(780, abs=1.0)
    late = refit_experts(budget_s=780, elapsed_s=770, expert_tps=3_000, **e)  # no time left: the least it trains
    assert late.factor == MIN_FACTOR
