"""The building's configuration: physical constants, the reference's tariffs and ``BuildingConfig``
(every setting of the building, its plant, weather, occupancy, tariffs and reward, bounded and checked)."""

from __future__ import annotations

import datetime as dt
import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from producers.envs.base import EnvConfig

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
