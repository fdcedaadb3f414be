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
