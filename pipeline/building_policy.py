"""A Q-network acting on the building, and its published form: what offline CQL and the evaluation share.

Offline CQL (``consumers.value.offline``) -> ``building_policy_files`` -> registry (kind
``value-network``, beside ``value_config.json`` and ``value_network.safetensors``) -> ``rlpipe
eval`` (``producers.offline.policy_eval``) -> ``load_building_policy`` -> setpoints each step.
A network over grid cells needs these besides its weights to act on the building:

- the setpoint grid (``SetpointGrid``): the two continuous setpoints (supply water, supply
  air) on a product grid of ``water_levels x air_levels`` evenly spaced values over each
  range (ends included); action index = water_level * air_levels + air_level;
- the network's columns (``network_columns``): the logged telemetry less the columns that echo the
  controller's own last setpoints, which a network would otherwise learn to copy (the logged
  setpoints change slowly, so "keep the last setpoint" predicts them well and acts badly);
- the time features (``time_features``): sin and cos of the local hour and 1 on days off,
  appended to the logged observation vector, because the value of heating now depends on
  when comfort hours start;
- the observation scaler (``ObservationScaler``): the training days' mean and std;
- optionally a behaviour-cloning network and a threshold (``support_mask``): the greedy cell is
  chosen only among cells the logged controller takes often enough (discrete BCQ's filter).

A published version carries them as ``building_policy.json`` (``BuildingPolicySpec``: the grid,
the UTC offset, the observation columns in order, the dataset the network learned from, the
filter's threshold), ``observation_scaler.safetensors`` and, with a filter,
``behaviour_network.safetensors``, so it plays again with no training code and nothing unpickled.
Shapes are named by suffix: ``_R`` per row, ``_O`` per observation feature.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from safetensors.torch import load as load_tensors
from torch import nn

from pipeline.io.tensors import save_tensors
from pipeline.value_network import CONFIG_FILE, WEIGHTS_FILE, network_from_files

POLICY_FILE = "building_policy.json"
SCALER_FILE = "observation_scaler.safetensors"
BEHAVIOUR_FILE = "behaviour_network.safetensors"  # a behaviour-cloning network's weights (same module as the Q-network)
SECONDS_PER_DAY = 86_400.0


# ==== actions =======================================================================================
@dataclass(frozen=True)
class SetpointGrid:
    """The product grid of discrete setpoint pairs (kelvin) standing in for the continuous action."""

    water_range_k: tuple[float, float]
    air_range_k: tuple[float, float]
    water_levels: int = 5
    air_levels: int = 5

    def __post_init__(self) -> None:
        if self.water_levels < 2 or self.air_levels < 2:
            raise ValueError(f"grid {self.water_levels} x {self.air_levels}: use at least 2 levels per setpoint")
        if self.water_range_k[0] >= self.water_range_k[1] or self.air_range_k[0] >= self.air_range_k[1]:
            raise ValueError(f"setpoint ranges {self.water_range_k}, {self.air_range_k} must be (low, high)")

    @property
    def num_actions(self) -> int:
        return self.water_levels * self.air_levels

    def water_k(self) -> np.ndarray:
        return np.linspace(*self.water_range_k, self.water_levels)

    def air_k(self) -> np.ndarray:
        return np.linspace(*self.air_range_k, self.air_levels)

    def to_index(self, water_k: np.ndarray, air_k: np.ndarray) -> np.ndarray:
        """The nearest grid cell of each (water, air) pair (values outside a range go to its end)."""
        water = np.abs(np.asarray(water_k, dtype=np.float64)[..., None] - self.water_k()).argmin(-1)
        air = np.abs(np.asarray(air_k, dtype=np.float64)[..., None] - self.air_k()).argmin(-1)
        return water * self.air_levels + air

    def to_setpoints(self, index: np.ndarray | int) -> tuple[np.ndarray, np.ndarray]:
        """(water_k, air_k) of grid cell(s) ``index``."""
        index = np.asarray(index, dtype=np.int64)
        if np.any((index < 0) | (index >= self.num_actions)):
            raise ValueError(f"action index outside the grid's 0..{self.num_actions - 1}")
        return self.water_k()[index // self.air_levels], self.air_k()[index % self.air_levels]


# ==== observations ==================================================================================
def setpoint_echoes(observation_columns: Sequence[str], action_columns: Sequence[str]) -> list[str]:
    """The observation columns that repeat the controller's last action: the simulator's ``action@...``
    telemetry and the devices' setpoint readings that the action columns (``action:<device>@<setpoint>``) set.

    A network that reads them learns to copy its previous setpoints (in the logged days they change
    slowly, so copying predicts them well), and in closed loop it then keeps heating once it has started.
    """
    set_by_action = {name.removeprefix("action:") for name in action_columns}
    return [c for c in observation_columns if c.startswith("action@") or c in set_by_action]


def network_columns(observation_columns: Sequence[str], action_columns: Sequence[str]) -> list[str]:
    """The logged observation columns a building policy reads, in order: all but ``setpoint_echoes``."""
    echoes = set(setpoint_echoes(observation_columns, action_columns))
    return [c for c in observation_columns if c not in echoes]


def time_features(timestamp_s: np.ndarray, utc_offset_hours: float) -> np.ndarray:
    """(sin, cos) of the local hour and 1.0 on Saturdays and Sundays, per UTC epoch second; shape (R, 3)."""
    local_s = np.asarray(timestamp_s, dtype=np.float64) + utc_offset_hours * 3600.0
    angle = 2.0 * np.pi * (local_s % SECONDS_PER_DAY) / SECONDS_PER_DAY
    weekday = (np.floor(local_s / SECONDS_PER_DAY).astype(np.int64) + 3) % 7  # 1970-01-01 was a Thursday (3)
    return np.stack([np.sin(angle), np.cos(angle), (weekday >= 5).astype(np.float64)], axis=-1)


@dataclass
class ObservationScaler:
    """Standardisation with the training days' statistics: (x - mean) / std, std floored for constant features."""

    mean_O: np.ndarray
    std_O: np.ndarray

    @classmethod
    def fit(cls, obs_RO: np.ndarray, floor: float = 1e-6) -> ObservationScaler:
        obs_RO = np.asarray(obs_RO, dtype=np.float64)
        return cls(obs_RO.mean(axis=0), np.maximum(obs_RO.std(axis=0), floor))

    def __call__(self, obs_RO: np.ndarray) -> np.ndarray:
        return ((np.asarray(obs_RO, dtype=np.float64) - self.mean_O) / self.std_O).astype(np.float32)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"scaler/mean": torch.as_tensor(self.mean_O), "scaler/std": torch.as_tensor(self.std_O)}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, torch.Tensor]) -> ObservationScaler:
        if "scaler/mean" not in state or "scaler/std" not in state:
            raise ValueError("policy state lacks scaler/mean or scaler/std; write it with OfflinePolicy.state_dict")
        return cls(state["scaler/mean"].numpy().astype(np.float64), state["scaler/std"].numpy().astype(np.float64))


def support_mask(logits_BA: torch.Tensor, threshold: float) -> torch.Tensor:
    """Cells the logged controller takes often enough: pi_b(a|s) >= threshold * max_a' pi_b(a'|s), shape (B, A).

    Discrete BCQ's filter (Fujimoto et al. 2019): the greedy action, and the target's next action, are
    chosen only among these, so the Q-network is never trusted where the data has (almost) no support.
    ``logits_BA`` are a behaviour-cloning network's outputs; threshold 0 keeps every cell.
    """
    probs_BA = torch.softmax(logits_BA, dim=-1)
    return probs_BA >= threshold * probs_BA.max(dim=-1, keepdim=True).values


def network_input(observation_O: np.ndarray, timestamp_s: float, scaler: ObservationScaler,
                  utc_offset_hours: float) -> torch.Tensor:
    """A raw observation vector seen at UTC epoch second ``timestamp_s`` as the network reads it: shape (1, O + 3)."""
    features = time_features(np.array([timestamp_s]), utc_offset_hours)[0]
    return torch.from_numpy(scaler(np.concatenate([np.asarray(observation_O, dtype=np.float64), features])[None]))


# ==== the published policy ==========================================================================
class BuildingPolicySpec(BaseModel):
    """What connects a published Q-network to the building (its weights and scaler come separately)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    water_range_k: tuple[float, float] = Field(description="supply-water setpoint range (K), the grid's ends")
    air_range_k: tuple[float, float] = Field(description="supply-air heating setpoint range (K), the grid's ends")
    water_levels: int = Field(ge=2, le=101, description="grid levels of the supply-water setpoint")
    air_levels: int = Field(ge=2, le=101, description="grid levels of the supply-air setpoint")
    utc_offset_hours: float = Field(ge=-14.0, le=14.0, description="the building's local time, for the time features")
    observation_columns: tuple[str, ...] = Field(min_length=1, description="telemetry columns, in the network's order")
    dataset: str = Field(min_length=1, description="the logged dataset the network learned from")
    first_held_out_day: int = Field(ge=0, description="first simulated day index after the dataset's days")
    env_overrides: dict[str, Any] = Field(default_factory=dict, description="building-hvac settings of the dataset")
    support_threshold: float = Field(
        0.0, ge=0.0, le=1.0, description=f"act only on cells support_mask keeps (> 0: with {BEHAVIOUR_FILE})"
    )

    @model_validator(mode="after")
    def _valid_grid(self) -> BuildingPolicySpec:
        self.grid()  # raises naming the bad range
        return self

    def grid(self) -> SetpointGrid:
        return SetpointGrid(self.water_range_k, self.air_range_k, self.water_levels, self.air_levels)


@dataclass
class BuildingPolicy:
    """A Q-network over grid cells with what connects it to the building: observation -> greedy setpoints."""

    network: nn.Module
    scaler: ObservationScaler
    grid: SetpointGrid
    utc_offset_hours: float
    behaviour: nn.Module | None = None  # a behaviour-cloning network: its logits filter the cells (support_mask)
    support_threshold: float = 0.0

    def action(self, observation_O: np.ndarray, timestamp_s: float) -> int:
        """The greedy cell, argmax_a Q(s, a) over the supported cells, for a raw observation seen at ``timestamp_s``."""
        obs_BO = network_input(observation_O, timestamp_s, self.scaler, self.utc_offset_hours)
        with torch.no_grad():
            q_BA = self.network.q_values(obs_BO)
            if self.behaviour is not None and self.support_threshold > 0.0:
                q_BA = q_BA.masked_fill(~support_mask(self.behaviour(obs_BO), self.support_threshold), -torch.inf)
        return int(q_BA[0].argmax())

    def setpoints(self, observation_O: np.ndarray, timestamp_s: float) -> tuple[float, float]:
        """(supply water K, supply air K) to set now."""
        water, air = self.grid.to_setpoints(self.action(observation_O, timestamp_s))
        return float(water), float(air)


def building_policy_files(spec: BuildingPolicySpec, scaler: ObservationScaler,
                          behaviour: nn.Module | None = None) -> dict[str, bytes]:
    """The files a value-network version needs besides the network's to act on the building."""
    if len(scaler.mean_O) != len(spec.observation_columns) + 3:
        raise ValueError(f"the scaler has {len(scaler.mean_O)} features, the spec {len(spec.observation_columns)} "
                         "columns plus 3 time features; fit the scaler on the same steps table")
    if (spec.support_threshold > 0.0) != (behaviour is not None):
        raise ValueError("a support_threshold above 0 needs the behaviour-cloning network, and only it")
    state = {k: v.to(torch.float64).contiguous() for k, v in scaler.state_dict().items()}
    files = {POLICY_FILE: (spec.model_dump_json(indent=2) + "\n").encode(), SCALER_FILE: save_tensors(state)}
    if behaviour is not None:
        tensors = {k: v.detach().contiguous().clone() for k, v in behaviour.state_dict().items()}
        files[BEHAVIOUR_FILE] = save_tensors(tensors)
    return files


def load_building_policy(folder: str | os.PathLike[str]) -> tuple[BuildingPolicySpec, BuildingPolicy]:
    """A pulled value-network version that acts on the building (it must hold ``building_policy.json``)."""
    root = Path(folder)
    if not (root / POLICY_FILE).exists():
        raise ValueError(f"{root} has no {POLICY_FILE}: not a building policy; train one with the cql-building preset")
    try:
        spec = BuildingPolicySpec.model_validate_json((root / POLICY_FILE).read_bytes())
    except ValidationError as exc:
        raise ValueError(f"{POLICY_FILE} is not a valid building policy spec: {exc.errors()[0]['msg']}") from None
    files = {name: (root / name).read_bytes() for name in (CONFIG_FILE, WEIGHTS_FILE)}
    _, network = network_from_files(files)
    scaler = ObservationScaler.from_state_dict(load_tensors((root / SCALER_FILE).read_bytes()))
    if len(scaler.mean_O) != len(spec.observation_columns) + 3:
        raise ValueError(f"{SCALER_FILE} has {len(scaler.mean_O)} features, {POLICY_FILE} names "
                         f"{len(spec.observation_columns)} columns plus 3 time features")
    behaviour = None
    if spec.support_threshold > 0.0:  # the same module shape as the Q-network, the cloned logits as its outputs
        _, behaviour = network_from_files({**files, WEIGHTS_FILE: (root / BEHAVIOUR_FILE).read_bytes()})
    return spec, BuildingPolicy(network, scaler, spec.grid(), spec.utc_offset_hours, behaviour, spec.support_threshold)
