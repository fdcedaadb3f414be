"""bench/offline_building.py: the paired comparison its verdict rests on (pure arithmetic)."""

from __future__ import annotations

import pytest

from bench.offline_building import paired_difference


def test_paired_difference_cancels_what_the_days_share():
    # Day-to-day spread (weather) is large; the policy is better by 1 on every day.
    random_ = {0: [-40.0, -30.0, -35.0], 1: [-41.0, -29.0, -36.0]}
    awr = {0: [-39.0, -29.0, -34.0], 1: [-40.0, -28.0, -35.0]}
    d = paired_difference(awr, random_)
    assert d["mean"] == pytest.approx(1.0) and d["ci95"] == pytest.approx(0.0, abs=1e-12)
    assert d["pairs"] == 6 and d["above"]


def test_paired_difference_falls_back_to_seed_0_and_reports_a_tie():
    greedy = {0: [-30.0, -31.0, -32.0, -33.0]}
    heuristic = {0: [-29.0, -32.0, -31.0, -34.0]}
    d = paired_difference(greedy, heuristic)
    assert d["mean"] == pytest.approx(0.0) and d["ci95"] > 0 and not d["above"]
    sampled = {0: [-30.0, -31.0, -32.0, -33.0], 1: [-31.0, -32.0, -33.0, -34.0]}
    assert paired_difference(sampled, heuristic)["pairs"] == 8  # seed 1 compared with the heuristic's seed 0


def test_paired_difference_refuses_misaligned_days():
    with pytest.raises(ValueError):
        paired_difference({0: [1.0, 2.0]}, {0: [1.0]})
