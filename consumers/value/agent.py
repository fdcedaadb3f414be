"""DQN and C51 agents: an online network, a target network and Adam, driven one batch at a time.

Replay batch (``ReplayMemory.sample``) -> ``train_step`` -> metrics and new priorities.
The agent owns no replay memory and no environment: the learner service samples
and feeds batches, actors call ``act`` on published weights, and the same object
serves both.  Per training step:
  1. bootstrap_B = discount_B * (1 - terminal_B)      (0 past a terminal state)
  2. per-transition loss: Huber(y - Q(s, a)) for DQN, cross-entropy to the
     projected target distribution for C51 (``targets``), Double-Q if configured
  3. loss = mean_B(w_B * loss_B), w_B the importance weights (1 when uniform)
  4. Adam step on the online network, gradient norm clipped to ``max_grad_norm``
  5. every ``target_update_period`` steps the target network copies the online one
``state_dict`` is tensors only (both networks, Adam's moments, the step count), so a
checkpoint is one safetensors file and the configuration rebuilds everything else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from consumers.value.config import ValueLearnerConfig
from consumers.value.networks import build_network
from consumers.value.targets import (
    categorical_cross_entropy,
    categorical_targets,
    double_q_targets,
    huber_loss,
    q_learning_targets,
)
from pipeline.value_network import linearly_decaying_epsilon

__all__ = [
    "C51Agent", "DQNAgent", "TrainMetrics", "ValueAgent", "build_agent", "linearly_decaying_epsilon",
    "load_networks_state", "networks_state_dict",
]

_BATCH_KEYS = ("observation", "action", "reward", "discount", "next_observation", "terminal")


@dataclass(frozen=True)
class TrainMetrics:
    """What one training step reports; ``priorities_B`` go back to a prioritized replay memory."""

    loss: float
    td_abs_mean: float  # mean |E[target] - Q(s, a)|
    q_mean: float  # mean Q(s, a) of the actions taken
    grad_norm: float  # before clipping
    target_synced: bool
    priorities_B: np.ndarray

    def scalars(self) -> dict[str, float]:
        return {
            "loss": self.loss, "td_abs_mean": self.td_abs_mean, "q_mean": self.q_mean,
            "grad_norm": self.grad_norm, "target_synced": float(self.target_synced),
        }


class ValueAgent:
    """What DQN and C51 share: networks, optimizer, acting, the training step and the state."""

    def __init__(self, config: ValueLearnerConfig, observation_size: int, num_actions: int) -> None:
        self.config, self.observation_size, self.num_actions = config, observation_size, num_actions
        self.online = build_network(config, observation_size, num_actions)
        self.target = build_network(config, observation_size, num_actions)
        self.target.load_state_dict(self.online.state_dict())
        self.target.requires_grad_(False)
        self.optimizer = torch.optim.Adam(self.online.parameters(), lr=config.learning_rate, eps=config.adam_eps)
        self.training_steps = 0

    # ---- acting ------------------------------------------------------------------------
    def act(self, observation: np.ndarray, epsilon: float, rng: np.random.Generator) -> int:
        """Epsilon-greedy: a uniform action with probability epsilon, else argmax_a Q(s, a)."""
        if rng.random() < epsilon:
            return int(rng.integers(self.num_actions))
        with torch.no_grad():
            q_A = self.online.q_values(torch.as_tensor(observation, dtype=torch.float32).view(1, -1))[0]
        return int(q_A.argmax())

    # ---- learning ----------------------------------------------------------------------
    def train_step(self, batch: Mapping[str, np.ndarray]) -> TrainMetrics:
        missing = set(_BATCH_KEYS) - set(batch)
        if missing:
            raise ValueError(f"training batch lacks {sorted(missing)}; sample it with ReplayMemory.sample")
        obs_BO = torch.as_tensor(batch["observation"], dtype=torch.float32)
        action_B = torch.as_tensor(batch["action"], dtype=torch.int64)
        reward_B = torch.as_tensor(batch["reward"], dtype=torch.float32)
        next_obs_BO = torch.as_tensor(batch["next_observation"], dtype=torch.float32)
        terminal_B = torch.as_tensor(batch["terminal"], dtype=torch.float32)
        bootstrap_B = torch.as_tensor(batch["discount"], dtype=torch.float32) * (1.0 - terminal_B)
        weights = batch.get("weights")
        weight_B = torch.ones_like(reward_B) if weights is None else torch.as_tensor(weights, dtype=torch.float32)
        loss_B, q_B, td_B = self._losses(obs_BO, action_B, reward_B, bootstrap_B, next_obs_BO)
        loss = (weight_B * loss_B).mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.online.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        self.training_steps += 1
        synced = self.training_steps % self.config.target_update_period == 0
        if synced:
            self.target.load_state_dict(self.online.state_dict())
        priorities_B = self._priorities(loss_B.detach(), td_B) + self.config.priority_epsilon
        return TrainMetrics(
            loss=float(loss.detach()), td_abs_mean=float(td_B.abs().mean()), q_mean=float(q_B.mean()),
            grad_norm=float(grad_norm), target_synced=synced, priorities_B=priorities_B.numpy().astype(np.float64),
        )

    def _losses(
        self, obs_BO: torch.Tensor, action_B: torch.Tensor, reward_B: torch.Tensor,
        bootstrap_B: torch.Tensor, next_obs_BO: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss_B with gradient, Q(s, a)_B, TD error_B) for one batch."""
        raise NotImplementedError

    def _priorities(self, loss_B: torch.Tensor, td_B: torch.Tensor) -> torch.Tensor:
        return td_B.abs()

    # ---- state -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Both networks, Adam's per-parameter state and the step count, as named tensors."""
        return networks_state_dict(self.online, self.target, self.optimizer, self.training_steps)

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore what ``state_dict`` returned (the configuration must match the one it was saved with)."""
        self.training_steps = load_networks_state(state, self.online, self.target, self.optimizer)


def networks_state_dict(online: torch.nn.Module, target: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        training_steps: int) -> dict[str, torch.Tensor]:
    """An agent's state as named tensors: ``online/*``, ``target/*``, ``adam/<param>/<slot>``, ``training_steps``."""
    state = {f"online/{k}": v.detach().clone() for k, v in online.state_dict().items()}
    state |= {f"target/{k}": v.detach().clone() for k, v in target.state_dict().items()}
    for index, slots in optimizer.state_dict()["state"].items():
        state |= {f"adam/{index}/{k}": torch.as_tensor(v).detach().clone() for k, v in slots.items()}
    state["training_steps"] = torch.tensor(training_steps, dtype=torch.int64)
    return state


def load_networks_state(state: Mapping[str, torch.Tensor], online: torch.nn.Module, target: torch.nn.Module,
                        optimizer: torch.optim.Optimizer) -> int:
    """Load what ``networks_state_dict`` wrote into the modules and the optimizer; return the step count."""
    if "training_steps" not in state:
        raise ValueError("agent state lacks training_steps; was it written by ValueAgent.state_dict?")
    online.load_state_dict(_section(state, "online/"))
    target.load_state_dict(_section(state, "target/"))
    adam: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in _section(state, "adam/").items():
        index, slot = key.split("/", 1)
        adam.setdefault(int(index), {})[slot] = value.clone()
    groups = optimizer.state_dict()["param_groups"]
    optimizer.load_state_dict({"state": adam, "param_groups": groups})
    return int(state["training_steps"])


def _section(state: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


class DQNAgent(ValueAgent):
    """DQN (Mnih et al. 2015) with n-step returns, Huber loss and optional Double-Q."""

    def _losses(self, obs_BO, action_B, reward_B, bootstrap_B, next_obs_BO):  # type: ignore[no-untyped-def]
        q_B = self.online(obs_BO).gather(-1, action_B[:, None]).squeeze(-1)
        with torch.no_grad():
            next_target_BA = self.target(next_obs_BO)
            if self.config.double_q:
                y_B = double_q_targets(reward_B, bootstrap_B, next_target_BA, self.online(next_obs_BO))
            else:
                y_B = q_learning_targets(reward_B, bootstrap_B, next_target_BA)
        td_B = y_B - q_B
        return huber_loss(td_B, self.config.huber_delta), q_B.detach(), td_B.detach()


class C51Agent(ValueAgent):
    """C51 (Bellemare et al. 2017): cross-entropy to the projected distributional Bellman target."""

    def _losses(self, obs_BO, action_B, reward_B, bootstrap_B, next_obs_BO):  # type: ignore[no-untyped-def]
        support_N = self.online.support_N
        logits_BAN = self.online(obs_BO)
        logits_BN = logits_BAN[torch.arange(len(action_B)), action_B]
        with torch.no_grad():
            next_probs_BAN = torch.softmax(self.target(next_obs_BO), dim=-1)
            chooser = self.online if self.config.double_q else self.target
            best_B = chooser.q_values(next_obs_BO).argmax(dim=-1)
            next_probs_BN = next_probs_BAN[torch.arange(len(best_B)), best_B]
            target_BN = categorical_targets(reward_B, bootstrap_B, next_probs_BN, support_N)
            q_B = (torch.softmax(logits_BN, dim=-1) * support_N).sum(-1)
            td_B = (target_BN * support_N).sum(-1) - q_B
        return categorical_cross_entropy(target_BN, logits_BN), q_B, td_B

    def _priorities(self, loss_B: torch.Tensor, td_B: torch.Tensor) -> torch.Tensor:
        # As Dopamine's Rainbow: the cross-entropy itself, the distributional analogue of |TD|.
        return loss_B


def build_agent(config: ValueLearnerConfig, observation_size: int, num_actions: int) -> ValueAgent:
    """The agent ``config.agent`` names."""
    agent_class = C51Agent if config.agent == "c51" else DQNAgent
    return agent_class(config, observation_size, num_actions)
