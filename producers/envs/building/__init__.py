"""Building climate control after Google's smart-buildings simulator (``sbsim``), as a text environment."""

from producers.envs.building.environment import (
    COOL,
    HEAT,
    OFF,
    PASSIVE,
    BuildingConfig,
    BuildingHVAC,
    comfort_regret,
    grid_laplacian,
    outside_temperature,
    parse_setpoint_values,
    thermostat_modes,
    to_kelvin,
    to_normalized,
    zone_names,
)

__all__ = [
    "COOL", "HEAT", "OFF", "PASSIVE", "BuildingConfig", "BuildingHVAC", "comfort_regret", "grid_laplacian",
    "outside_temperature", "parse_setpoint_values", "thermostat_modes", "to_kelvin", "to_normalized", "zone_names",
]
