"""The thermal plant: pure building blocks (zone grid, thermostat, productivity, boiler efficiency,
weather, occupancy), the state and report of one step, and ``Plant``, which integrates a step."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from producers.envs.building.config import (
    AIR_DENSITY,
    AIR_HEAT_CAPACITY,
    GRAVITY,
    RETURN_COLD_K,
    RETURN_HOT_K,
    SECONDS_PER_HOUR,
    WATER_DENSITY,
    WATER_HEAT_CAPACITY,
    BuildingConfig,
)

# Thermostat (VAV box) modes.
OFF, HEAT, COOL, PASSIVE = 0, 1, 2, 3
MODE_NAMES = {OFF: "idle", HEAT: "heating", COOL: "cooling", PASSIVE: "idle (night drift)"}


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
