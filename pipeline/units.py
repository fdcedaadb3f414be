"""Units as a dataset card states them (``DatasetField.unit``), compared by meaning, not by spelling.

A source may write kelvin as ``K``, ``k`` or ``kelvin``; every check of a card's units
(the building prompt's columns, offline CQL's setpoint grid) reads them through
``same_unit`` so that one card is accepted or refused alike everywhere.  Only the
spellings listed here are read loosely: any other unit is compared exactly, since case
can matter (``MW`` is not ``mW``).
"""

from __future__ import annotations

# lower-cased spelling -> the unit it names
_SPELLINGS = {
    **dict.fromkeys(("k", "kelvin", "kelvins"), "K"),
    **dict.fromkeys(("degc", "°c", "c", "celsius", "deg c", "deg_c"), "degC"),
    **dict.fromkeys(("w", "watt", "watts"), "W"),
    **dict.fromkeys(("kw", "kilowatt", "kilowatts"), "kW"),
}


def canonical_unit(unit: str) -> str:
    """``unit`` in its one spelling (``kelvin`` -> ``K``, ``°C`` -> ``degC``); another unit, stripped, as given."""
    text = unit.strip()
    return _SPELLINGS.get(text.lower(), text)


def same_unit(stated: str, unit: str) -> bool:
    """Whether a card's ``stated`` unit is ``unit``, however either is spelled."""
    return canonical_unit(stated) == canonical_unit(unit)
