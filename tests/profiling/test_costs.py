"""The step-cost model: interpolation of measured t(k)/t(1), predictions, and the tuning rule."""

import pytest

from cllm.profiling.costs import (
    COST_2_THREADS,
    COST_K,
    MAX_BLOCK,
    choose_defaults,
    speedup_vs_ar,
    step_cost,
    tokens_per_second,
)

KS = [1, 2, 4, 8, 16, 32, 64]


def test_step_cost_is_the_measured_ratio_at_every_measured_k():
    for k, r in zip(COST_K, COST_2_THREADS):
        assert step_cost(k, COST_2_THREADS) == pytest.approx(r)


def test_step_cost_is_linear_between_and_proportional_past_the_last_k():
    assert step_cost(3, COST_2_THREADS) == pytest.approx((1.09 + 1.24) / 2)
    assert step_cost(64, COST_2_THREADS) == pytest.approx(2 * 2.13)
    assert step_cost(6, [1.0, 3.0], ks=[1, 11]) == pytest.approx(2.0)


def test_step_cost_refuses_ratios_that_do_not_match_the_ks():
    with pytest.raises(ValueError):
        step_cost(4, [1.0, 1.1])


def test_predicted_speedup_is_tpf_times_t1_over_tk():
    assert speedup_vs_ar(3.0, 0.010, 0.015) == pytest.approx(2.0)
    assert tokens_per_second(3.0, 0.015) == pytest.approx(200.0)


def test_the_development_cpu_ratios_give_its_measured_best_setting():
    chosen = choose_defaults(COST_K, COST_2_THREADS)
    assert chosen.block_size == 4  # RECOMMENDED's block size
    assert 20 <= chosen.recycle_budget <= 28  # RECOMMENDED's budget is 24
    assert chosen.budget_cost <= 2.0 and "block size 4" in chosen.why


def test_a_flat_step_cost_gives_the_largest_block_and_budget():
    chosen = choose_defaults(KS, [1.0, 1.0, 1.01, 1.02, 1.05, 1.1, 1.3])
    assert (chosen.block_size, chosen.recycle_budget) == (MAX_BLOCK, 64)


def test_a_steep_step_cost_falls_back_to_autoregressive_steps():
    chosen = choose_defaults(KS, [1.0, 2.5, 4, 8, 16, 32, 64])
    assert (chosen.block_size, chosen.recycle_budget) == (1, 1)


def test_a_noisy_dip_after_an_expensive_k_does_not_count():
    chosen = choose_defaults(KS, [1.0, 1.1, 1.5, 1.2, 1.25, 3.0, 6.0])
    assert chosen.block_size == 2  # k = 4 costs over 1.3; k = 8 and 16's dip is past it


def test_the_rule_needs_k_1_first():
    with pytest.raises(ValueError):
        choose_defaults([2, 4], [1.0, 1.1])
