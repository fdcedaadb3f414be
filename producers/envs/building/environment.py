"""``BuildingHVAC``: the text environment around the plant: episodes, actions, reward, the prompt
and the scripted policies (the heuristic and the random controller)."""

from __future__ import annotations

import calendar
import datetime as dt
import math
import random
from typing import Any, ClassVar

import numpy as np

from producers.envs.base import ANSWER_FORMAT, ActionOutcome, EnvConfig, TextEnv
from producers.envs.building.answers import from_normalized, parse_setpoint_values, to_kelvin, to_normalized
from producers.envs.building.config import (
    JOULES_PER_KWH,
    KWH_PER_KFT3_GAS,
    LIMIT_FIELDS,
    SECONDS_PER_HOUR,
    BuildingConfig,
)
from producers.envs.building.plant import (
    MODE_NAMES,
    OFF,
    IntervalReport,
    Plant,
    PlantState,
    RewardBreakdown,
    Setpoints,
    arrival_probability,
    comfort_regret,
    outside_temperature,
    productivity_per_person_hour,
    thermostat_modes,
    zone_names,
)
from producers.envs.building.telemetry import BuildingTelemetry
from producers.envs.parsing import format_answer

_HEURISTIC_PREHEAT_HOURS = 2.0  # the heuristic warms the building this long before comfort hours
# The heuristic's floor under the supply-water setpoint on days off (weekends), as a value in [-1, 1] of its range.
# On a day off the building sits in setback all day; letting the hot-water loop go cold there (the range's low end)
# costs more than it saves: measured over days 0-20, the two weekends improve from -43 / -44 / -34 / -34 per day to
# -31 ... -27, and the heuristic then beats the random controller on every day (+3.4 per day on average).  On
# workdays a floor does not pay (-0.5 at night cost 1.2 per day), so there is none.
_HEURISTIC_DAY_OFF_WATER_FLOOR = 0.0


class BuildingHVAC(BuildingTelemetry, TextEnv[Setpoints]):
    """Set the boiler's water and the air handler's supply-air setpoints every 5 minutes."""

    name: ClassVar[str] = "building-hvac"
    long_horizon: ClassVar[bool] = True
    description: ClassVar[str] = (
        "Building climate control: you run the heating plant of a small office building. Every 5 minutes "
        "you set the boiler's supply-water temperature setpoint and the air handler's supply-air heating "
        "setpoint. Each zone's thermostat heats it (hot-water reheat and full air flow) when it falls below "
        "its heating setpoint, cools when above its cooling setpoint, and otherwise only ventilates. "
        "Hotter water heats zones faster but burns more gas; warmer supply air uses electricity. "
        "Reward each step in [-1, 0]: minus a weighted sum of lost occupant comfort (occupied zones outside "
        "the band), energy cost (time-of-use electricity, gas) and carbon, each relative to full capacity."
    )
    Config: ClassVar[type[EnvConfig]] = BuildingConfig
    config: BuildingConfig

    def __init__(self, config: EnvConfig | None = None, **overrides: Any) -> None:
        if overrides and (config is None or isinstance(config, self.Config)):
            config = self._with_overrides(config, overrides)
            overrides = {}
        super().__init__(config, **overrides)
        self.plant = Plant(self.config)
        self.zone_names = zone_names(self.config.grid_rows, self.config.grid_cols)
        self._state: PlantState | None = None

    @classmethod
    def _with_overrides(cls, config: BuildingConfig | None, overrides: dict[str, Any]) -> BuildingConfig:
        """Apply overrides, re-deriving limits that only followed the old episode length (e.g. episode_days=14)."""
        base = config if config is not None else cls.Config()
        data = base.model_dump()
        for name in LIMIT_FIELDS:
            if name not in overrides and data[name] == base.episode_steps:
                del data[name]
        return cls.Config.model_validate(data | overrides)

    # ---- episode ----------------------------------------------------------------------------
    def _reset(self, seed: int) -> None:
        cfg = self.config
        gen = np.random.default_rng(seed)
        self.gen = gen
        jitter_days = int(gen.integers(0, cfg.start_day_jitter_days + 1))
        start_day = cfg.start_date + dt.timedelta(days=jitter_days)
        self.first_midnight_utc = calendar.timegm(start_day.timetuple()) - cfg.utc_offset_hours * SECONDS_PER_HOUR
        self.start_timestamp = self.first_midnight_utc + cfg.start_hour * SECONDS_PER_HOUR
        self.weather_offset_k = float(gen.uniform(-cfg.weather_jitter_k, cfg.weather_jitter_k))
        jitter = cfg.initial_temp_jitter_k
        self._state = PlantState(
            zone_temp_Z=cfg.initial_zone_temp_k + gen.uniform(-jitter, jitter, cfg.num_zones),
            mode_Z=np.full(cfg.num_zones, OFF),
            water_temp=cfg.initial_supply_water_k,
            present_ZO=np.zeros((cfg.num_zones, cfg.occupants_per_zone), dtype=bool),
        )
        self.setpoints = Setpoints(cfg.initial_supply_water_k, cfg.initial_supply_air_heating_k)
        self.step_index = 0
        self.band = self._band(self.start_timestamp)
        self.report = IntervalReport(
            outside_temp=self._outside(self.start_timestamp),
            flow_Z=np.zeros(cfg.num_zones), flow_setpoint_Z=np.zeros(cfg.num_zones),
            damper_Z=np.zeros(cfg.num_zones), valve_Z=np.zeros(cfg.num_zones),
            discharge_temp_Z=np.full(cfg.num_zones, cfg.initial_supply_air_heating_k),
            mixed_temp=cfg.initial_supply_air_heating_k, supply_temp=cfg.initial_supply_air_heating_k,
            return_water_temp=cfg.initial_supply_water_k,
        )
        self.breakdown = RewardBreakdown()

    @property
    def current_timestamp(self) -> float:
        """UTC epoch seconds now: the end of the last step (the episode start before any step)."""
        return self.start_timestamp + self.step_index * self.config.step_seconds

    def current_time_iso(self) -> str:
        """The current time as ISO 8601 in UTC."""
        return dt.datetime.fromtimestamp(self.current_timestamp, tz=dt.UTC).isoformat()

    def start_time_iso(self) -> str:
        """The episode's start as ISO 8601 in UTC."""
        return dt.datetime.fromtimestamp(self.start_timestamp, tz=dt.UTC).isoformat()

    def local_time(self, timestamp: float | None = None) -> dt.datetime:
        """Naive local wall-clock time (UTC + utc_offset_hours) at ``timestamp`` (default: now)."""
        ts = self.current_timestamp if timestamp is None else timestamp
        return dt.datetime.fromtimestamp(ts + self.config.utc_offset_hours * SECONDS_PER_HOUR, tz=dt.UTC).replace(
            tzinfo=None
        )

    def _is_comfort(self, local: dt.datetime) -> bool:
        cfg = self.config
        return local.weekday() < 5 and cfg.comfort_start_hour <= local.hour < cfg.comfort_end_hour

    def _band(self, timestamp: float) -> tuple[float, float]:
        return self.config.comfort_band_k if self._is_comfort(self.local_time(timestamp)) else self.config.eco_band_k

    def _outside(self, timestamp: float) -> float:
        hours = (timestamp - self.first_midnight_utc) / SECONDS_PER_HOUR
        return outside_temperature(hours, self.weather_offset_k, self.config)

    # ---- actions --------------------------------------------------------------------------------
    def _parse_action(self, text: str) -> Setpoints | None:
        values = parse_setpoint_values(text)
        if values is None:
            return None
        cfg = self.config
        water = to_kelvin(values[0], cfg.supply_water_range_k)
        air = to_kelvin(values[1], cfg.supply_air_heating_range_k)
        if water is None or air is None:
            return None
        return Setpoints(water[0], air[0], clipped=water[1] or air[1])

    def _idle_action(self) -> Setpoints:
        return Setpoints(self.setpoints.water_k, self.setpoints.air_k)  # held, as the offline evaluation does

    def _describe_idle(self, action: Setpoints) -> str:
        return f"the setpoints held at {action.water_k:g} K and {action.air_k:g} K"

    def _apply_action(self, action: Setpoints) -> ActionOutcome:
        cfg = self.config
        s = self._require_state()
        t0 = self.current_timestamp
        local = self.local_time(t0)
        comfort = self._is_comfort(local)
        self.band = cfg.comfort_band_k if comfort else cfg.eco_band_k
        s.mode_Z = thermostat_modes(s.zone_temp_Z, s.mode_Z, self.band, comfort, s.comfort_before)
        s.comfort_before = comfort
        self._update_occupancy(s, local)
        occupancy_Z = s.present_ZO.sum(axis=1).astype(float)
        self.setpoints = action
        self.report = self.plant.advance(s, action, occupancy_Z, lambda sec: self._outside(t0 + sec))
        self.breakdown = self._reward(s, occupancy_Z, local)
        self.step_index += 1
        note = (f"setpoints clipped to their ranges: water {action.water_k:g} K, air {action.air_k:g} K"
                if action.clipped else "")
        return ActionOutcome(reward=self.breakdown.reward, note=note)

    def _update_occupancy(self, s: PlantState, local: dt.datetime) -> None:
        """Each occupant: away -> in with p during arrival hours; in -> away with p once departures start."""
        cfg = self.config
        if local.weekday() >= 5:
            s.present_ZO[:] = False
            return
        draws = self.gen.random(s.present_ZO.shape)
        if cfg.arrival_hours[0] <= local.hour <= cfg.arrival_hours[1]:
            p_in = arrival_probability(*cfg.arrival_hours, cfg.step_seconds)
            s.present_ZO |= ~s.present_ZO & (draws < p_in)
        elif local.hour >= cfg.departure_hours[0]:
            p_out = arrival_probability(*cfg.departure_hours, cfg.step_seconds)
            s.present_ZO &= ~(draws < p_out)

    def _reward(self, s: PlantState, occupancy_Z: np.ndarray, local: dt.datetime) -> RewardBreakdown:
        """-(w_c comfort + w_e energy + w_g carbon) / sum(w); rates capped at full capacity as in the reference."""
        cfg, rep, plant = self.config, self.report, self.plant
        seconds = cfg.step_seconds
        electric_w = min(rep.supply_fan_w + rep.exhaust_fan_w + rep.coil_electric_w + rep.pump_w, plant.max_electric_w)
        gas_w = min(rep.gas_w, plant.max_gas_w)
        prices = cfg.weekday_price_cents_per_kwh if local.weekday() < 5 else cfg.weekend_price_cents_per_kwh
        usd_per_j_elec = prices[local.hour] / 100.0 / JOULES_PER_KWH
        usd_per_j_gas = cfg.gas_price_usd_per_kft3[local.month - 1] / KWH_PER_KFT3_GAS / JOULES_PER_KWH
        kg_per_j_elec = cfg.electricity_carbon_kg_per_mwh[local.hour] / 1000.0 / JOULES_PER_KWH
        kg_per_j_gas = cfg.gas_carbon_kg_per_kft3 / KWH_PER_KFT3_GAS / JOULES_PER_KWH
        elec_cost, gas_cost = usd_per_j_elec * electric_w * seconds, usd_per_j_gas * gas_w * seconds
        max_cost = (usd_per_j_elec * plant.max_electric_w + usd_per_j_gas * plant.max_gas_w) * seconds
        carbon = (kg_per_j_elec * electric_w + kg_per_j_gas * gas_w) * seconds
        max_carbon = (kg_per_j_elec * plant.max_electric_w + kg_per_j_gas * plant.max_gas_w) * seconds
        comfort = comfort_regret(occupancy_Z, s.zone_temp_Z, self.band, cfg)
        energy = (elec_cost + gas_cost) / max_cost if max_cost > 0 else 0.0
        carbon_norm = carbon / max_carbon if max_carbon > 0 else 0.0
        weights = cfg.productivity_weight + cfg.energy_cost_weight + cfg.carbon_weight
        total = cfg.productivity_weight * comfort + cfg.energy_cost_weight * energy + cfg.carbon_weight * carbon_norm
        productivity = float(productivity_per_person_hour(s.zone_temp_Z, self.band, cfg) @ occupancy_Z)
        return RewardBreakdown(
            reward=-min(max(total / weights, 0.0), 1.0),
            comfort=comfort, energy_cost=energy, carbon=carbon_norm,
            productivity_usd=productivity * seconds / SECONDS_PER_HOUR,
            electricity_cost_usd=elec_cost, gas_cost_usd=gas_cost, carbon_kg=carbon,
            occupancy=float(occupancy_Z.sum()),
        )

    def _require_state(self) -> PlantState:
        if self._state is None:
            raise RuntimeError(f"{self.name}: call reset(seed) before using the environment")
        return self._state

    # ---- text -----------------------------------------------------------------------------------
    def _render(self) -> str:
        cfg, s, rep, b = self.config, self._require_state(), self.report, self.breakdown
        local = self.local_time()
        in_comfort = self._is_comfort(local)
        band = cfg.comfort_band_k if in_comfort else cfg.eco_band_k
        comfort = "comfort hours" if in_comfort else "outside comfort hours"
        sign = "+" if cfg.utc_offset_hours >= 0 else "-"
        lines = [
            f"{local:%a %Y-%m-%d %H:%M} local time (UTC{sign}{abs(cfg.utc_offset_hours):g}), "
            f"step {self.step_index} of {cfg.episode_steps} ({cfg.step_seconds // 60} min each).",
            f"Now {comfort}: zone setpoints {band[0]:g}-{band[1]:g} K "
            f"(comfort {cfg.comfort_band_k[0]:g}-{cfg.comfort_band_k[1]:g} K, "
            f"{cfg.comfort_start_hour:02d}-{cfg.comfort_end_hour:02d} h on workdays).",
            f"Outside air: {rep.outside_temp:.1f} K.",
            "Zones:",
        ]
        occupancy_Z = s.present_ZO.sum(axis=1)
        for name, temp, people, mode in zip(self.zone_names, s.zone_temp_Z, occupancy_Z, s.mode_Z, strict=True):
            lines.append(f"  {name}: {temp:.1f} K, {int(people)} occupants, {MODE_NAMES[int(mode)]}")
        lines += [
            f"Hot water: {s.water_temp:.1f} K (setpoint {self.setpoints.water_k:.1f} K). "
            f"Supply air: {rep.supply_temp:.1f} K (heating setpoint {self.setpoints.air_k:.1f} K).",
            self._render_reward(b),
            self.action_help(),
        ]
        return "\n".join(lines)

    def _render_reward(self, b: RewardBreakdown) -> str:
        cfg = self.config
        if self.step_index == 0:
            return "Last step: none yet."
        total = cfg.productivity_weight + cfg.energy_cost_weight + cfg.carbon_weight
        wc, we, wg = (w / total for w in (cfg.productivity_weight, cfg.energy_cost_weight, cfg.carbon_weight))
        return (
            f"Last step reward {b.reward:.3f} = -({wc:.2g} x comfort regret {b.comfort:.2f} "
            f"+ {we:.2g} x energy cost {b.energy_cost:.2f} + {wg:.2g} x carbon {b.carbon:.2f})."
        )

    def action_help(self) -> str:
        """The allowed answer format, with this configuration's ranges."""
        (w_lo, w_hi), (a_lo, a_hi) = self.config.supply_water_range_k, self.config.supply_air_heating_range_k
        return (
            f"Answer two values, supply-water setpoint ({w_lo:g}-{w_hi:g} K) then supply-air heating setpoint "
            f"({a_lo:g}-{a_hi:g} K), each in [-1, 1] (-1 = lowest) or in kelvin with K; "
            "e.g. <answer>0.2, -0.5</answer> or <answer>330K, 292K</answer>."
        )

    def system_prompt(self) -> str:
        return f"{self.description}\n{self.action_help()}\n{ANSWER_FORMAT}"

    # ---- numbers ------------------------------------------------------------------------------
    def numeric_state_names(self) -> list[str]:
        """Names of ``numeric_state()``'s entries, in order."""
        return (
            [f"{z}@zone_air_temperature_sensor" for z in self.zone_names]
            + ["outside@outside_air_temperature_sensor"]
            + [f"{z}@zone_occupancy" for z in self.zone_names]
            + ["time@hour_sin", "time@hour_cos", "time@is_workday"]
        )

    def numeric_state(self) -> list[float]:
        """Zone temperatures (K), outside air (K), occupants per zone, sin/cos of the local hour, workday flag."""
        s = self._require_state()
        local = self.local_time()
        angle = 2.0 * math.pi * (local.hour + local.minute / 60.0) / 24.0
        return (
            [float(t) for t in s.zone_temp_Z]
            + [float(self.report.outside_temp)]
            + [float(n) for n in s.present_ZO.sum(axis=1)]
            + [math.sin(angle), math.cos(angle), float(local.weekday() < 5)]
        )

    def action_vector(self, action: Setpoints) -> list[float]:
        """The action as the agent's normalised pair in [-1, 1] (water, air)."""
        cfg = self.config
        return [
            to_normalized(action.water_k, cfg.supply_water_range_k),
            to_normalized(action.air_k, cfg.supply_air_heating_range_k),
        ]

    # ---- policies -------------------------------------------------------------------------------
    def heuristic_setpoints(self, preheat_hours: float = _HEURISTIC_PREHEAT_HOURS) -> tuple[float, float]:
        """A thermostat-like supervisor: hot water (then warmer air) while watched zones are cold, standby otherwise.

        Watched zones are the occupied ones, or all when nobody is in.  Their target is the
        comfort band's low edge plus 0.5 K during comfort hours and the ``preheat_hours`` (default
        ``_HEURISTIC_PREHEAT_HOURS``) before them, and the zones' current (eco) heating setpoint plus
        0.5 K otherwise (setback).  The water setpoint rises with the coldest watched zone's deficit, from the range's low end on
        workdays and from ``_HEURISTIC_DAY_OFF_WATER_FLOOR`` on days off; the supply air warms only
        when a zone is more than 1.5 K short, as electric heat costs more than gas.
        """
        cfg, s = self.config, self._require_state()
        (w_lo, w_hi), (a_lo, a_hi) = cfg.supply_water_range_k, cfg.supply_air_heating_range_k
        local = self.local_time()
        hour = local.hour + local.minute / 60.0
        occupied_Z = s.present_ZO.any(axis=1)
        preheat_from = cfg.comfort_start_hour - preheat_hours
        preheat = local.weekday() < 5 and preheat_from <= hour < cfg.comfort_end_hour
        target = (cfg.comfort_band_k[0] if preheat else self._band(self.current_timestamp)[0]) + 0.5
        watched_Z = s.zone_temp_Z[occupied_Z] if occupied_Z.any() else s.zone_temp_Z
        deficit = target - float(watched_Z.min())
        day_off = local.weekday() >= 5
        floor = from_normalized(_HEURISTIC_DAY_OFF_WATER_FLOOR, cfg.supply_water_range_k) if day_off else w_lo
        if deficit <= 0.0:
            return floor, a_lo
        water = max(floor, min(w_hi, w_lo + (20.0 + 25.0 * deficit) / 45.0 * (w_hi - w_lo)))
        air = min(a_hi, a_lo + max(0.0, deficit - 1.5) * 0.5 * (a_hi - a_lo))
        return water, air

    def heuristic_answer(self, preheat_hours: float = _HEURISTIC_PREHEAT_HOURS) -> str:
        water, air = self.heuristic_setpoints(preheat_hours)
        return format_answer([f"{water:.1f}K, {air:.1f}K"])

    def random_answer(self, rng: random.Random) -> str:
        return format_answer([f"{rng.uniform(-1, 1):.2f}, {rng.uniform(-1, 1):.2f}"])
