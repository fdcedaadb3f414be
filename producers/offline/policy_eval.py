"""``rlpipe eval`` of an offline CQL run (preset ``cql-building``): held-out building days, not seeds.

A version of such a run is a Q-network over setpoint-grid cells with the grid, the observation
scaler and the dataset's days beside it (``pipeline.building_policy``).  Its evaluation plays
the ``count`` simulated days after the dataset's (day indices ``first_held_out_day`` onwards,
never a logged one) with the greedy cell each step, through the same day loop as
``rlpipe datasets eval-building`` (``producers.offline.evaluation.controller_outcomes``), so
the result carries the reward's parts: comfort regret, energy and carbon (normalised, per-day
sums) and the energy cost ($) and carbon (kg) behind them.  Version 0 (nothing trained) and the
baselines (``heuristic``, ``random``) play the same days, so their returns pair day by day.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from pipeline.building_policy import load_building_policy
from pipeline.io.datasets import read_card
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from producers.offline.evaluation import (
    controller_outcomes,
    eval_result,
    held_out_days,
    numeric_controller,
    scripted_outcomes,
)
from schemas.config import RunConfig

POLICY = "value-network"


def offline_dataset(config: RunConfig) -> str:
    """The dataset an offline CQL run learned from (``value.offline.dataset``, written by ``rlpipe replay``)."""
    if config.value is None or config.value.offline is None or not config.value.offline.dataset:
        raise ValueError(f"run {config.run_id} names no dataset in value.offline.dataset; train it first with "
                         "rlpipe replay --run DATASET --train --preset cql-building")
    return config.value.offline.dataset


def first_held_out_day(config: RunConfig, store: ObjectStore) -> int:
    """The first day index after the dataset's: held-out day 0, the ``seed_start`` of a full held-out result."""
    return held_out_days(read_card(store, offline_dataset(config)), 1)[0]


def evaluate_building_version(config: RunConfig, store: ObjectStore, version: int, count: int,
                              skip: int = 0) -> Any:
    """Play ``count`` held-out days with value-network ``version`` (0: the random controller), after the
    first ``skip`` of them (``rlpipe eval --validation``: the ``count`` days after the held-out ones)."""
    card = read_card(store, offline_dataset(config))
    overrides = card.extras.get("env_overrides")
    if not version:
        days = held_out_days(card, count + skip)[skip:]
        return eval_result(config.run_id, POLICY, 0, scripted_outcomes(lambda day: "random", days, 0, overrides))
    cache = Path(tempfile.mkdtemp(prefix="rlpipe-building-eval-"))
    try:
        spec, policy = load_building_policy(AdapterRegistry(store, config.run_id).pull(version, cache,
                                                                                     kind="value-network"))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    days = list(range(spec.first_held_out_day + skip, spec.first_held_out_day + skip + count))
    controller = numeric_controller(policy.setpoints, spec.observation_columns)
    return eval_result(config.run_id, POLICY, version, controller_outcomes(controller, days, spec.env_overrides))


def building_baseline(config: RunConfig, store: ObjectStore, policy: str, count: int, skip: int = 0) -> Any:
    """A scripted controller (``heuristic`` or ``random``, seed 0) on the run's held-out days (after ``skip``)."""
    card = read_card(store, offline_dataset(config))
    days = held_out_days(card, count + skip)[skip:]
    outcomes = scripted_outcomes(lambda day: policy, days, 0, card.extras.get("env_overrides"))
    return eval_result(config.run_id, policy, 0, outcomes)


def breakdown_line(result: Any) -> str:
    """One line of a building result's parts: per-day means of comfort, energy, carbon, $ and kg."""
    b = result.breakdown
    return (f"{result.policy} v{result.version}: comfort {b['comfort']:.2f}, energy {b['energy']:.2f}, carbon "
            f"{b['carbon']:.2f} per day (normalised sums); {b['energy_usd']:.2f} $ and {b['carbon_kg']:.1f} kg a day")
