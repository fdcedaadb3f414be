"""Q-networks over an observation vector: an MLP torso with a DQN or a C51 head.

The modules live in ``pipeline.value_network`` (actors build them from a published
version too); this module builds them from the learner's configuration.

Shapes are named by suffix: ``_B`` per transition, ``_O`` per observation feature,
``_A`` per action, ``_N`` per atom.  Both networks answer ``q_values(obs_BO)`` so
acting code never needs to know which head it holds.  Initialisation is a pure
function of the seed (torch's global generator is forked, not disturbed), so an
actor and a learner built from the same configuration start from identical weights.
"""

from __future__ import annotations

from torch import nn

from consumers.value.config import ValueLearnerConfig
from pipeline.value_network import CategoricalQNetwork, NetworkSpec, QNetwork, build_from_spec, mlp
from schemas.value import SlateSpec

__all__ = ["CategoricalQNetwork", "QNetwork", "build_network", "mlp", "network_spec"]


def network_spec(config: ValueLearnerConfig, observation_size: int, num_actions: int,
                 slate: SlateSpec | None = None) -> NetworkSpec:
    """The module shape ``config`` calls for (what a published version's ``value_config.json`` holds)."""
    return NetworkSpec(
        agent=config.agent, observation_size=observation_size, num_actions=num_actions,
        hidden_sizes=config.hidden_sizes, num_atoms=config.num_atoms, v_min=config.v_min, v_max=config.v_max,
        slate=slate,
    )


def build_network(config: ValueLearnerConfig, observation_size: int, num_actions: int) -> nn.Module:
    """The network ``config.agent`` calls for, initialised from ``config.seed`` alone."""
    if observation_size < 1 or num_actions < 2:
        raise ValueError(
            f"observation_size {observation_size} and num_actions {num_actions}: need at least 1 feature and 2 actions"
        )
    return build_from_spec(network_spec(config, observation_size, num_actions), config.seed)
