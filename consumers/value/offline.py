"""Offline value learning from logged building telemetry: conservative Q-learning and behaviour cloning.

Steps table of a building dataset (continuous setpoints, raw telemetry) -> ``OfflineData``
(discrete actions, normalised observations, n-step transitions) -> ``train_offline`` with
``CQLAgent`` or ``BehaviourCloningAgent`` -> ``OfflinePolicy`` (observation -> setpoints).
No environment is touched while learning; evaluation plays held-out days in the simulator
(``producers.offline.evaluation.controller_outcomes``) with the policy passed in as a function.

- Actions: the two continuous setpoints (supply water, supply air) on a product grid of
  ``water_levels x air_levels`` evenly spaced values over each range (ends included);
  action index = water_level * air_levels + air_level, and a logged action maps to the
  nearest cell on each axis.
- Observations: the dataset's observation vector plus three time features (sin and cos
  of the local hour, 1 on days off), because the value of heating now depends on when
  comfort hours start; then standardised with the training days' mean and std, which
  travel in the policy's state.
- CQL(H) (Kumar et al. 2020, discrete actions): per transition
    loss = Huber(y - Q(s, a)) + alpha * (logsumexp_a' Q(s, a') - Q(s, a)),
  the regulariser pushing down every action's value and pushing up the logged one's,
  so actions the data never took are not over-estimated.
- Behaviour cloning: the same network's outputs as logits of a classifier over the
  logged grid cells (cross-entropy); acting takes the most likely cell.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F

from consumers.value.agent import DQNAgent, ValueAgent
from consumers.value.config import ValueLearnerConfig
from consumers.value.replay import ReplayMemory, steps_to_transitions
from schemas.steps import check_steps_table

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
            raise ValueError("policy state lacks scaler/mean or scaler/std; was it written by OfflinePolicy.state_dict?")
        return cls(state["scaler/mean"].numpy().astype(np.float64), state["scaler/std"].numpy().astype(np.float64))


# ==== data ==========================================================================================
@dataclass
class OfflineData:
    """Logged days ready to learn from: the n-step transitions and what maps the environment onto them."""

    transitions: dict[str, np.ndarray]
    scaler: ObservationScaler
    grid: SetpointGrid
    utc_offset_hours: float

    @property
    def observation_size(self) -> int:
        return int(self.transitions["observation"].shape[1])


def prepare_offline_data(
    table: pa.Table, grid: SetpointGrid, utc_offset_hours: float, n_step: int = 1, gamma: float = 0.99
) -> OfflineData:
    """A building steps table (actions = [water_k, air_k]) -> discretised, normalised n-step transitions."""
    check_steps_table(table)
    table = table.sort_by([("episode_id", "ascending"), ("step", "ascending")])
    obs_RO = np.asarray(table["observation"].combine_chunks().flatten(), dtype=np.float64).reshape(table.num_rows, -1)
    action_RA = np.asarray(table["action"].combine_chunks().flatten(), dtype=np.float64).reshape(table.num_rows, -1)
    if action_RA.shape[1] != 2:
        raise ValueError(f"building actions have 2 setpoints, this table has {action_RA.shape[1]} per step")
    if table["timestamp"].null_count:
        raise ValueError("the steps table lacks timestamps; the time features need them")
    seconds_R = table["timestamp"].cast(pa.int64()).to_numpy() / 1e6
    full_RO = np.concatenate([obs_RO, time_features(seconds_R, utc_offset_hours)], axis=1)
    scaler = ObservationScaler.fit(full_RO)
    discrete = table.select(["episode_id", "step", "timestamp", "is_first", "is_last", "is_terminal",
                             "reward", "discount"])
    discrete = discrete.append_column("observation", _vector_array(scaler(full_RO)))
    discrete = discrete.append_column("action", _vector_array(grid.to_index(action_RA[:, 0], action_RA[:, 1])[:, None]))
    discrete = discrete.replace_schema_metadata(table.schema.metadata)
    return OfflineData(steps_to_transitions(discrete, n_step, gamma), scaler, grid, utc_offset_hours)


def _vector_array(values_RK: np.ndarray) -> pa.Array:
    values_RK = np.asarray(values_RK, dtype=np.float32)
    offsets = np.arange(0, values_RK.size + 1, max(values_RK.shape[1], 1), dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values_RK.reshape(-1), type=pa.float32()))


# ==== agents ========================================================================================
def cql_regulariser(q_BA: torch.Tensor, action_B: torch.Tensor) -> torch.Tensor:
    """CQL(H) per transition: logsumexp_a Q(s, a) - Q(s, a_data); its gradient in Q is softmax(Q) - onehot(a_data)."""
    return torch.logsumexp(q_BA, dim=-1) - q_BA.gather(-1, action_B[:, None]).squeeze(-1)


class CQLAgent(DQNAgent):
    """DQN (Double-Q, n-step, Huber) plus ``cql_alpha`` times the CQL(H) regulariser."""

    def __init__(self, config: ValueLearnerConfig, observation_size: int, num_actions: int,
                 cql_alpha: float = 1.0) -> None:
        if not 0.0 <= cql_alpha <= 1e6:
            raise ValueError(f"cql_alpha {cql_alpha} must be in [0, 1e6] (0 is plain DQN)")
        super().__init__(config, observation_size, num_actions)
        self.cql_alpha = cql_alpha

    def _losses(self, obs_BO, action_B, reward_B, bootstrap_B, next_obs_BO):  # type: ignore[no-untyped-def]
        td_loss_B, q_B, td_B = super()._losses(obs_BO, action_B, reward_B, bootstrap_B, next_obs_BO)
        return td_loss_B + self.cql_alpha * cql_regulariser(self.online(obs_BO), action_B), q_B, td_B


class BehaviourCloningAgent(ValueAgent):
    """A classifier over the logged discrete actions on the Q-network's architecture (outputs = logits)."""

    def _losses(self, obs_BO, action_B, reward_B, bootstrap_B, next_obs_BO):  # type: ignore[no-untyped-def]
        logits_BA = self.online(obs_BO)
        loss_B = F.cross_entropy(logits_BA, action_B, reduction="none")
        return loss_B, logits_BA.gather(-1, action_B[:, None]).squeeze(-1).detach(), torch.zeros_like(reward_B)


@dataclass(frozen=True)
class TrainLog:
    """Means over the last tenth of training."""

    steps: int
    loss: float
    q_mean: float
    td_abs_mean: float


def train_offline(agent: ValueAgent, data: OfflineData, steps: int, seed: int = 0) -> TrainLog:
    """``steps`` updates on uniformly sampled batches of the logged transitions."""
    if steps < 1:
        raise ValueError(f"train for at least 1 step, got {steps}")
    count = len(data.transitions["action"])
    memory = ReplayMemory(count, data.observation_size)
    memory.add(data.transitions)
    rng = np.random.default_rng(seed)
    tail: list[tuple[float, float, float]] = []
    for step in range(steps):
        metrics = agent.train_step(memory.sample(agent.config.batch_size, rng))
        if step >= steps - max(steps // 10, 1):
            tail.append((metrics.loss, metrics.q_mean, metrics.td_abs_mean))
    loss, q_mean, td = (float(np.mean(column)) for column in zip(*tail, strict=True))
    return TrainLog(steps, loss, q_mean, td)


# ==== acting ========================================================================================
@dataclass
class OfflinePolicy:
    """A trained agent with the scaler and grid that connect it to the building: observation -> setpoints."""

    agent: ValueAgent
    scaler: ObservationScaler
    grid: SetpointGrid
    utc_offset_hours: float

    @classmethod
    def from_training(cls, agent: ValueAgent, data: OfflineData) -> OfflinePolicy:
        return cls(agent, data.scaler, data.grid, data.utc_offset_hours)

    def action(self, observation_O: np.ndarray, timestamp_s: float) -> int:
        """The greedy grid cell for a raw observation vector seen at UTC epoch second ``timestamp_s``."""
        features = time_features(np.array([timestamp_s]), self.utc_offset_hours)[0]
        obs = self.scaler(np.concatenate([np.asarray(observation_O, dtype=np.float64), features])[None])
        with torch.no_grad():
            return int(self.agent.online.q_values(torch.from_numpy(obs))[0].argmax())

    def setpoints(self, observation_O: np.ndarray, timestamp_s: float) -> tuple[float, float]:
        """(supply water K, supply air K) to set now."""
        water, air = self.grid.to_setpoints(self.action(observation_O, timestamp_s))
        return float(water), float(air)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The agent's tensors plus the scaler's statistics (the grid and offset are configuration)."""
        return self.agent.state_dict() | self.scaler.state_dict()

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self.scaler = ObservationScaler.from_state_dict(state)
        self.agent.load_state_dict({k: v for k, v in state.items() if not k.startswith("scaler/")})

