"""How far one benchmark run's ratio can be trusted: the spread of its per-round (or per-block) ratios."""

from __future__ import annotations

import statistics


def spread(ratios: list[float], unit: str = "rounds") -> str:
    """Median, mean and its standard error, and range of per-round ratios: how far one run's figure can be trusted."""
    if len(ratios) < 2:
        return f"{ratios[0]:.2f} (one {unit.rstrip('s')})"
    error = statistics.stdev(ratios) / len(ratios) ** 0.5
    return (f"median {statistics.median(ratios):.2f}, mean {statistics.mean(ratios):.3f} +- {error:.3f} "
            f"(standard error, {len(ratios)} {unit}), range {min(ratios):.2f}-{max(ratios):.2f}")
