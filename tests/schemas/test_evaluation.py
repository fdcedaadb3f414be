"""The 95% confidence interval of a mean: Student's t at every sample size."""

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from schemas.evaluation import mean_ci95, t_critical_95


@pytest.mark.parametrize("n", [2, 4, 31, 32, 33, 50, 100, 1000])
def test_the_interval_uses_students_t_at_every_sample_size(n):
    """half-width = t_{0.975, n-1} * s / sqrt(n); past 30 values a normal 1.96 made it 2-4% too narrow."""
    values = list(np.random.default_rng(n).normal(size=n))
    mean, half = mean_ci95(values)
    expected = stats.t.ppf(0.975, n - 1) * np.std(values, ddof=1) / math.sqrt(n)
    assert mean == pytest.approx(np.mean(values))
    assert half == pytest.approx(expected, rel=1e-6)  # the table to 30 has 6 decimals, the expansion beyond


def test_the_critical_value_falls_smoothly_to_the_normal_one():
    dofs = range(1, 2001)
    values = [t_critical_95(dof) for dof in dofs]
    assert all(a > b for a, b in itertools.pairwise(values))
    assert values[-1] == pytest.approx(stats.norm.ppf(0.975), rel=1e-3) and values[-1] > stats.norm.ppf(0.975)
    with pytest.raises(ValueError, match="at least 1"):
        t_critical_95(0)
    assert mean_ci95([4.0]) == (4.0, 0.0)


def test_a_validation_record_round_trips_and_its_key_names_its_seeds():
    """The same validation (environment, first seed, episodes) has one key and the same bytes each time, so
    repeating it writes nothing new; a damaged record is refused naming where it was read."""
    from schemas.evaluation import (
        ValidationPlayed,
        ValidationPlayedError,
        validation_from_bytes,
        validation_key,
        validation_to_bytes,
    )

    played = ValidationPlayed(run_id="r", env="cartpole", seed_start=1_000_004, episodes=8)
    assert validation_from_bytes(validation_to_bytes(played)) == played
    assert validation_key(played) == "runs/r/validation/cartpole-seed1000004-episodes8.json"
    assert validation_to_bytes(ValidationPlayed(run_id="r", env="cartpole", seed_start=1_000_004, episodes=8)) == \
        validation_to_bytes(played)
    with pytest.raises(ValidationPlayedError, match="here"):
        validation_from_bytes(b"{not json", where="here")
