"""Building climate control after Google's smart-buildings simulator (``sbsim``), as a text environment.

A small office building: ``grid_rows x grid_cols`` thermal zones (2 x 2 by
default) that conduct heat to their grid neighbours and lose it to outside air.
One air handler mixes recirculated return air with outside air and heats (or
cools) it to its supply-air setpoint; one variable-air-volume (VAV) box per zone,
driven by the zone's thermostat (heat / cool / off), sets the zone's air flow and
reheats its air with hot water from one boiler.  Every 300 s the agent sets two
numbers, the boiler's supply-water setpoint (310-355 K) and the air handler's
supply-air heating setpoint (285-300 K), each as a value in [-1, 1] or in kelvin.

What follows the reference (``smart_control``'s simulator, its 1-day training gin
config and ``SetpointEnergyCarbonRegretFunction``) and why:
- Thermostat: comfort band 294-297 K from 06 to 19 h on workdays, eco band
  289-298 K otherwise.  Below the heating setpoint the box heats (damper and
  reheat valve open) until the band's midpoint; above the cooling setpoint it
  cools (damper open, valve shut) until the midpoint; otherwise it idles at a 10 %
  damper for ventilation.  On entering eco it drifts ("passive cool") until the
  zone falls below the eco heating setpoint.  Modes change once per step.
- Air handler: mixed air = r * return + (1 - r) * outside with the reference's
  recirculation r = 0.3; supply air = mixed air raised to the heating setpoint or
  lowered to the cooling setpoint (298 K).  Its coil's thermal power counts as
  electric power (divided by a COP, 1 for heating as in the reference); the
  blowers are a supply fan (all the flow) and an exhaust fan (the outside air).
- Boiler: burns gas to hold its water tank (1.5 m^3) at the setpoint; pump power
  = flow * g * head / efficiency.  Occupancy: each occupant arrives between 07 and
  12 h and leaves from 13 h with per-step probabilities that put the expected
  event halfway through the window (the reference's geometric model); nobody
  comes on weekends.
- Reward in [-1, 0]: -(0.2 c + 0.4 e + 0.4 g) / (0.2 + 0.4 + 0.4), where c is the
  productivity regret of occupied zones (a logistic decay outside the zone's
  setpoints; 300 $ per person-hour at best, 100 at worst), e the electricity (time-
  of-use price) plus gas (monthly price) cost, and g the carbon of both, e and g
  each divided by their value at full capacity.  Prices and carbon rates are the
  reference's tables (PG&E time of use, EIA monthly gas, an hourly grid carbon
  profile).

Departures, each chosen for a small fast model that keeps the trade-offs:
- Lumped zones (one temperature each) on a coarse grid instead of the reference's
  10 cm finite-difference mesh; no solar gains.  One episode-day (288 steps) runs
  in a fraction of a second.
- VAV reheat is a heat exchanger with a fixed effectiveness (the reference's mixing
  formula can heat air above the water temperature); the boiler is an energy
  balance on its tank with a burner capacity (about the reference's 0.5 K/min
  heat-up), a loss to outside air that includes the hot water loop (40 W/K; the
  reference's insulated tank alone loses about 6 W/K) and a condensing efficiency
  that falls as the return water warms, so keeping the water hot costs gas.  Zones
  are heated by the actual water temperature, not the setpoint.
- Fan pressure 1500 Pa at 70 % efficiency (the reference's 10 kPa would make the
  fans of a 400 m^2 building draw 13 kW).
- The default episode is 1 day (288 steps) starting at local midnight of a
  workday in January, for an LLM agent that answers once per step; the reference
  trains on 14-day episodes (set ``episode_days=14``).
- Local time is UTC + ``utc_offset_hours`` (fixed; no daylight saving).

An invalid answer costs the format penalty and does not move the clock.
"""

from __future__ import annotations

import calendar
import datetime as dt
import math
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field, field_validator, model_validator

from producers.envs.base import ANSWER_FORMAT, ActionOutcome, EnvConfig, TextEnv
from producers.envs.parsing import format_answer

# ---- physical constants ---------------------------------------------------------------------
AIR_DENSITY = 1.2  # kg/m^3
AIR_HEAT_CAPACITY = 1006.0  # J/kg/K
WATER_DENSITY = 1000.0  # kg/m^3
WATER_HEAT_CAPACITY = 4180.0  # J/kg/K
GRAVITY = 9.8  # m/s^2
JOULES_PER_KWH = 3.6e6
KWH_PER_KFT3_GAS = 293.07107  # kWh of heat in 1000 cubic feet of natural gas
SECONDS_PER_HOUR = 3600.0
SECONDS_PER_DAY = 86_400.0
RETURN_COLD_K, RETURN_HOT_K = 310.0, 330.0  # boiler efficiency ramps between these return temperatures

# Thermostat (VAV box) modes.
OFF, HEAT, COOL, PASSIVE = 0, 1, 2, 3
MODE_NAMES = {OFF: "idle", HEAT: "heating", COOL: "cooling", PASSIVE: "idle (night drift)"}

# ---- the reference's tariffs (smart_control/reward/*_energy_cost.py) -------------------------
WEEKDAY_PRICE_CENTS_PER_KWH = (16.0,) * 6 + (18.0,) * 6 + (20.0,) * 7 + (16.0,) * 5  # PG&E time of use
WEEKEND_PRICE_CENTS_PER_KWH = (16.0,) * 24
ELECTRICITY_CARBON_KG_PER_MWH = (  # hourly grid carbon intensity, local hours 0..23
    88.20, 87.79, 87.88, 87.83, 88.00, 88.20, 89.71, 93.98, 98.86, 100.79, 101.39, 101.78,
    102.59, 103.44, 104.14, 104.74, 102.07, 97.04, 93.58, 92.46, 91.73, 90.69, 89.77, 89.00,
)
GAS_PRICE_USD_PER_KFT3 = (9.02, 8.35, 7.77, 7.26, 6.69, 6.86, 6.77, 6.76, 6.99, 7.19, 7.96, 8.98)  # EIA, by month
GAS_CARBON_KG_PER_KFT3 = 53.12

# The fields that bound an episode's length; by default they all equal the episode's steps.
LIMIT_FIELDS = ("max_turns", "max_actions_total", "max_env_steps")
_HEURISTIC_PREHEAT_HOURS = 2.0  # the heuristic warms the building this long before comfort hours
# The heuristic's floor under the supply-water setpoint on days off (weekends), as a value in [-1, 1] of its range.
# On a day off the building sits in setback all day; letting the hot-water loop go cold there (the range's low end)
# costs more than it saves: measured over days 0-20, the two weekends improve from -43 / -44 / -34 / -34 per day to
# -31 ... -27, and the heuristic then beats the random controller on every day (+3.4 per day on average).  On
# workdays a floor does not pay (-0.5 at night cost 1.2 per day), so there is none.
_HEURISTIC_DAY_OFF_WATER_FLOOR = 0.0


def _episode_steps(days: float, step_seconds: int) -> int:
    return max(1, round(days * SECONDS_PER_DAY / step_seconds))


class BuildingConfig(EnvConfig):
    """The building, its plant, weather, occupancy, tariffs and reward; defaults as in the module docstring."""

    # ---- limits: one action per turn, every limit = the episode's steps (filled in when not given) ----
    max_actions_per_turn: int = Field(1, ge=1, le=1_000, description="Actions (5-minute steps) applied per answer.")
    history_turns: int = Field(2, ge=0, le=64, description="Recent turns the producer keeps in context.")

    # ---- time ----
    episode_days: float = Field(
        1.0, gt=0.0, le=300.0,
        description="Episode span in days (default 1 day = 288 steps for an LLM agent; the reference uses 14).",
    )
    step_seconds: int = Field(300, ge=60, le=3_600, description="Simulated seconds per step (reference 300).")
    substeps: int = Field(5, ge=1, le=600, description="Integration sub-steps per step (explicit Euler).")
    start_date: dt.date = Field(dt.date(2023, 1, 5), description="Local date the episode starts (a Thursday).")
    start_hour: float = Field(0.0, ge=0.0, lt=24.0, description="Local hour the episode starts.")
    start_day_jitter_days: int = Field(
        0, ge=0, le=365, description="The seed moves the start forward by 0..N whole days (0: fixed start)."
    )
    utc_offset_hours: float = Field(-8.0, ge=-12.0, le=14.0, description="Local time = UTC + this (no DST).")

    # ---- building ----
    grid_rows: int = Field(2, ge=1, le=8, description="Zone rows in the floor grid.")
    grid_cols: int = Field(2, ge=1, le=8, description="Zone columns in the floor grid.")
    zone_heat_capacity_j_per_k: float = Field(
        6.0e6, gt=1.0e4, le=1.0e9, description="Heat capacity of one zone's air, furniture and inner mass (J/K)."
    )
    exterior_wall_ua_w_per_k: float = Field(
        60.0, ge=0.0, le=1.0e5, description="Loss to outside per exposed side of a zone (W/K)."
    )
    roof_floor_ua_w_per_k: float = Field(
        50.0, ge=0.0, le=1.0e5, description="Loss to outside of every zone through roof, floor and infiltration (W/K)."
    )
    interior_ua_w_per_k: float = Field(
        200.0, ge=0.0, le=1.0e5, description="Conductance between neighbouring zones (walls and air exchange) (W/K)."
    )
    occupants_per_zone: int = Field(8, ge=0, le=1_000, description="People assigned to each zone.")
    occupant_heat_gain_w: float = Field(100.0, ge=0.0, le=1_000.0, description="Sensible heat per person present (W).")
    initial_zone_temp_k: float = Field(294.0, ge=260.0, le=320.0, description="Zone temperature at the start (K).")
    initial_temp_jitter_k: float = Field(0.5, ge=0.0, le=10.0, description="Seeded +/- spread of start temperatures.")

    # ---- weather ----
    weather_mode: Literal["sinusoid", "table"] = Field(
        "sinusoid", description="'sinusoid': low at midnight, high at noon; 'table': replay weather_table_k."
    )
    outside_low_k: float = Field(273.0, ge=200.0, le=340.0, description="Sinusoid minimum, at midnight (K).")
    outside_high_k: float = Field(283.0, ge=200.0, le=340.0, description="Sinusoid maximum, at noon (K).")
    weather_table_k: tuple[float, ...] = Field(
        (), max_length=100_000,
        description="Hourly outside temperatures (K) from local midnight of the first day; interpolated, repeated.",
    )
    weather_jitter_k: float = Field(1.0, ge=0.0, le=20.0, description="Seeded +/- offset of the whole weather (K).")

    # ---- air handler and VAV boxes ----
    ahu_recirculation: float = Field(0.3, ge=0.0, le=1.0, description="Fraction of return air recirculated.")
    ahu_cooling_setpoint_k: float = Field(298.0, ge=270.0, le=320.0, description="Supply-air cooling setpoint (K).")
    ahu_max_flow_m3s: float | None = Field(
        None, gt=0.0, le=1_000.0, description="Air handler flow limit (m^3/s); None: the boxes' maxima summed."
    )
    ahu_coil_max_power_w: float = Field(40_000.0, gt=0.0, le=1.0e8, description="Coil thermal capacity (W).")
    ahu_heating_cop: float = Field(1.0, gt=0.0, le=10.0, description="Heat per electric watt of the coil heating.")
    ahu_cooling_cop: float = Field(3.0, gt=0.0, le=10.0, description="Heat removed per electric watt, cooling.")
    fan_pressure_pa: float = Field(1_500.0, ge=0.0, le=20_000.0, description="Supply fan pressure rise (Pa).")
    fan_efficiency: float = Field(0.7, gt=0.0, le=1.0, description="Supply fan efficiency.")
    vav_max_flow_m3s: float = Field(0.3, gt=0.0, le=100.0, description="Air flow of a VAV box, damper open (m^3/s).")
    vav_min_damper: float = Field(0.1, ge=0.0, le=1.0, description="Damper opening when idle (ventilation).")
    vav_max_water_flow_kg_s: float = Field(0.1, gt=0.0, le=100.0, description="Reheat water flow, valve open (kg/s).")
    reheat_effectiveness: float = Field(0.6, gt=0.0, le=1.0, description="Reheat coil heat-exchanger effectiveness.")

    # ---- boiler ----
    boiler_max_gas_w: float = Field(80_000.0, gt=0.0, le=1.0e8, description="Burner capacity (gas burned, W).")
    boiler_tank_m3: float = Field(1.5, gt=0.0, le=100.0, description="Hot water tank volume (m^3).")
    boiler_loss_w_per_k: float = Field(
        40.0, ge=0.0, le=1.0e4, description="Tank and hot water loop loss to outside air (W/K); tank alone ~6."
    )
    boiler_efficiency_cold_return: float = Field(
        0.95, gt=0.0, le=1.0, description=f"Efficiency when the return water is below {RETURN_COLD_K:g} K."
    )
    boiler_efficiency_hot_return: float = Field(
        0.85, gt=0.0, le=1.0, description=f"Efficiency when the return water is above {RETURN_HOT_K:g} K."
    )
    pump_head_m: float = Field(6.0, ge=0.0, le=200.0, description="Hot water pump head (m).")
    pump_efficiency: float = Field(0.98, gt=0.0, le=1.0, description="Hot water pump efficiency.")

    # ---- actions ----
    supply_water_range_k: tuple[float, float] = Field((310.0, 355.0), description="Supply-water setpoint range (K).")
    supply_air_heating_range_k: tuple[float, float] = Field(
        (285.0, 300.0), description="Supply-air heating setpoint range (K)."
    )
    initial_supply_water_k: float = Field(340.0, ge=250.0, le=400.0, description="Water setpoint before step 1 (K).")
    initial_supply_air_heating_k: float = Field(285.0, ge=250.0, le=400.0, description="Air setpoint before step 1.")

    # ---- schedule and occupancy ----
    comfort_start_hour: int = Field(6, ge=0, le=23, description="Comfort hours start (local hour, workdays).")
    comfort_end_hour: int = Field(19, ge=1, le=24, description="Comfort hours end (local hour, exclusive).")
    comfort_band_k: tuple[float, float] = Field((294.0, 297.0), description="Heating/cooling setpoints, comfort.")
    eco_band_k: tuple[float, float] = Field((289.0, 298.0), description="Heating/cooling setpoints outside comfort.")
    arrival_hours: tuple[int, int] = Field((7, 12), description="Earliest and latest hour of arrivals.")
    departure_hours: tuple[int, int] = Field((13, 18), description="Departures start at the first hour; expected mid.")

    # ---- reward ----
    productivity_weight: float = Field(0.2, ge=0.0, le=1.0, description="Weight of the comfort regret.")
    energy_cost_weight: float = Field(0.4, ge=0.0, le=1.0, description="Weight of the energy cost.")
    carbon_weight: float = Field(0.4, ge=0.0, le=1.0, description="Weight of the carbon emission.")
    max_productivity_usd: float = Field(300.0, gt=0.0, le=1.0e5, description="Productivity in band ($/person-h).")
    min_productivity_usd: float = Field(100.0, ge=0.0, le=1.0e5, description="Productivity floor ($/person-h).")
    productivity_midpoint_delta_k: float = Field(
        0.5, ge=0.0, le=10.0, description="Distance outside the setpoints where productivity is halved (K)."
    )
    productivity_decay_stiffness: float = Field(4.3, gt=0.0, le=100.0, description="Slope of the decay (1/K).")
    weekday_price_cents_per_kwh: tuple[float, ...] = Field(
        WEEKDAY_PRICE_CENTS_PER_KWH, description="Electricity price by local hour on workdays (24 values)."
    )
    weekend_price_cents_per_kwh: tuple[float, ...] = Field(
        WEEKEND_PRICE_CENTS_PER_KWH, description="Electricity price by local hour on weekends (24 values)."
    )
    electricity_carbon_kg_per_mwh: tuple[float, ...] = Field(
        ELECTRICITY_CARBON_KG_PER_MWH, description="Grid carbon by local hour (24 values)."
    )
    gas_price_usd_per_kft3: tuple[float, ...] = Field(
        GAS_PRICE_USD_PER_KFT3, description="Gas price by month, $ per 1000 cubic feet (12 values)."
    )
    gas_carbon_kg_per_kft3: float = Field(GAS_CARBON_KG_PER_KFT3, ge=0.0, le=1_000.0, description="Gas carbon.")

    @model_validator(mode="before")
    @classmethod
    def _limits_default_to_episode(cls, data: Any) -> Any:
        """Limits not given equal the episode's steps, so one answer per 5-minute step fills the episode."""
        if not isinstance(data, dict):
            return data
        try:
            days = float(data.get("episode_days", cls.model_fields["episode_days"].default))
            step = int(data.get("step_seconds", cls.model_fields["step_seconds"].default))
            steps = _episode_steps(days, step)
        except (TypeError, ValueError, ZeroDivisionError, OverflowError):
            return data  # the field validators report the bad value
        return {name: steps for name in LIMIT_FIELDS} | data

    @field_validator("weekday_price_cents_per_kwh", "weekend_price_cents_per_kwh", "electricity_carbon_kg_per_mwh")
    @classmethod
    def _hourly(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        return _check_table(v, 24, "by hour")

    @field_validator("gas_price_usd_per_kft3")
    @classmethod
    def _monthly(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        return _check_table(v, 12, "by month")

    @field_validator("weather_table_k")
    @classmethod
    def _weather_table(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if any(not (200.0 <= t <= 340.0) for t in v):
            raise ValueError("weather_table_k: every temperature must be in kelvin, within [200, 340]")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> BuildingConfig:
        for name in ("supply_water_range_k", "supply_air_heating_range_k", "comfort_band_k", "eco_band_k"):
            low, high = getattr(self, name)
            if not low < high:
                raise ValueError(f"{name}: the first value must be below the second, got ({low}, {high})")
        if not (self.arrival_hours[0] < self.arrival_hours[1] < self.departure_hours[0] < self.departure_hours[1]):
            raise ValueError("arrival_hours and departure_hours must be increasing: arrive < arrive < leave < leave")
        if self.departure_hours[1] > 24 or self.arrival_hours[0] < 0:
            raise ValueError("arrival_hours and departure_hours must lie within 0..24")
        if self.comfort_start_hour >= self.comfort_end_hour:
            raise ValueError("comfort_start_hour must be before comfort_end_hour")
        if self.outside_low_k > self.outside_high_k:
            raise ValueError("outside_low_k must not exceed outside_high_k")
        if self.weather_mode == "table" and not self.weather_table_k:
            raise ValueError("weather_mode='table' needs weather_table_k (hourly temperatures in K)")
        if self.min_productivity_usd >= self.max_productivity_usd:
            raise ValueError("min_productivity_usd must be below max_productivity_usd")
        if self.productivity_weight + self.energy_cost_weight + self.carbon_weight <= 0.0:
            raise ValueError("at least one reward weight must be positive")
        if self.episode_steps > 100_000:
            raise ValueError(f"episode of {self.episode_steps} steps is too long; shorten episode_days")
        self._check_stability()
        return self

    def _check_stability(self) -> None:
        """Explicit Euler needs sub-step * conductance / capacity well below 1 for every zone."""
        conductance = (
            self.vav_max_flow_m3s * AIR_DENSITY * AIR_HEAT_CAPACITY
            + 4 * (self.interior_ua_w_per_k + self.exterior_wall_ua_w_per_k)
            + self.roof_floor_ua_w_per_k
        )
        ratio = self.step_seconds / self.substeps * conductance / self.zone_heat_capacity_j_per_k
        if ratio > 0.5:
            raise ValueError(
                f"zone integration unstable (dt*G/C = {ratio:.2f} > 0.5); raise substeps or zone_heat_capacity_j_per_k"
            )

    @property
    def episode_steps(self) -> int:
        """Steps in one episode: episode_days of step_seconds each."""
        return _episode_steps(self.episode_days, self.step_seconds)

    @property
    def num_zones(self) -> int:
        return self.grid_rows * self.grid_cols


def _check_table(values: tuple[float, ...], length: int, what: str) -> tuple[float, ...]:
    if len(values) != length:
        raise ValueError(f"a table {what} needs exactly {length} values, got {len(values)}")
    if any(not math.isfinite(x) or x < 0 for x in values):
        raise ValueError(f"a table {what} must hold finite values >= 0")
    return values


# ---- pure building blocks --------------------------------------------------------------------


def zone_names(rows: int, cols: int) -> list[str]:
    """Zone device names, row-major: zone_<row>_<col>."""
    return [f"zone_{r}_{c}" for r in range(rows) for c in range(cols)]


def grid_laplacian(rows: int, cols: int) -> np.ndarray:
    """Graph Laplacian of the zone grid (4-neighbour); conduction Q_Z = -UA_int * L @ T_Z."""
    n = rows * cols
    lap = np.zeros((n, n))
    for r in range(rows):
        for c in range(cols):
            i = r * cols + c
            for rr, cc in ((r + 1, c), (r, c + 1)):
                if rr < rows and cc < cols:
                    j = rr * cols + cc
                    lap[i, i] += 1
                    lap[j, j] += 1
                    lap[i, j] -= 1
                    lap[j, i] -= 1
    return lap


def exposed_sides(rows: int, cols: int) -> np.ndarray:
    """How many of each zone's four sides face outside (a corner of a 2 x 2 grid has 2)."""
    sides = np.zeros(rows * cols)
    for r in range(rows):
        for c in range(cols):
            sides[r * cols + c] = (r == 0) + (r == rows - 1) + (c == 0) + (c == cols - 1)
    return sides


def thermostat_modes(
    temp_Z: np.ndarray, mode_Z: np.ndarray, band: tuple[float, float], comfort: bool, comfort_before: bool | None
) -> np.ndarray:
    """Next VAV modes from zone temperatures (the reference thermostat, vectorised over zones).

    Heat below the heating setpoint and keep heating up to the band's midpoint; cool
    above the cooling setpoint and keep cooling down to the midpoint; otherwise idle.
    Entering eco (comfort -> not comfort) starts a passive drift that lasts until the
    zone falls below the eco heating setpoint.
    """
    heat_sp, cool_sp = band
    if not comfort and comfort_before:
        return np.full_like(mode_Z, PASSIVE)
    mid = 0.5 * (heat_sp + cool_sp)
    nxt = np.full_like(mode_Z, OFF)
    nxt[(temp_Z < mid) & (mode_Z == HEAT)] = HEAT
    nxt[(temp_Z > mid) & (mode_Z == COOL)] = COOL
    nxt[temp_Z < heat_sp] = HEAT
    nxt[temp_Z > cool_sp] = COOL
    if not comfort:
        nxt[(mode_Z == PASSIVE) & (temp_Z > heat_sp)] = PASSIVE
    return nxt


def productivity_per_person_hour(
    temp_Z: np.ndarray, band: tuple[float, float], cfg: BuildingConfig
) -> np.ndarray:
    """$ per person-hour: full inside the setpoints, decaying on a logistic curve outside them.

    Below: max / (1 + exp(-k (T - (heat_sp - d)))); above: max (1 - 1 / (1 + exp(-k (T - (cool_sp + d)))));
    half the maximum at d kelvin outside the band (the reference's piecewise logistic).
    """
    k, d, top = cfg.productivity_decay_stiffness, cfg.productivity_midpoint_delta_k, cfg.max_productivity_usd
    heat_sp, cool_sp = band
    below = top / (1.0 + np.exp(np.clip(-k * (temp_Z - (heat_sp - d)), -60, 60)))
    above = top * (1.0 - 1.0 / (1.0 + np.exp(np.clip(-k * (temp_Z - (cool_sp + d)), -60, 60))))
    return np.where(temp_Z < heat_sp, below, np.where(temp_Z > cool_sp, above, top))


def comfort_regret(
    occupancy_Z: np.ndarray, temp_Z: np.ndarray, band: tuple[float, float], cfg: BuildingConfig
) -> float:
    """Normalised productivity regret in [0, 1]: 0 with nobody in or everyone in band, 1 at the floor."""
    people = float(occupancy_Z.sum())
    if people <= 0.0:
        return 0.0
    actual = float(productivity_per_person_hour(temp_Z, band, cfg) @ occupancy_Z) / people
    actual = max(actual, cfg.min_productivity_usd)
    return 1.0 - (actual - cfg.min_productivity_usd) / (cfg.max_productivity_usd - cfg.min_productivity_usd)


def boiler_efficiency(return_temp: float, cfg: BuildingConfig) -> float:
    """Condensing efficiency: high with cold return water, falling linearly to the hot-return value."""
    frac = min(max((return_temp - RETURN_COLD_K) / (RETURN_HOT_K - RETURN_COLD_K), 0.0), 1.0)
    cold, hot = cfg.boiler_efficiency_cold_return, cfg.boiler_efficiency_hot_return
    return cold + frac * (hot - cold)


def outside_temperature(hours_since_midnight: float, offset_k: float, cfg: BuildingConfig) -> float:
    """Outside air (K) at local hours since midnight of the first day: a daily sinusoid or the replayed table."""
    if cfg.weather_mode == "table":
        table = cfg.weather_table_k
        pos = hours_since_midnight % len(table)
        i = int(pos)
        frac = pos - i
        return table[i] + frac * (table[(i + 1) % len(table)] - table[i]) + offset_k
    swing = 0.5 * (1.0 - math.cos(2.0 * math.pi * hours_since_midnight / 24.0))  # 0 at midnight, 1 at noon
    return cfg.outside_low_k + swing * (cfg.outside_high_k - cfg.outside_low_k) + offset_k


def arrival_probability(first_hour: int, last_hour: int, step_seconds: int) -> float:
    """Per-step event probability whose expected first success is halfway through the window (geometric)."""
    steps_to_midpoint = (last_hour - first_hour) * SECONDS_PER_HOUR / step_seconds / 2.0
    return min(1.0, 1.0 / steps_to_midpoint)


@dataclass(frozen=True)
class Setpoints:
    """One action: the two setpoints in kelvin (already clipped to their ranges)."""

    water_k: float
    air_k: float
    clipped: bool = False


@dataclass
class PlantState:
    """What changes during an episode (arrays are per zone, suffix _Z; occupants _ZO)."""

    zone_temp_Z: np.ndarray
    mode_Z: np.ndarray
    water_temp: float
    present_ZO: np.ndarray
    comfort_before: bool | None = None


@dataclass
class IntervalReport:
    """What one step did: flows and temperatures at its end, power averaged over it (W)."""

    outside_temp: float = 0.0
    flow_Z: np.ndarray = field(default_factory=lambda: np.zeros(0))
    flow_setpoint_Z: np.ndarray = field(default_factory=lambda: np.zeros(0))
    damper_Z: np.ndarray = field(default_factory=lambda: np.zeros(0))
    valve_Z: np.ndarray = field(default_factory=lambda: np.zeros(0))
    discharge_temp_Z: np.ndarray = field(default_factory=lambda: np.zeros(0))
    ahu_flow: float = 0.0
    mixed_temp: float = 0.0
    supply_temp: float = 0.0
    supply_fan_w: float = 0.0
    exhaust_fan_w: float = 0.0
    coil_thermal_w: float = 0.0  # signed: + heating, - cooling
    coil_electric_w: float = 0.0
    pump_w: float = 0.0
    gas_w: float = 0.0
    return_water_temp: float = 0.0


@dataclass(frozen=True)
class RewardBreakdown:
    """The step's reward and its normalised components (each in [0, 1]) and raw amounts."""

    reward: float = 0.0
    comfort: float = 0.0
    energy_cost: float = 0.0
    carbon: float = 0.0
    productivity_usd: float = 0.0
    electricity_cost_usd: float = 0.0
    gas_cost_usd: float = 0.0
    carbon_kg: float = 0.0
    occupancy: float = 0.0


class Plant:
    """The building's physics: constants precomputed from the config, advanced one step at a time."""

    def __init__(self, cfg: BuildingConfig) -> None:
        self.cfg = cfg
        self.laplacian = grid_laplacian(cfg.grid_rows, cfg.grid_cols)
        self.ua_ext_Z = exposed_sides(cfg.grid_rows, cfg.grid_cols) * cfg.exterior_wall_ua_w_per_k
        self.ua_ext_Z = self.ua_ext_Z + cfg.roof_floor_ua_w_per_k
        self.ahu_max_flow = cfg.ahu_max_flow_m3s or cfg.num_zones * cfg.vav_max_flow_m3s
        self.tank_capacity = cfg.boiler_tank_m3 * WATER_DENSITY * WATER_HEAT_CAPACITY  # J/K
        self.max_electric_w = (
            self.fan_power(self.ahu_max_flow)
            + cfg.ahu_coil_max_power_w / min(cfg.ahu_heating_cop, cfg.ahu_cooling_cop)
            + self.pump_power(cfg.num_zones * cfg.vav_max_water_flow_kg_s)
        )
        self.max_gas_w = cfg.boiler_max_gas_w

    def fan_power(self, flow_m3s: float) -> float:
        """W of the supply fan (all the flow) plus the exhaust fan (the outside-air share): V dp / eta each."""
        exhaust = flow_m3s * (1.0 - self.cfg.ahu_recirculation)
        return (flow_m3s + exhaust) * self.cfg.fan_pressure_pa / self.cfg.fan_efficiency

    def pump_power(self, water_kg_s: float) -> float:
        """W to move the water: (m / rho) * rho g H / eta = m g H / eta."""
        return water_kg_s * GRAVITY * self.cfg.pump_head_m / self.cfg.pump_efficiency

    def advance(
        self, s: PlantState, act: Setpoints, occupancy_Z: np.ndarray, outside: Callable[[float], float]
    ) -> IntervalReport:
        """Integrate one step with VAV modes fixed; ``outside(seconds_into_step)`` gives outside air (K)."""
        cfg = self.cfg
        damper_Z = np.where((s.mode_Z == HEAT) | (s.mode_Z == COOL), 1.0, cfg.vav_min_damper)
        valve_Z = (s.mode_Z == HEAT).astype(float)
        flow_setpoint_Z = damper_Z * cfg.vav_max_flow_m3s
        demand = float(flow_setpoint_Z.sum())
        ahu_flow = min(demand, self.ahu_max_flow)
        flow_Z = flow_setpoint_Z * (ahu_flow / demand) if demand > 0 else flow_setpoint_Z
        air_cap_Z = flow_Z * AIR_DENSITY * AIR_HEAT_CAPACITY  # W/K carried by each box's air
        water_cap_Z = valve_Z * cfg.vav_max_water_flow_kg_s * WATER_HEAT_CAPACITY
        hx_Z = cfg.reheat_effectiveness * np.minimum(air_cap_Z, water_cap_Z)  # Q = eps C_min (T_water - T_air)
        ahu_cap = ahu_flow * AIR_DENSITY * AIR_HEAT_CAPACITY
        water_cap = float(water_cap_Z.sum())
        gains_Z = occupancy_Z * cfg.occupant_heat_gain_w
        cool_sp = max(cfg.ahu_cooling_setpoint_k, act.air_k)  # heating wins when the setpoints cross
        h = cfg.step_seconds / cfg.substeps
        rep = IntervalReport(flow_Z=flow_Z, flow_setpoint_Z=flow_setpoint_Z, damper_Z=damper_Z, valve_Z=valve_Z)
        coil_w = gas_w = coil_el_w = 0.0
        for k in range(cfg.substeps):
            t_out = outside((k + 0.5) * h)
            temp_Z = s.zone_temp_Z
            t_ret = float(flow_Z @ temp_Z) / ahu_flow if ahu_flow > 0 else float(temp_Z.mean())
            t_mix = cfg.ahu_recirculation * t_ret + (1.0 - cfg.ahu_recirculation) * t_out
            q_coil = float(np.clip(ahu_cap * (min(max(t_mix, act.air_k), cool_sp) - t_mix),
                                   -cfg.ahu_coil_max_power_w, cfg.ahu_coil_max_power_w))
            t_sup = t_mix + q_coil / ahu_cap if ahu_cap > 0 else t_mix
            q_reheat_Z = hx_Z * max(s.water_temp - t_sup, 0.0)
            t_dis_Z = t_sup + np.divide(q_reheat_Z, air_cap_Z, out=np.zeros_like(q_reheat_Z), where=air_cap_Z > 0)
            q_zone_Z = (
                air_cap_Z * (t_dis_Z - temp_Z)
                + gains_Z
                + self.ua_ext_Z * (t_out - temp_Z)
                - cfg.interior_ua_w_per_k * (self.laplacian @ temp_Z)
            )
            s.zone_temp_Z = temp_Z + q_zone_Z * h / cfg.zone_heat_capacity_j_per_k
            q_reheat = float(q_reheat_Z.sum())
            t_return = s.water_temp - q_reheat / water_cap if water_cap > 0 else s.water_temp
            gas, s.water_temp = self._boiler(s.water_temp, act.water_k, q_reheat, t_return, t_out, h)
            coil_w += q_coil
            gas_w += gas
            coil_el_w += q_coil / cfg.ahu_heating_cop if q_coil >= 0 else -q_coil / cfg.ahu_cooling_cop
            rep.mixed_temp, rep.supply_temp = t_mix, t_sup
            rep.discharge_temp_Z, rep.return_water_temp = t_dis_Z, t_return
        n = cfg.substeps
        rep.outside_temp = outside(cfg.step_seconds)
        rep.ahu_flow = ahu_flow
        rep.supply_fan_w = ahu_flow * cfg.fan_pressure_pa / cfg.fan_efficiency
        rep.exhaust_fan_w = self.fan_power(ahu_flow) - rep.supply_fan_w
        rep.pump_w = self.pump_power(float(valve_Z.sum()) * cfg.vav_max_water_flow_kg_s)
        rep.coil_thermal_w, rep.coil_electric_w, rep.gas_w = coil_w / n, coil_el_w / n, gas_w / n
        return rep

    def _boiler(
        self, water: float, setpoint: float, q_reheat: float, t_return: float, t_out: float, h: float
    ) -> tuple[float, float]:
        """One sub-step of the tank: fire (up to capacity) to reach the setpoint; return (gas W, new water K).

        C dT/dt = eta * gas - (reheat load + UA (T - T_out)); the burner asks for exactly what
        would land on the setpoint this sub-step, and never cools (it only stops firing).
        """
        cfg = self.cfg
        load = q_reheat + cfg.boiler_loss_w_per_k * (water - t_out)
        eta = boiler_efficiency(t_return, cfg)
        heat_in = min(max(load + self.tank_capacity * (setpoint - water) / h, 0.0), eta * cfg.boiler_max_gas_w)
        return heat_in / eta, water + (heat_in - load) * h / self.tank_capacity


class BuildingHVAC(TextEnv[Setpoints]):
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
        return ActionOutcome(reward=self.breakdown.reward)

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

    # ---- policies -------------------------------------------------------------------------------
    def heuristic_setpoints(self) -> tuple[float, float]:
        """A thermostat-like supervisor: hot water (then warmer air) while watched zones are cold, standby otherwise.

        Watched zones are the occupied ones, or all when nobody is in.  Their target is the
        comfort band's low edge plus 0.5 K during comfort hours and the ``_HEURISTIC_PREHEAT_HOURS``
        before them, and the zones' current (eco) heating setpoint plus 0.5 K otherwise (setback).  The
        water setpoint rises with the coldest watched zone's deficit, from the range's low end on
        workdays and from ``_HEURISTIC_DAY_OFF_WATER_FLOOR`` on days off; the supply air warms only
        when a zone is more than 1.5 K short, as electric heat costs more than gas.
        """
        cfg, s = self.config, self._require_state()
        (w_lo, w_hi), (a_lo, a_hi) = cfg.supply_water_range_k, cfg.supply_air_heating_range_k
        local = self.local_time()
        hour = local.hour + local.minute / 60.0
        occupied_Z = s.present_ZO.any(axis=1)
        preheat_from = cfg.comfort_start_hour - _HEURISTIC_PREHEAT_HOURS
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

    def heuristic_answer(self) -> str:
        water, air = self.heuristic_setpoints()
        return format_answer([f"{water:.1f}K, {air:.1f}K"])

    def random_answer(self, rng: random.Random) -> str:
        return format_answer([f"{rng.uniform(-1, 1):.2f}, {rng.uniform(-1, 1):.2f}"])


# ---- answer parsing ------------------------------------------------------------------------------
_VALUE = re.compile(
    r"^(?:[A-Za-z_][\w \-]*\s*[=:]\s*)?([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*([Kk])?$"
)
_SPLIT = re.compile(r"\s*[,;]\s*")
KELVIN_MIN_BARE = 100.0  # a bare number this large is read as kelvin
NORMALIZED_MAX_BARE = 2.0  # bare numbers up to this magnitude are normalised values (clipped to [-1, 1])


def parse_setpoint_values(text: str) -> tuple[tuple[float, bool], tuple[float, bool]] | None:
    """Two ``(value, is_kelvin)`` pairs from text like "0.2, -0.5", "330K 292K" or "water=330 K; air=292 K".

    Values are separated by a comma or semicolon (or spaces when there is neither); each
    may carry a ``label=`` or ``label:`` prefix and a ``K`` suffix.  None if not exactly two.
    """
    body = text.strip()
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
