"""The paired difference of two policies' returns on the same episodes and seeds."""

import pytest

from schemas.evaluation import paired_difference


def test_paired_difference_pairs_same_seed_and_falls_back_to_seed_zero():
    a = {0: [1.0, 2.0], 1: [3.0, 4.0]}
    b = {0: [0.0, 1.0]}  # one seed: a's seed 1 is compared with b's seed 0
    d = paired_difference(a, b)
    # differences 1, 1, 3, 3: mean 2, s = sqrt(4/3), half-width t(3)=3.182446 * s / 2
    assert d["mean"] == pytest.approx(2.0)
    assert d["ci95"] == pytest.approx(3.182446 * (4 / 3) ** 0.5 / 2)
    assert d["pairs"] == 4 and d["above"] is True


def test_paired_difference_needs_no_seed_zero_when_both_sides_have_every_seed():
    a = {5: [1.0, 2.0], 6: [3.0, 5.0]}
    b = {5: [0.0, 1.0], 6: [1.0, 2.0]}
    d = paired_difference(a, b)
    assert d["pairs"] == 4
    assert d["mean"] == (1.0 + 1.0 + 2.0 + 3.0) / 4
