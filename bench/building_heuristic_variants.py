"""Can anything simple beat the building's heuristic on held-out days?  Variants of it, paired day by day.

The offline CQL target (docs/value.md) asks a policy learned from logged days to beat the
scripted heuristic on held-out days 14-20.  Before asking that of CQL, this asks it of simple
controllers: the heuristic (``BuildingHVAC.heuristic_setpoints``) with one of its constants
changed (target offset, preheat hours, water gain and offset, when the supply air warms),
snapped to the CQL grid, and constant grid cells.  Each plays the same days in the simulator
(``producers.offline.evaluation.controller_outcomes``); the heuristic is deterministic, so a
paired difference has one pair per day.

Run: nice .venv/bin/python bench/building_heuristic_variants.py [--first-day 14] [--days 7]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from bench.options import non_negative_int, positive_int
from producers.envs.building import BuildingHVAC
from producers.envs.building.environment import _HEURISTIC_DAY_OFF_WATER_FLOOR, from_normalized
from producers.envs.parsing import format_answer
from producers.offline.evaluation import controller_outcomes, scripted_outcomes
from schemas.evaluation import mean_ci95, paired_difference

# (name, keyword changes to the heuristic's constants); the defaults are the environment's heuristic
VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("target -0.5 K", {"shift_k": -0.5}), ("target -0.25 K", {"shift_k": -0.25}),
    ("target +0.25 K", {"shift_k": 0.25}), ("preheat 1 h", {"preheat_h": 1.0}), ("preheat 3 h", {"preheat_h": 3.0}),
    ("preheat 4 h", {"preheat_h": 4.0}), ("preheat 5 h", {"preheat_h": 5.0}), ("preheat 6 h", {"preheat_h": 6.0}),
    ("water gain x0.7", {"gain": 0.7}), ("water gain x1.3", {"gain": 1.3}), ("water offset 10", {"offset": 10.0}),
    ("air from 0.5 K short", {"air_from_k": 0.5}), ("air never warmer", {"air_from_k": 100.0}),
    ("snapped to 5 x 5", {"grid": 5}), ("preheat 3 h, snapped to 5 x 5", {"preheat_h": 3.0, "grid": 5}),
    ("preheat 4 h, snapped to 5 x 5", {"preheat_h": 4.0, "grid": 5}),
    ("preheat 3 h, air never warmer", {"preheat_h": 3.0, "air_from_k": 100.0}),
]  # fmt: skip


def heuristic_variant(shift_k: float = 0.0, preheat_h: float = 2.0, gain: float = 1.0, offset: float = 20.0,
                      air_from_k: float = 1.5, grid: int | None = None) -> Callable[[BuildingHVAC], str]:
    """``BuildingHVAC.heuristic_setpoints`` with its constants as arguments (the defaults give it back)."""

    def answer(env: BuildingHVAC) -> str:
        cfg, s = env.config, env._require_state()
        (w_lo, w_hi), (a_lo, a_hi) = cfg.supply_water_range_k, cfg.supply_air_heating_range_k
        local = env.local_time()
        hour = local.hour + local.minute / 60.0
        preheat = local.weekday() < 5 and cfg.comfort_start_hour - preheat_h <= hour < cfg.comfort_end_hour
        target = (cfg.comfort_band_k[0] if preheat else env._band(env.current_timestamp)[0]) + 0.5 + shift_k
        occupied_Z = s.present_ZO.any(axis=1)
        deficit = target - float((s.zone_temp_Z[occupied_Z] if occupied_Z.any() else s.zone_temp_Z).min())
        day_off = local.weekday() >= 5
        floor = from_normalized(_HEURISTIC_DAY_OFF_WATER_FLOOR, cfg.supply_water_range_k) if day_off else w_lo
        water, air = floor, a_lo
        if deficit > 0.0:
            water = max(floor, min(w_hi, w_lo + gain * (offset + 25.0 * deficit) / 45.0 * (w_hi - w_lo)))
            air = min(a_hi, a_lo + max(0.0, deficit - air_from_k) * 0.5 * (a_hi - a_lo))
        if grid is not None:  # the nearest cell of the CQL grid
            water_L, air_L = np.linspace(w_lo, w_hi, grid), np.linspace(a_lo, a_hi, grid)
            water, air = water_L[np.abs(water_L - water).argmin()], air_L[np.abs(air_L - air).argmin()]
        return format_answer([f"{water:.3f}K, {air:.3f}K"])

    return answer


def constant(water_k: float, air_k: float) -> Callable[[BuildingHVAC], str]:
    return lambda env: format_answer([f"{water_k:.3f}K, {air_k:.3f}K"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--first-day", type=non_negative_int, default=14, help="first held-out day index")
    parser.add_argument("--days", type=positive_int, default=7, help="days to play")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    days = list(range(args.first_day, args.first_day + args.days))
    reference = [o.episode_return for o in scripted_outcomes(lambda day: "heuristic", days, 0)]
    mean, ci95 = mean_ci95(reference)
    print(f"days {days[0]}..{days[-1]}: heuristic {mean:.3f} ± {ci95:.3f}\n")
    print("| controller | mean daily return (95% CI) | comfort | energy | carbon | minus heuristic (95% CI) | above |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    controllers = [(name, heuristic_variant(**changes)) for name, changes in VARIANTS]
    controllers += [(f"constant {w:.2f} K, {a:.2f} K", constant(w, a))
                    for w, a in itertools.product(np.linspace(310, 355, 5), np.linspace(285, 300, 5)[:2])]
    for name, controller in controllers:
        outcomes = controller_outcomes(controller, days)
        returns = [o.episode_return for o in outcomes]
        mean, ci95 = mean_ci95(returns)
        d = paired_difference({0: returns}, {0: reference})
        parts = " | ".join(f"{np.mean([getattr(o, k) for o in outcomes]):.2f}" for k in ("comfort", "energy", "carbon"))
        print(f"| {name} | {mean:.3f} ± {ci95:.3f} | {parts} | {d['mean']:+.3f} ± {d['ci95']:.3f} | "
              f"{'yes' if d['above'] else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
