"""Answer parsing: the two setpoints as values in [-1, 1] or in kelvin, and the conversions
between a setpoint's kelvin and its normalised value."""

from __future__ import annotations

import math
import re

_VALUE = re.compile(
    r"^(?:[A-Za-z_][\w \-]*\s*[=:]\s*)?([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*([Kk])?$"
)
_SPLIT = re.compile(r"\s*[,;]\s*")
_BRACKETS = {"[": "]", "(": ")"}  # one pair around the whole answer, as a list or a tuple is written
KELVIN_MIN_BARE = 100.0  # a bare number this large is read as kelvin
NORMALIZED_MAX_BARE = 2.0  # bare numbers up to this magnitude are normalised values (clipped to [-1, 1])


def parse_setpoint_values(text: str) -> tuple[tuple[float, bool], tuple[float, bool]] | None:
    """Two ``(value, is_kelvin)`` pairs from text like "0.2, -0.5", "330K 292K", "water=330 K; air=292 K"
    or "[0.2, -0.5]".

    Values are separated by a comma or semicolon (or spaces when there is neither); each
    may carry a ``label=`` or ``label:`` prefix and a ``K`` suffix; the pair may sit in one
    pair of square brackets or parentheses.  None if not exactly two.
    """
    body = text.strip()
    if body[:1] in _BRACKETS and body[-1:] == _BRACKETS[body[:1]]:
        body = body[1:-1].strip()
    if _SPLIT.search(body):
        pieces = _SPLIT.split(body)
    else:
        pieces = re.sub(r"(\d)\s+([Kk])\b", r"\1\2", body).split()
    if len(pieces) != 2:
        return None
    out = []
    for piece in pieces:
        m = _VALUE.match(piece.strip())
        if m is None:
            return None
        value = float(m.group(1))
        if not math.isfinite(value):
            return None
        out.append((value, m.group(2) is not None))
    return out[0], out[1]


def to_kelvin(value: tuple[float, bool], bounds: tuple[float, float]) -> tuple[float, bool] | None:
    """(kelvin clipped to ``bounds``, clipped?) from one parsed value; None if it cannot be a setpoint.

    With K, or bare and >= 100: kelvin.  Bare with |v| <= 2: normalised, -1 -> low, +1 -> high
    (clipped to [-1, 1]).  Anything else (0 K or below, a bare 5 or 57) is ambiguous: invalid.
    """
    number, is_kelvin = value
    low, high = bounds
    if is_kelvin or number >= KELVIN_MIN_BARE:
        if number <= 0.0:
            return None
        kelvin = min(max(number, low), high)
        return kelvin, kelvin != number
    if abs(number) > NORMALIZED_MAX_BARE:
        return None
    unit = min(max(number, -1.0), 1.0)
    return from_normalized(unit, bounds), unit != number


def from_normalized(unit: float, bounds: tuple[float, float]) -> float:
    """A value in [-1, 1] to kelvin within ``bounds`` (-1 -> low, +1 -> high); the inverse of ``to_normalized``."""
    low, high = bounds
    return low + (unit + 1.0) * 0.5 * (high - low)


def to_normalized(kelvin: float, bounds: tuple[float, float]) -> float:
    """Kelvin within ``bounds`` to [-1, 1]."""
    low, high = bounds
    return 2.0 * (kelvin - low) / (high - low) - 1.0
