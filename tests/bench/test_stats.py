"""The spread a benchmark prints beside its ratio."""

from __future__ import annotations

from bench.stats import spread


def test_the_spread_of_round_ratios_reports_mean_error_and_range():
    assert spread([0.9]) == "0.90 (one round)"
    text = spread([0.8, 0.9, 1.0, 0.9])
    assert "median 0.90" in text and "mean 0.900 +- 0.041" in text and "range 0.80-1.00" in text and "4 rounds" in text
    assert spread([0.5], unit="blocks") == "0.50 (one block)" and "3 blocks" in spread([1.0, 1.1, 0.9], unit="blocks")
