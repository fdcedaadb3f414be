"""Telemetry of ``BuildingHVAC`` in the Smart Buildings naming (``device@field``): the row after
each step, and the state a logged row describes (how offline datasets show logged steps as prompts).

A mixin of ``BuildingHVAC`` rather than functions, because it reads and writes the
environment's plant state, setpoints, report and clock as the environment does.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import numpy as np

from producers.envs.base import checked_seed
from producers.envs.building.config import SECONDS_PER_DAY, SECONDS_PER_HOUR, BuildingConfig
from producers.envs.building.plant import (
    COOL,
    HEAT,
    OFF,
    IntervalReport,
    PlantState,
    RewardBreakdown,
    Setpoints,
    zone_names,
)


class BuildingTelemetry:
    """``telemetry()``, ``telemetry_fields()`` and ``load_state_from_telemetry()`` of ``BuildingHVAC``."""

    @classmethod
    def telemetry_fields(cls, config: BuildingConfig | None = None) -> list[tuple[str, str]]:
        """(column, unit) of every telemetry field, ``device@field`` as in the Smart Buildings dataset."""
        cfg = config if config is not None else cls.Config()
        zone_fields = [
            ("zone_air_temperature_sensor", "K"),
            ("zone_air_heating_temperature_setpoint", "K"),
            ("zone_air_cooling_temperature_setpoint", "K"),
            ("supply_air_flowrate_sensor", "m3/s"),
            ("supply_air_flowrate_setpoint", "m3/s"),
            ("supply_air_damper_percentage_command", "%"),
            ("reheat_valve_percentage_command", "%"),
            ("discharge_air_temperature_sensor", "K"),
            ("zone_occupancy", "people"),
        ]
        fields = [(f"{z}@{f}", u) for z in zone_names(cfg.grid_rows, cfg.grid_cols) for f, u in zone_fields]
        return [
            *fields,
            ("ahu_0@supply_fan_electrical_power", "W"),
            ("ahu_0@exhaust_fan_electrical_power", "W"),
            ("ahu_0@air_conditioning_electrical_power", "W"),
            ("ahu_0@supply_air_flowrate_sensor", "m3/s"),
            ("ahu_0@outside_air_flowrate_sensor", "m3/s"),
            ("ahu_0@mixed_air_temperature_sensor", "K"),
            ("ahu_0@supply_air_temperature_sensor", "K"),
            ("ahu_0@supply_air_heating_temperature_setpoint", "K"),
            ("ahu_0@supply_air_cooling_temperature_setpoint", "K"),
            ("boiler_0@natural_gas_flow_rate", "W"),
            ("boiler_0@pump_electrical_power", "W"),
            ("boiler_0@supply_water_setpoint", "K"),
            ("boiler_0@supply_water_temperature_sensor", "K"),
            ("boiler_0@return_water_temperature_sensor", "K"),
            ("outside@outside_air_temperature_sensor", "K"),
            ("action@supply_water_setpoint", "K"),
            ("action@supply_air_heating_temperature_setpoint", "K"),
            ("action@clipped", "1"),
            ("reward@reward", "1"),
            ("reward@comfort", "1"),
            ("reward@energy_cost", "1"),
            ("reward@carbon", "1"),
            ("reward@productivity", "USD"),
            ("reward@electricity_cost", "USD"),
            ("reward@natural_gas_cost", "USD"),
            ("reward@carbon_emitted", "kg"),
            ("reward@total_occupancy", "people"),
            ("time@timestamp", "s"),
        ]

    def telemetry(self) -> dict[str, float]:
        """One row of telemetry: temperatures now; flows, setpoints, occupancy, actions, power (averaged)
        and reward of the step that just ended.

        ``time@timestamp`` is the UTC epoch second at the end of that step (the episode
        start, with zero power and reward, before the first step).
        """
        cfg, s, rep, b, act = self.config, self._require_state(), self.report, self.breakdown, self.setpoints
        occupancy_Z = s.present_ZO.sum(axis=1)
        row: dict[str, float] = {}
        for i, z in enumerate(self.zone_names):
            row[f"{z}@zone_air_temperature_sensor"] = s.zone_temp_Z[i]
            row[f"{z}@zone_air_heating_temperature_setpoint"] = self.band[0]
            row[f"{z}@zone_air_cooling_temperature_setpoint"] = self.band[1]
            row[f"{z}@supply_air_flowrate_sensor"] = rep.flow_Z[i]
            row[f"{z}@supply_air_flowrate_setpoint"] = rep.flow_setpoint_Z[i]
            row[f"{z}@supply_air_damper_percentage_command"] = 100.0 * rep.damper_Z[i]
            row[f"{z}@reheat_valve_percentage_command"] = 100.0 * rep.valve_Z[i]
            row[f"{z}@discharge_air_temperature_sensor"] = rep.discharge_temp_Z[i]
            row[f"{z}@zone_occupancy"] = occupancy_Z[i]
        row |= {
            "ahu_0@supply_fan_electrical_power": rep.supply_fan_w,
            "ahu_0@exhaust_fan_electrical_power": rep.exhaust_fan_w,
            "ahu_0@air_conditioning_electrical_power": rep.coil_electric_w,
            "ahu_0@supply_air_flowrate_sensor": rep.ahu_flow,
            "ahu_0@outside_air_flowrate_sensor": rep.ahu_flow * (1.0 - cfg.ahu_recirculation),
            "ahu_0@mixed_air_temperature_sensor": rep.mixed_temp,
            "ahu_0@supply_air_temperature_sensor": rep.supply_temp,
            "ahu_0@supply_air_heating_temperature_setpoint": act.air_k,
            "ahu_0@supply_air_cooling_temperature_setpoint": max(cfg.ahu_cooling_setpoint_k, act.air_k),
            "boiler_0@natural_gas_flow_rate": rep.gas_w,
            "boiler_0@pump_electrical_power": rep.pump_w,
            "boiler_0@supply_water_setpoint": act.water_k,
            "boiler_0@supply_water_temperature_sensor": s.water_temp,
            "boiler_0@return_water_temperature_sensor": rep.return_water_temp,
            "outside@outside_air_temperature_sensor": rep.outside_temp,
            "action@supply_water_setpoint": act.water_k,
            "action@supply_air_heating_temperature_setpoint": act.air_k,
            "action@clipped": float(act.clipped),
            "reward@reward": b.reward,
            "reward@comfort": b.comfort,
            "reward@energy_cost": b.energy_cost,
            "reward@carbon": b.carbon,
            "reward@productivity": b.productivity_usd,
            "reward@electricity_cost": b.electricity_cost_usd,
            "reward@natural_gas_cost": b.gas_cost_usd,
            "reward@carbon_emitted": b.carbon_kg,
            "reward@total_occupancy": b.occupancy,
            "time@timestamp": self.current_timestamp,
        }
        return {k: float(v) for k, v in row.items()}

    def features(self) -> dict[str, float]:
        """The telemetry row (steps table features)."""
        return self.telemetry()

    def load_state_from_telemetry(
        self,
        row: Mapping[str, float],
        step_index: int | None = None,
        modes: Sequence[int] | np.ndarray | None = None,
        seed: int = 0,
    ) -> str:
        """Put the environment in the state one ``telemetry()`` row describes; return its observation text.

        Why: a logged step (an offline dataset) must be shown to the model as exactly the
        prompt the online environment shows for that state.  Everything the text and the
        physics need is in the row: time, zone temperatures, occupants, water and supply
        temperatures, the setpoints in force, the last step's reward.  What it lacks:
        - ``step_index`` (the episode's step counter): by default the 5-minute steps since
          the configured local ``start_hour`` of the row's day (right for 1-day episodes);
        - the thermostat ``modes`` (0 idle, 1 heating, 2 cooling, 3 night drift): by default
          read off the boxes (reheat valve open: heating; damper open: cooling; else idle),
          which cannot tell a night drift from idling;
        - the weather offset, solved from the logged outside temperature, and the occupancy
          random stream, seeded by ``seed`` (stepping on reproduces the physics, not the
          logged arrivals).
        The episode may be stepped from here: the turn and action counters equal ``step_index``.
        """
        cfg = self.config
        seed = checked_seed(self.name, seed)
        timestamp = float(row["time@timestamp"])
        if step_index is None:
            step_index = self.steps_since_start_hour(timestamp)
        if not 0 <= step_index < cfg.episode_steps:
            raise ValueError(f"step_index {step_index} is outside this episode's 0..{cfg.episode_steps - 1}")
        self._reset(seed)  # fresh containers and random streams; every logged quantity is overwritten below
        self.seed, self.rng = seed, random.Random(seed)
        self.step_index = step_index
        self.start_timestamp = timestamp - step_index * cfg.step_seconds
        start_local = self.local_time(self.start_timestamp)
        self.first_midnight_utc = self.start_timestamp - (start_local - start_local.replace(
            hour=0, minute=0, second=0, microsecond=0)).total_seconds()
        self.weather_offset_k = 0.0  # outside air is linear in the offset: solve it from the logged value
        self.weather_offset_k = float(row["outside@outside_air_temperature_sensor"]) - self._outside(timestamp)
        self._load_plant(row, modes)
        self.turn = self.actions_used = self.env_steps = step_index
        self.done, self.episode_return, self.step_records = False, 0.0, []
        return self.observation()

    def steps_since_start_hour(self, timestamp: float) -> int:
        """Steps since the configured local ``start_hour`` of ``timestamp``'s day (its index in a 1-day episode)."""
        local = self.local_time(timestamp)
        seconds = (local.hour - self.config.start_hour) * SECONDS_PER_HOUR + local.minute * 60 + local.second
        return round((seconds % SECONDS_PER_DAY) / self.config.step_seconds) % self.config.episode_steps

    def _load_plant(self, row: Mapping[str, float], modes: Sequence[int] | np.ndarray | None) -> None:
        """Plant state, setpoints, interval report and reward breakdown from one telemetry row."""
        cfg = self.config

        def per_zone(field: str, scale: float = 1.0) -> np.ndarray:
            return np.array([float(row[f"{z}@{field}"]) * scale for z in self.zone_names])

        damper_Z = per_zone("supply_air_damper_percentage_command", 0.01)
        valve_Z = per_zone("reheat_valve_percentage_command", 0.01)
        if modes is None:
            modes = np.where(valve_Z >= 0.5, HEAT, np.where(damper_Z >= 0.5, COOL, OFF))
        occupancy_Z = np.rint(per_zone("zone_occupancy")).astype(int)
        present_ZO = np.arange(cfg.occupants_per_zone)[None, :] < occupancy_Z[:, None]
        previous = self.local_time(self.current_timestamp - cfg.step_seconds)
        self._state = PlantState(
            zone_temp_Z=per_zone("zone_air_temperature_sensor"),
            mode_Z=np.asarray(modes, dtype=np.int64).copy(),
            water_temp=float(row["boiler_0@supply_water_temperature_sensor"]),
            present_ZO=present_ZO,
            comfort_before=self._is_comfort(previous) if self.step_index > 0 else None,
        )
        self.band = (float(row[f"{self.zone_names[0]}@zone_air_heating_temperature_setpoint"]),
                     float(row[f"{self.zone_names[0]}@zone_air_cooling_temperature_setpoint"]))
        self.setpoints = Setpoints(float(row["boiler_0@supply_water_setpoint"]),
                                   float(row["ahu_0@supply_air_heating_temperature_setpoint"]),
                                   clipped=bool(row.get("action@clipped", 0.0)))
        self.report = IntervalReport(
            outside_temp=float(row["outside@outside_air_temperature_sensor"]),
            flow_Z=per_zone("supply_air_flowrate_sensor"), flow_setpoint_Z=per_zone("supply_air_flowrate_setpoint"),
            damper_Z=damper_Z, valve_Z=valve_Z, discharge_temp_Z=per_zone("discharge_air_temperature_sensor"),
            ahu_flow=float(row["ahu_0@supply_air_flowrate_sensor"]),
            mixed_temp=float(row["ahu_0@mixed_air_temperature_sensor"]),
            supply_temp=float(row["ahu_0@supply_air_temperature_sensor"]),
            supply_fan_w=float(row["ahu_0@supply_fan_electrical_power"]),
            exhaust_fan_w=float(row["ahu_0@exhaust_fan_electrical_power"]),
            coil_electric_w=float(row["ahu_0@air_conditioning_electrical_power"]),
            pump_w=float(row["boiler_0@pump_electrical_power"]), gas_w=float(row["boiler_0@natural_gas_flow_rate"]),
            return_water_temp=float(row["boiler_0@return_water_temperature_sensor"]),
        )
        self.breakdown = RewardBreakdown(
            reward=float(row["reward@reward"]), comfort=float(row["reward@comfort"]),
            energy_cost=float(row["reward@energy_cost"]), carbon=float(row["reward@carbon"]),
            productivity_usd=float(row["reward@productivity"]), electricity_cost_usd=float(row["reward@electricity_cost"]),
            gas_cost_usd=float(row["reward@natural_gas_cost"]), carbon_kg=float(row["reward@carbon_emitted"]),
            occupancy=float(row["reward@total_occupancy"]),
        )
