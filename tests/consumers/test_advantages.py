"""Advantages and offline weights on hand-built rows; expected values are worked out in the comments."""

import math

import numpy as np
import pytest

from consumers.advantages import (
    awr_weights,
    compute_advantages,
    discounted_returns_to_go,
    filtered_bc_mask,
    group_relative,
    raw_returns,
    returns_to_go,
    training_weights,
)
from schemas.config import LearnerConfig


def test_group_relative_subtracts_each_group_mean_and_zeroes_singletons():
    # group a: rewards 1, 3, 5 -> mean 3 -> -2, 0, 2.  b and c hold one row each -> 0.
    rewards = [1.0, 3.0, 10.0, 5.0, 2.0]
    groups = ["a", "a", "b", "a", "c"]  # groups need not be contiguous
    np.testing.assert_allclose(group_relative(rewards, groups), [-2.0, 0.0, 0.0, 2.0, 0.0])


def test_group_relative_normalised_by_population_std():
    # group a: deviations -2, 0, 2; population std sqrt((4 + 0 + 4) / 3) = sqrt(8/3) = 1.63299
    # -> -2/1.63299 = -1.22474, 0, 1.22474.  group b: 0, 4 -> deviations -2, 2, std 2 -> -1, 1.
    rewards = [1.0, 3.0, 5.0, 0.0, 4.0]
    groups = ["a", "a", "a", "b", "b"]
    got = group_relative(rewards, groups, normalize_std=True, eps=0.0)
    np.testing.assert_allclose(got, [-1.2247449, 0.0, 1.2247449, -1.0, 1.0], rtol=1e-6)
    # each normalised group has unit population variance
    assert got[:3].std() == pytest.approx(1.0)


def test_group_relative_constant_group_and_singleton_stay_zero_when_normalised():
    got = group_relative([0.7, 0.7, 0.7, 5.0], [1, 1, 1, 2], normalize_std=True)
    np.testing.assert_allclose(got, [0.0, 0.0, 0.0, 0.0], atol=1e-8)


def test_group_relative_rejects_bad_input():
    with pytest.raises(ValueError, match="rows"):
        group_relative([1.0, 2.0], ["a"])
    with pytest.raises(ValueError, match="finite"):
        group_relative([1.0, math.nan], ["a", "a"])


def test_raw_returns_is_a_float_copy():
    rewards = np.array([1, -2, 3])
    got = raw_returns(rewards)
    np.testing.assert_array_equal(got, [1.0, -2.0, 3.0])
    got[0] = 99.0
    assert rewards[0] == 1  # the caller's column is untouched


def test_returns_to_go_baseline_per_group_and_turn():
    # one group "g", two episodes: e1 has turns 0, 1, 2 with return-to-go 3, 2, 1; e2 has turns 0, 1 with 2, 1.
    # turn 0: mean(3, 2) = 2.5 -> +0.5 (e1), -0.5 (e2); turn 1: mean(2, 1) = 1.5 -> +0.5, -0.5;
    # turn 2: only e1 got there -> 0.  A second group "h" at turn 0 does not mix with "g".
    rtg = [3.0, 2.0, 1.0, 2.0, 1.0, 7.0]
    groups = ["g", "g", "g", "g", "g", "h"]
    turns = [0, 1, 2, 0, 1, 0]
    np.testing.assert_allclose(returns_to_go(rtg, groups, turns), [0.5, 0.5, 0.0, -0.5, -0.5, 0.0])
    np.testing.assert_allclose(returns_to_go(rtg, baseline=False), rtg)


def test_returns_to_go_needs_columns_for_a_baseline():
    with pytest.raises(ValueError, match="turns_R"):
        returns_to_go([1.0, 2.0], ["g", "g"])
    with pytest.raises(ValueError, match="baseline"):
        returns_to_go([1.0, 2.0], baseline=False, normalize_std=True)


def test_compute_advantages_dispatches_on_kind():
    rewards = [1.0, 3.0, 4.0, 8.0]
    groups = ["a", "a", "b", "b"]
    np.testing.assert_allclose(compute_advantages("group", rewards, groups), [-1.0, 1.0, -2.0, 2.0])
    np.testing.assert_allclose(
        compute_advantages("group", rewards, groups, normalize_std=True, eps=0.0), [-1, 1, -1, 1]
    )
    np.testing.assert_allclose(compute_advantages("raw", rewards, groups), rewards)
    rtg = [5.0, 1.0, 2.0, 2.0]
    turns = [0, 0, 0, 1]
    # (a, 0): 5, 1 -> +2, -2; (b, 0): 2 alone -> 0; (b, 1): 2 alone -> 0
    got = compute_advantages("return_to_go", rewards, groups, returns_to_go_R=rtg, turns_R=turns)
    np.testing.assert_allclose(got, [2.0, -2.0, 0.0, 0.0])
    got = compute_advantages(
        "return_to_go", rewards, groups, returns_to_go_R=rtg, turns_R=turns, return_to_go_baseline=False
    )
    np.testing.assert_allclose(got, rtg)


def test_compute_advantages_refuses_impossible_options():
    with pytest.raises(ValueError, match="normalize_advantage_std"):
        compute_advantages("raw", [1.0], ["a"], normalize_std=True)
    with pytest.raises(ValueError, match="return_to_go column"):
        compute_advantages("return_to_go", [1.0], ["a"])
    with pytest.raises(ValueError, match="choose one of"):
        compute_advantages("vtrace", [1.0], ["a"])  # type: ignore[arg-type]


def test_awr_weights_exponentiate_and_cap():
    # beta 2: exp(0/2) = 1, exp(1/2) = 1.6487, exp(-2/2) = 0.36788, exp(10/2) = 148.4 -> capped at 20;
    # 1e6 would overflow exp() if the cap were applied after it.
    got = awr_weights([0.0, 1.0, -2.0, 10.0, 1e6], beta=2.0, max_weight=20.0)
    np.testing.assert_allclose(got, [1.0, 1.6487213, 0.36787944, 20.0, 20.0], rtol=1e-6)
    with pytest.raises(ValueError, match="beta"):
        awr_weights([0.0], beta=0.0, max_weight=1.0)


def test_filtered_bc_keeps_top_fraction_with_earlier_row_winning_ties():
    returns = [1.0, 5.0, 3.0, 5.0, 2.0]
    # fraction 0.4 of 5 rows -> 2 rows: the two 5s
    np.testing.assert_array_equal(filtered_bc_mask(returns, 0.4), [False, True, False, True, False])
    # 0.2 -> 1 row: the 5s tie, the earlier one (row 1) wins
    np.testing.assert_array_equal(filtered_bc_mask(returns, 0.2), [False, True, False, False, False])
    # 0.5 -> ceil(2.5) = 3 rows: 5, 5, 3
    np.testing.assert_array_equal(filtered_bc_mask(returns, 0.5), [False, True, True, True, False])
    assert filtered_bc_mask(returns, 1.0).all()
    assert filtered_bc_mask([], 0.5).shape == (0,)


def test_filtered_bc_count_is_not_fooled_by_float_rounding():
    # 0.28 * 25 == 7.000000000000001 in floating point; ceil of that would keep 8 rows, not 7.
    mask = filtered_bc_mask(np.arange(25.0), 0.28)
    assert mask.sum() == 7
    np.testing.assert_array_equal(np.flatnonzero(mask), np.arange(18, 25))
    with pytest.raises(ValueError, match="fraction"):
        filtered_bc_mask([1.0], 0.0)


def test_filtered_bc_ties_are_deterministic_on_many_rows():
    # 50 rows: 1.0 at rows 0, 7, ..., 49 (8 rows), 0.0 elsewhere.  fraction 0.24 -> 12 rows: the eight 1.0s,
    # then the first four 0.0 rows (1, 2, 3, 4), whatever the sorting algorithm does internally on long arrays.
    returns = np.zeros(50)
    returns[::7] = 1.0
    kept = np.flatnonzero(filtered_bc_mask(returns, 0.24))
    np.testing.assert_array_equal(kept, [0, 1, 2, 3, 4, 7, 14, 21, 28, 35, 42, 49])


def test_training_weights_fold_loss_specific_weights_into_row_weights():
    advantages = [0.0, 2.0, -2.0, 4.0]
    row_weights = [None, 0.5, 1.0, 2.0]  # the nullable `weight` column: None means 1
    awr = LearnerConfig(loss="awr", awr_beta=2.0, awr_max_weight=5.0)
    # exp(0) * 1 = 1, exp(1) * 0.5 = 1.35914, exp(-1) * 1 = 0.36788, min(exp(2), 5) * 2 = 10
    np.testing.assert_allclose(
        training_weights(awr, advantages, row_weights), [1.0, 1.3591409, 0.36787944, 10.0], rtol=1e-6
    )
    fbc = LearnerConfig(loss="filtered_bc", filtered_bc_fraction=0.5)
    # top 2 of 4 by advantage: rows 3 (4.0) and 1 (2.0)
    np.testing.assert_allclose(training_weights(fbc, advantages, row_weights), [0.0, 0.5, 0.0, 2.0])
    np.testing.assert_allclose(training_weights(LearnerConfig(), advantages, row_weights), [1.0, 0.5, 1.0, 2.0])
    np.testing.assert_allclose(training_weights(LearnerConfig(), advantages), [1.0, 1.0, 1.0, 1.0])


def test_step_baseline_centres_and_scales_over_the_whole_step():
    g = [10.0, 20.0, 30.0, 40.0]
    # same group and turn for all: the per-cell and whole-step baselines agree here ...
    assert np.allclose(returns_to_go(g, ["a"] * 4, [0] * 4, baseline="step"), [-15, -5, 5, 15])
    # ... but with one row per (group, turn) the cell baseline zeroes everything, the step one does not
    cells = returns_to_go(g, ["a", "a", "b", "b"], [0, 1, 0, 1], baseline="group_turn")
    step = returns_to_go(g, ["a", "a", "b", "b"], [0, 1, 0, 1], baseline="step", normalize_std=True)
    assert np.allclose(cells, 0.0)
    assert np.isclose(step.mean(), 0.0) and np.isclose(step.std(), 1.0, atol=1e-5)
    assert np.all(np.diff(step) > 0)
    with pytest.raises(ValueError, match="group_turn, step or none"):
        returns_to_go(g, baseline="mean")  # type: ignore[arg-type]


def test_discounted_returns_per_turn_rows_in_any_order():
    # episode e1: rewards 1, 1, 1 (rows shuffled); episode e2: one row holding all its turns
    rewards = [[1.0], [1.0], [5.0, 0.0, 2.0], [1.0]]
    G = discounted_returns_to_go(rewards, ["e1", "e1", "e2", "e1"], [2, 0, 0, 1], [3, 3, 3, 3], 0.5)
    assert np.allclose(G, [1.0, 1.75, 5.5, 1.5])
    undiscounted = discounted_returns_to_go(rewards, ["e1", "e1", "e2", "e1"], [2, 0, 0, 1], [3, 3, 3, 3], 1.0)
    assert np.allclose(undiscounted, [1.0, 3.0, 7.0, 2.0])


def test_discounted_returns_refuse_a_cut_episode():
    with pytest.raises(ValueError, match="not whole in this batch"):
        discounted_returns_to_go([[1.0], [1.0]], ["e", "e"], [0, 2], [3, 3], 0.9)
