"""Q-networks over an observation vector: an MLP torso with a DQN or a C51 head.

Shapes are named by suffix: ``_B`` per transition, ``_O`` per observation feature,
``_A`` per action, ``_N`` per atom.  Both networks answer ``q_values(obs_BO)`` so
acting code never needs to know which head it holds.  Initialisation is a pure
function of the seed (torch's global generator is forked, not disturbed), so an
actor and a learner built from the same configuration start from identical weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from consumers.value.config import ValueLearnerConfig


def mlp(input_size: int, hidden_sizes: Sequence[int], output_size: int) -> nn.Sequential:
    """Linear -> ReLU -> ... -> Linear: the torso and the head in one stack."""
    layers: list[nn.Module] = []
    width = input_size
    for hidden in hidden_sizes:
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, output_size))
    return nn.Sequential(*layers)


class QNetwork(nn.Module):
    """DQN: one expected return per action, Q(s, a)."""

    def __init__(self, observation_size: int, num_actions: int, hidden_sizes: Sequence[int]) -> None:
        super().__init__()
        self.num_actions = num_actions
        self.layers = mlp(observation_size, hidden_sizes, num_actions)

    def forward(self, obs_BO: torch.Tensor) -> torch.Tensor:
        """Q values, shape (B, A)."""
        return self.layers(obs_BO)

    def q_values(self, obs_BO: torch.Tensor) -> torch.Tensor:
        return self.forward(obs_BO)


class CategoricalQNetwork(nn.Module):
    """C51: a distribution over returns per action, on a fixed support z_N (Bellemare et al. 2017).

    Q(s, a) = sum_i z_i p_i(s, a), with p(s, a) = softmax over atoms of the logits.
    """

    def __init__(
        self, observation_size: int, num_actions: int, hidden_sizes: Sequence[int],
        num_atoms: int, v_min: float, v_max: float,
    ) -> None:
        super().__init__()
        self.num_actions, self.num_atoms = num_actions, num_atoms
        self.layers = mlp(observation_size, hidden_sizes, num_actions * num_atoms)
        # The support is derived from the configuration, so it is not part of the weights.
        self.register_buffer("support_N", torch.linspace(v_min, v_max, num_atoms), persistent=False)

    def forward(self, obs_BO: torch.Tensor) -> torch.Tensor:
        """Logits over atoms, shape (B, A, N)."""
        return self.layers(obs_BO).view(-1, self.num_actions, self.num_atoms)

    def q_values(self, obs_BO: torch.Tensor) -> torch.Tensor:
        probs_BAN = torch.softmax(self.forward(obs_BO), dim=-1)
        return (probs_BAN * self.support_N).sum(dim=-1)


def build_network(config: ValueLearnerConfig, observation_size: int, num_actions: int) -> nn.Module:
    """The network ``config.agent`` calls for, initialised from ``config.seed`` alone."""
    if observation_size < 1 or num_actions < 2:
        raise ValueError(
            f"observation_size {observation_size} and num_actions {num_actions}: need at least 1 feature and 2 actions"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        if config.agent == "c51":
            return CategoricalQNetwork(
                observation_size, num_actions, config.hidden_sizes, config.num_atoms, config.v_min, config.v_max
            )
        return QNetwork(observation_size, num_actions, config.hidden_sizes)
