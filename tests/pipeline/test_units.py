"""Units as dataset cards state them: the usual spellings of one unit compare equal, other units do not."""

from __future__ import annotations

import pytest

from pipeline.units import same_unit


@pytest.mark.parametrize(("stated", "unit"), [
    ("K", "K"), ("kelvin", "K"), (" Kelvin ", "K"), ("k", "K"),
    ("degC", "°C"), ("C", "degC"), ("celsius", "degC"), ("°C", "Celsius"),
    ("watt", "W"), ("W", "watts"), ("kW", "kilowatt"), ("KW", "kW"),
    ("USD", "USD"), ("people", " people"),
])
def test_spellings_of_one_unit_are_the_same_unit(stated, unit):
    assert same_unit(stated, unit)


@pytest.mark.parametrize(("stated", "unit"), [
    ("degC", "K"), ("celsius", "kelvin"), ("kW", "W"), ("MW", "mW"), ("USD", "EUR"), ("", "K"),
])
def test_other_units_are_not_the_same(stated, unit):
    assert not same_unit(stated, unit)
