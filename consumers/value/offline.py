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
- Observations: the dataset's observation vector less the columns that echo the controller's
  last setpoints (``network_columns``) plus three time features (sin and cos
  of the local hour, 1 on days off), because the value of heating now depends on when
  comfort hours start; then standardised with the training days' mean and std, which
  travel in the policy's state.  Grid, time features and scaler are ``pipeline.building_policy``'s,
  shared with a published version's evaluation (``consumers.value.offline_service`` publishes).
- CQL(H) (Kumar et al. 2020, discrete actions): per transition
    loss = Huber(y - Q(s, a)) + alpha * (logsumexp_a' Q(s, a') - Q(s, a)),
  the regulariser pushing down every action's value and pushing up the logged one's,
  so actions the data never took are not over-estimated.
- Behaviour cloning: the same network's outputs as logits of a classifier over the
  logged grid cells (cross-entropy); acting takes the most likely cell.
- Support filter (discrete BCQ, Fujimoto et al. 2019), optional: with a cloned network and a
  threshold T, acting (``OfflinePolicy``) and, given to ``CQLAgent``, the target's next action
  take the argmax only over cells with cloned probability >= T x the most likely cell's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F

from consumers.value.agent import DQNAgent, ValueAgent
from consumers.value.config import ValueLearnerConfig
from consumers.value.replay import ReplayMemory, steps_to_transitions
from consumers.value.targets import huber_loss
from pipeline.building_policy import (
    BuildingPolicy,
    ObservationScaler,
    SetpointGrid,
    support_mask,
    time_features,
)
from schemas.steps import check_steps_table

__all__ = [
    "BehaviourCloningAgent", "CQLAgent", "ObservationScaler", "OfflineData", "OfflinePolicy", "SetpointGrid",
    "TrainLog", "cql_regulariser", "offline_memory", "prepare_offline_data", "time_features", "train_offline",
    "train_updates",
]


# ==== data ==========================================================================================
@dataclass
class OfflineData:
    """Logged days ready to learn from: the n-step transitions and what maps the environment onto them."""

    transitions: dict[str, np.ndarray]
    scaler: ObservationScaler
    grid: SetpointGrid
    utc_offset_hours: float
    observation_columns: tuple[str, ...] = ()  # the logged columns the network reads, in order (empty: all)

    @property
    def observation_size(self) -> int:
        return int(self.transitions["observation"].shape[1])


def prepare_offline_data(
    table: pa.Table, grid: SetpointGrid, utc_offset_hours: float, n_step: int = 1, gamma: float = 0.99,
    columns: Sequence[str] = (), keep: Sequence[str] | None = None,
) -> OfflineData:
    """A building steps table (actions = [water_k, air_k]) -> discretised, normalised n-step transitions.

    ``columns`` names the table's observation features in order (its card's ``observation_columns``)
    and ``keep`` the ones the network reads, in that order (``network_columns``: all but the setpoint
    echoes); without ``keep`` it reads every feature.
    """
    check_steps_table(table)
    table = table.sort_by([("episode_id", "ascending"), ("step", "ascending")])
    obs_RO = np.asarray(table["observation"].combine_chunks().flatten(), dtype=np.float64).reshape(table.num_rows, -1)
    if keep is not None:
        if len(columns) != obs_RO.shape[1] or not set(keep) <= set(columns):
            raise ValueError(f"the table has {obs_RO.shape[1]} observation features; pass its card's "
                             "observation_columns as columns and a subset of them as keep")
        obs_RO = obs_RO[:, [list(columns).index(c) for c in keep]]
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
    return OfflineData(steps_to_transitions(discrete, n_step, gamma), scaler, grid, utc_offset_hours,
                       tuple(keep if keep is not None else columns))


def _vector_array(values_RK: np.ndarray) -> pa.Array:
    values_RK = np.asarray(values_RK, dtype=np.float32)
    offsets = np.arange(0, values_RK.size + 1, max(values_RK.shape[1], 1), dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values_RK.reshape(-1), type=pa.float32()))


# ==== agents ========================================================================================
def cql_regulariser(q_BA: torch.Tensor, action_B: torch.Tensor) -> torch.Tensor:
    """CQL(H) per transition: logsumexp_a Q(s, a) - Q(s, a_data); its gradient in Q is softmax(Q) - onehot(a_data)."""
    return torch.logsumexp(q_BA, dim=-1) - q_BA.gather(-1, action_B[:, None]).squeeze(-1)


class CQLAgent(DQNAgent):
    """DQN (Double-Q, n-step, Huber) plus ``cql_alpha`` times the CQL(H) regulariser.

    With a trained ``behaviour`` agent (behaviour cloning) and ``support_threshold`` above 0, the
    target's next action is the online network's argmax over the cells ``support_mask`` keeps
    (discrete BCQ's target, Fujimoto et al. 2019): y = r + gamma^n Q_target(s', argmax_{a' kept} Q(s', a')).
    """

    def __init__(self, config: ValueLearnerConfig, observation_size: int, num_actions: int,
                 cql_alpha: float = 1.0, behaviour: ValueAgent | None = None, support_threshold: float = 0.0) -> None:
        if not 0.0 <= cql_alpha <= 1e6:
            raise ValueError(f"cql_alpha {cql_alpha} must be in [0, 1e6] (0 is plain DQN)")
        if not 0.0 <= support_threshold <= 1.0 or (support_threshold > 0.0) != (behaviour is not None):
            raise ValueError(f"support_threshold {support_threshold}: in [0, 1], and above 0 exactly when a "
                             "behaviour agent is given")
        super().__init__(config, observation_size, num_actions)
        self.cql_alpha, self.behaviour, self.support_threshold = cql_alpha, behaviour, support_threshold

    def _losses(self, obs_BO, action_B, reward_B, bootstrap_B, next_obs_BO):  # type: ignore[no-untyped-def]
        if self.behaviour is None:
            td_loss_B, q_B, td_B = super()._losses(obs_BO, action_B, reward_B, bootstrap_B, next_obs_BO)
        else:
            td_loss_B, q_B, td_B = self._supported_td(obs_BO, action_B, reward_B, bootstrap_B, next_obs_BO)
        return td_loss_B + self.cql_alpha * cql_regulariser(self.online(obs_BO), action_B), q_B, td_B

    def _supported_td(self, obs_BO, action_B, reward_B, bootstrap_B, next_obs_BO):  # type: ignore[no-untyped-def]
        assert self.behaviour is not None
        q_B = self.online(obs_BO).gather(-1, action_B[:, None]).squeeze(-1)
        with torch.no_grad():
            kept_BA = support_mask(self.behaviour.online(next_obs_BO), self.support_threshold)
            next_action_B = self.online(next_obs_BO).masked_fill(~kept_BA, -torch.inf).argmax(-1)
            y_B = reward_B + bootstrap_B * self.target(next_obs_BO).gather(-1, next_action_B[:, None]).squeeze(-1)
        td_B = y_B - q_B
        return huber_loss(td_B, self.config.huber_delta), q_B.detach(), td_B.detach()


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


def offline_memory(data: OfflineData) -> ReplayMemory:
    """A replay memory holding exactly the logged transitions (nothing is ever added or overwritten)."""
    count = len(data.transitions["action"])
    memory = ReplayMemory(count, data.observation_size)
    memory.add(data.transitions)
    return memory


def train_updates(agent: ValueAgent, memory: ReplayMemory, updates: int, rng: np.random.Generator) -> TrainLog:
    """``updates`` gradient updates on uniformly sampled batches of ``memory``, drawn with ``rng``."""
    if updates < 1:
        raise ValueError(f"train for at least 1 step, got {updates}")
    tail: list[tuple[float, float, float]] = []
    for update in range(updates):
        metrics = agent.train_step(memory.sample(agent.config.batch_size, rng))
        if update >= updates - max(updates // 10, 1):
            tail.append((metrics.loss, metrics.q_mean, metrics.td_abs_mean))
    loss, q_mean, td = (float(np.mean(column)) for column in zip(*tail, strict=True))
    return TrainLog(updates, loss, q_mean, td)


def train_offline(agent: ValueAgent, data: OfflineData, steps: int, seed: int = 0) -> TrainLog:
    """``steps`` updates on uniformly sampled batches of the logged transitions."""
    return train_updates(agent, offline_memory(data), steps, np.random.default_rng(seed))


# ==== acting ========================================================================================
@dataclass
class OfflinePolicy:
    """A trained agent with the scaler and grid that connect it to the building: observation -> setpoints.

    With a behaviour-cloning agent and ``support_threshold`` above 0 it acts only on the cells
    ``support_mask`` keeps (acting is ``pipeline.building_policy.BuildingPolicy``'s, as a published version's).
    """

    agent: ValueAgent
    scaler: ObservationScaler
    grid: SetpointGrid
    utc_offset_hours: float
    behaviour: ValueAgent | None = None
    support_threshold: float = 0.0

    @classmethod
    def from_training(cls, agent: ValueAgent, data: OfflineData, behaviour: ValueAgent | None = None,
                      support_threshold: float = 0.0) -> OfflinePolicy:
        return cls(agent, data.scaler, data.grid, data.utc_offset_hours, behaviour, support_threshold)

    def acting(self) -> BuildingPolicy:
        """The policy as a published version plays it (online network, scaler, grid, filter)."""
        behaviour = self.behaviour.online if self.behaviour is not None else None
        return BuildingPolicy(self.agent.online, self.scaler, self.grid, self.utc_offset_hours, behaviour,
                              self.support_threshold)

    def action(self, observation_O: np.ndarray, timestamp_s: float) -> int:
        """The greedy grid cell for a raw observation vector seen at UTC epoch second ``timestamp_s``."""
        return self.acting().action(observation_O, timestamp_s)

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

