"""Building telemetry generation: simulated ``building-hvac`` days under scripted controllers,
written in the Smart Buildings layout and imported with the same importer as real data.

One day index names one simulated day (its date, weather offset, start temperatures and
occupants) everywhere: the generator, the behaviour policy and the evaluation.
"""

from __future__ import annotations

import datetime as dt
import json
import random
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipeline.io.datasets import DatasetCard, require_free_name
from pipeline.io.store import ObjectStore
from producers.envs.building import BuildingConfig, BuildingHVAC, zone_names
from producers.offline.episodes import DatasetImportError
from producers.offline.smart_buildings import (
    MATRICES,
    METADATA_JSON,
    NPZ_NAME,
    REWARD_VALUE_IDS,
    import_smart_buildings,
)

GenerationPolicy = Literal["heuristic", "random", "mixed", "varied"]
# The simulator's actions as the dataset names them: device setpoints, as in the real dataset.
SIM_ACTIONS = {
    "boiler_0@supply_water_setpoint": "action@supply_water_setpoint",
    "ahu_0@supply_air_heating_temperature_setpoint": "action@supply_air_heating_temperature_setpoint",
}
# RewardResponse fields the simulator's telemetry provides (the rest are constants of the configuration).
SIM_REWARDS = {
    "agent_reward_value": "reward@reward", "productivity_reward": "reward@productivity",
    "electricity_energy_cost": "reward@electricity_cost", "natural_gas_energy_cost": "reward@natural_gas_cost",
    "carbon_emitted": "reward@carbon_emitted", "total_occupancy": "reward@total_occupancy",
    "normalized_productivity_regret": "reward@comfort", "normalized_energy_cost": "reward@energy_cost",
    "normalized_carbon_emission": "reward@carbon",
}  # fmt: skip
REWARD_UNITS = {
    "agent_reward_value": "1", "productivity_reward": "USD", "electricity_energy_cost": "USD",
    "natural_gas_energy_cost": "USD", "carbon_emitted": "kg", "carbon_cost": "USD", "productivity_weight": "1",
    "energy_cost_weight": "1", "carbon_emission_weight": "1", "person_productivity": "USD/(person h)",
    "total_occupancy": "people", "reward_scale": "1", "reward_shift": "1", "productivity_regret": "USD",
    "normalized_productivity_regret": "1", "normalized_energy_cost": "1", "normalized_carbon_emission": "1",
}  # fmt: skip
# RewardInfo entries per zone and per device (smart_control's names) -> the telemetry they come from.
SIM_ZONE_INFO = {"heating_setpoint_temperature": ("zone_air_heating_temperature_setpoint", "K"),
                 "cooling_setpoint_temperature": ("zone_air_cooling_temperature_setpoint", "K"),
                 "zone_air_temperature": ("zone_air_temperature_sensor", "K"),
                 "average_occupancy": ("zone_occupancy", "people")}
SIM_DEVICE_INFO = {"ahu_0@air_conditioning_electrical_energy_rate": (("ahu_0@air_conditioning_electrical_power",), "W"),
                   "ahu_0@blower_electrical_energy_rate": (("ahu_0@supply_fan_electrical_power",
                                                           "ahu_0@exhaust_fan_electrical_power"), "W"),
                   "boiler_0@natural_gas_heating_energy_rate": (("boiler_0@natural_gas_flow_rate",), "W"),
                   "boiler_0@pump_electrical_energy_rate": (("boiler_0@pump_electrical_power",), "W")}


class GenerationSpec(BaseModel):
    """Which simulated days to log and under which controller."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    days: int = Field(ge=1, le=3650, description="days to simulate (one episode each)")
    policy: GenerationPolicy = Field(
        "mixed", description="heuristic, random, a mix of both chosen per day, or varied (the heuristic with "
                             "its preheat drawn per day from preheat_hours)")
    random_fraction: float = Field(0.5, ge=0.0, le=1.0, description="share of random days when policy is mixed")
    preheat_hours: tuple[float, ...] = Field(
        (1.0, 2.0, 3.0, 4.0), min_length=1, description="the varied log's choices of hours the heuristic preheats")
    seed: int = Field(0, ge=0, description="seeds the controllers' choices (random actions, which days are random)")
    first_day: int = Field(0, ge=0, le=100_000, description="index of the first day: its date and simulator seed")
    env_overrides: dict[str, Any] = Field(default_factory=dict, description="building-hvac settings to change")

    @field_validator("env_overrides")
    @classmethod
    def _whole_days(cls, value: dict[str, Any]) -> dict[str, Any]:
        config = BuildingHVAC.Config.model_validate(value)
        if config.episode_days != 1.0 or config.start_hour != 0.0:
            raise ValueError("the generator logs whole local days: leave episode_days at 1 and start_hour at 0")
        return value


def day_env(day: int, overrides: Mapping[str, Any] | None = None) -> BuildingHVAC:
    """The simulator of day index ``day``: the configured start date plus ``day`` days (reset it with seed ``day``).

    One index names one simulated day (its date, weather offset, start temperatures and
    occupants) everywhere: the generator, the behaviour policy and the evaluation.
    """
    settings = dict(overrides or {})
    base = BuildingHVAC.Config.model_validate(settings)
    settings["start_date"] = base.start_date + dt.timedelta(days=day)
    return BuildingHVAC(**settings)


def day_policy(spec: GenerationSpec, day: int) -> str:
    """The controller of ``day`` under ``spec``: a mixed or varied log draws it per day, reproducibly.

    A varied day is named ``heuristic-<hours>h``: the heuristic preheating that many hours.
    """
    if spec.policy == "varied":
        return f"heuristic-{random.Random(f'rlpipe-varied:{spec.seed}:{day}').choice(spec.preheat_hours):g}h"
    if spec.policy != "mixed":
        return spec.policy
    return "random" if random.Random(f"rlpipe-mixed:{spec.seed}:{day}").random() < spec.random_fraction else "heuristic"


def policy_answer(env: BuildingHVAC, policy: str, rng: random.Random) -> str:
    """One scripted answer: the environment's heuristic (``heuristic-<hours>h``: preheating that many hours)
    or its uniformly random answer."""
    if policy == "heuristic":
        return env.heuristic_answer()
    if policy == "random":
        return env.random_answer(rng)
    hours = re.fullmatch(r"heuristic-(\d+(?:\.\d+)?)h", policy)
    if hours is not None:
        return env.heuristic_answer(float(hours.group(1)))
    raise ValueError(f"unknown logging controller {policy!r}: use heuristic, heuristic-<hours>h or random")


@dataclass
class DayLog:
    """One simulated day: telemetry before the first step and after each, and what the controller saw."""

    day: int
    policy: str
    telemetry: list[dict[str, float]]
    answers: list[str] = field(default_factory=list)  # the controller's answer at each step
    observations: list[str] = field(default_factory=list)  # the prompt text before each step (keep_text)


def simulate_day(
    day: int, policy: str, seed: int = 0, overrides: Mapping[str, Any] | None = None, keep_text: bool = False
) -> DayLog:
    """Run day ``day`` under a scripted ``policy`` and log its telemetry (288 steps by default)."""
    env = day_env(day, overrides)
    env.reset(day)
    rng = random.Random(f"rlpipe-generate:{seed}:{day}")
    log_ = DayLog(day, policy, [env.telemetry()])
    while not env.done:
        if keep_text:
            log_.observations.append(env.observation())
        log_.answers.append(policy_answer(env, policy, rng))
        env.step(log_.answers[-1])
        log_.telemetry.append(env.telemetry())
    return log_


def sbd_layout(logs: Sequence[DayLog], config: BuildingConfig) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Day logs -> the four matrices and their metadata (JSON-ready), one row per step.

    Row k of a day: the observation at the step's start (telemetry row k), the action
    taken then and the reward and reward info of the step (from telemetry row k + 1).
    """
    fields = BuildingHVAC.telemetry_fields(config)
    observation_ids = [n for n, _ in fields if not n.startswith(("reward@", "time@"))]
    zones = zone_names(config.grid_rows, config.grid_cols)
    info_ids = [f"{z}@{name}" for z in zones for name in SIM_ZONE_INFO] + list(SIM_DEVICE_INFO)
    rows_now = [row for day in logs for row in day.telemetry[:-1]]
    rows_next = [row for day in logs for row in day.telemetry[1:]]
    matrices = {
        "observation_value_matrix": _matrix(rows_now, observation_ids),
        "action_value_matrix": _matrix(rows_next, list(SIM_ACTIONS.values())),
        "reward_value_matrix": np.stack([_reward_column(rows_next, rid, config) for rid in REWARD_VALUE_IDS], axis=1),
        "reward_info_value_matrix": np.stack([_info_column(rows_next, iid) for iid in info_ids], axis=1),
    }
    times = [dt.datetime.fromtimestamp(row["time@timestamp"], tz=dt.UTC).isoformat() for row in rows_now]
    units = dict(fields) | {a: "K" for a in SIM_ACTIONS} | REWARD_UNITS
    units |= {f"{z}@{name}": unit for z in zones for name, (_, unit) in SIM_ZONE_INFO.items()}
    units |= {iid: unit for iid, (_, unit) in SIM_DEVICE_INFO.items()}
    metadata = {
        "observation_ids": {name: i for i, name in enumerate(observation_ids)},
        "action_ids": {name: i for i, name in enumerate(SIM_ACTIONS)},
        "reward_ids": {name: i for i, name in enumerate(info_ids)},  # upstream's name for the reward *info* columns
        "observation_timestamps": times, "action_timestamps": times,
        "reward_timestamps": times, "reward_info_timestamps": times,
        "device_infos": [], "zone_infos": [],
        "units": {k: v for k, v in units.items() if not k.startswith(("reward@", "time@"))},
    }  # fmt: skip
    return matrices, metadata


def _matrix(rows: Sequence[Mapping[str, float]], names: Sequence[str]) -> np.ndarray:
    return np.array([[row[n] for n in names] for row in rows], dtype=np.float64).reshape(len(rows), len(names))


def _reward_column(rows: Sequence[Mapping[str, float]], reward_id: str, cfg: BuildingConfig) -> np.ndarray:
    """One RewardResponse field per step: from the telemetry, or a constant of the configuration."""
    if reward_id in SIM_REWARDS:
        return np.array([row[SIM_REWARDS[reward_id]] for row in rows], dtype=np.float64)
    step_hours = cfg.step_seconds / 3600.0
    constants = {
        "carbon_cost": 0.0, "productivity_weight": cfg.productivity_weight,
        "energy_cost_weight": cfg.energy_cost_weight, "carbon_emission_weight": cfg.carbon_weight,
        "person_productivity": cfg.max_productivity_usd, "reward_scale": 1.0, "reward_shift": 0.0,
    }  # fmt: skip
    if reward_id in constants:
        return np.full(len(rows), constants[reward_id], dtype=np.float64)
    if reward_id == "productivity_regret":  # what full productivity would have earned, minus what was earned
        return np.array([cfg.max_productivity_usd * row["reward@total_occupancy"] * step_hours
                         - row["reward@productivity"] for row in rows], dtype=np.float64)
    raise DatasetImportError(f"the simulator cannot provide reward field {reward_id!r}")


def _info_column(rows: Sequence[Mapping[str, float]], info_id: str) -> np.ndarray:
    device, _, name = info_id.partition("@")
    if name in SIM_ZONE_INFO:
        sources: tuple[str, ...] = (f"{device}@{SIM_ZONE_INFO[name][0]}",)
    else:
        sources = SIM_DEVICE_INFO[info_id][0]
    return np.array([sum(row[s] for s in sources) for row in rows], dtype=np.float64)


def write_sbd_partition(folder: Path, matrices: Mapping[str, np.ndarray], metadata: Mapping[str, Any]) -> Path:
    """Write ``data.npy.npz`` (no pickles) and ``metadata.json`` into ``folder``; return the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(folder / NPZ_NAME, **{name: np.asarray(matrices[name]) for name in MATRICES})
    (folder / METADATA_JSON).write_text(json.dumps(metadata, indent=1, default=str))
    return folder


def generate_building_dataset(
    store: ObjectStore,
    name: str,
    spec: GenerationSpec,
    raw_dir: str | Path | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> DatasetCard:
    """Simulate ``spec.days`` days, write them in the Smart Buildings layout (into ``raw_dir``, or a
    temporary folder), then import that layout with the same importer as real data.  A taken or invalid
    ``name`` is refused before any day is simulated."""
    require_free_name(store, name)
    logs = []
    for index, day in enumerate(range(spec.first_day, spec.first_day + spec.days)):
        logs.append(simulate_day(day, day_policy(spec, day), spec.seed, spec.env_overrides))
        if progress is not None:
            progress(index + 1, spec.days)
    env = day_env(spec.first_day, spec.env_overrides)
    matrices, metadata = sbd_layout(logs, env.config)
    overrides = BuildingHVAC.Config.model_validate(spec.env_overrides).model_dump(mode="json")
    metadata["rlpipe"] = {
        "generator": "rlpipe building-hvac simulator", "env": BuildingHVAC.name,
        "env_overrides": {k: overrides[k] for k in spec.env_overrides},
        "utc_offset_hours": env.config.utc_offset_hours, "step_seconds": float(env.config.step_seconds),
        "generation": spec.model_dump(mode="json"),
        "episodes": _episode_list(logs, metadata["observation_timestamps"]),
    }  # fmt: skip
    description = (f"{spec.days} simulated days of building-hvac under the {spec.policy} controller "
                   f"(days {spec.first_day}..{spec.first_day + spec.days - 1}, seed {spec.seed})")
    with tempfile.TemporaryDirectory(prefix="rlpipe-sbd-") as scratch:
        folder = write_sbd_partition(Path(raw_dir) if raw_dir else Path(scratch), matrices, metadata)
        return import_smart_buildings(store, folder, name, source="building-hvac-simulator", description=description)


def _episode_list(logs: Sequence[DayLog], times: Sequence[str]) -> list[dict[str, Any]]:
    """Which day index and controller each logged episode had, keyed by its first timestamp."""
    out, row = [], 0
    for day_log in logs:
        out.append({"day": day_log.day, "policy": day_log.policy, "start": times[row]})
        row += len(day_log.telemetry) - 1
    return out
