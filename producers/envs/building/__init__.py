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

An invalid answer costs the format penalty and plays the step with the setpoints held (time runs on).

Modules: ``config`` (constants, tariffs, ``BuildingConfig``), ``plant`` (the thermal
plant: pure building blocks and ``Plant``), ``environment`` (``BuildingHVAC``: episodes,
actions, reward, prompt, scripted policies), ``telemetry`` (telemetry rows and loading a
logged state) and ``answers`` (answer parsing and setpoint conversions).  The names other
modules use are re-exported here, so ``producers.envs.building:BuildingHVAC`` stays the
environment's registered path.
"""

from producers.envs.building.answers import parse_setpoint_values, to_kelvin, to_normalized
from producers.envs.building.config import BuildingConfig
from producers.envs.building.environment import BuildingHVAC
from producers.envs.building.plant import (
    COOL,
    HEAT,
    OFF,
    PASSIVE,
    comfort_regret,
    grid_laplacian,
    outside_temperature,
    thermostat_modes,
    zone_names,
)

__all__ = [
    "COOL", "HEAT", "OFF", "PASSIVE", "BuildingConfig", "BuildingHVAC", "comfort_regret", "grid_laplacian",
    "outside_temperature", "parse_setpoint_values", "thermostat_modes", "to_kelvin", "to_normalized", "zone_names",
]
