"""Q-networks over an observation vector, and their published form: what actors and the value learner share.

Value learner -> ``network_files`` -> registry (kind ``value-network``) -> actor ->
``load_network``.  A published version is two files: ``value_network.safetensors``
(the online network's tensors) and ``value_config.json`` (``NetworkSpec``: the
head, the sizes and the support, everything that rebuilds the module), so an actor
needs no learner configuration and nothing is unpickled.  A SlateQ version
(agent ``slateq``) is an item-value network (``pipeline.slate_network``), and its JSON
holds the slate environment's choice model (``schemas.value.SlateSpec``) as well.

Shapes are named by suffix: ``_B`` per transition, ``_O`` per observation feature,
``_A`` per action, ``_N`` per atom.  Both networks answer ``q_values(obs_BO)`` so
acting code never needs to know which head it holds.  Initialisation is a pure
function of the seed (torch's global generator is forked, not disturbed), so an
actor and a learner built from the same configuration start from identical weights.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from safetensors.torch import load as load_tensors
from torch import nn

from pipeline.io.tensors import save_tensors
from pipeline.slate_network import build_item_network
from schemas.value import SlateSpec

CONFIG_FILE = "value_config.json"
WEIGHTS_FILE = "value_network.safetensors"


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


def linearly_decaying_epsilon(step: int, decay_steps: int, warmup_steps: int, final_epsilon: float) -> float:
    """Dopamine's exploration schedule: 1 during warm-up, then linear down to ``final_epsilon`` over ``decay_steps``.

      epsilon(t) = final + (1 - final) * clip(1 - (t - warmup) / decay, 0, 1)
    """
    remaining = min(max(1.0 - (step - warmup_steps) / max(decay_steps, 1), 0.0), 1.0)
    return final_epsilon + (1.0 - final_epsilon) * remaining


class NetworkSpec(BaseModel):
    """Everything that rebuilds a Q-network's module (its weights come separately)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    agent: Literal["dqn", "c51", "slateq"] = Field(
        description="dqn (expected Q), c51 (categorical return distribution) or slateq (item values of a slate)"
    )
    observation_size: int = Field(ge=1, le=1_000_000)
    num_actions: int = Field(ge=2, le=1_000_000)
    hidden_sizes: tuple[int, ...] = Field(min_length=1, max_length=8)
    num_atoms: int = Field(51, ge=2, le=1001)
    v_min: float = -10.0
    v_max: float = 10.0
    slate: SlateSpec | None = Field(None, description="slateq: the environment's choice model and slate selection")

    @model_validator(mode="after")
    def _slate_for_slateq(self) -> NetworkSpec:
        if (self.agent == "slateq") != (self.slate is not None):
            raise ValueError(f"agent {self.agent}: a slate section is required for slateq and only for it")
        return self


def build_from_spec(spec: NetworkSpec, seed: int = 0) -> nn.Module:
    """The network ``spec`` describes, initialised from ``seed`` alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if spec.agent == "slateq":
            assert spec.slate is not None  # the spec's validator
            return build_item_network(spec.slate.num_topics, spec.hidden_sizes, seed)
        if spec.agent == "c51":
            return CategoricalQNetwork(
                spec.observation_size, spec.num_actions, spec.hidden_sizes, spec.num_atoms, spec.v_min, spec.v_max
            )
        return QNetwork(spec.observation_size, spec.num_actions, spec.hidden_sizes)


def network_files(spec: NetworkSpec, network: nn.Module) -> dict[str, bytes]:
    """The two files of a published value network (registry kind ``value-network``)."""
    tensors = {name: value.detach().contiguous().clone() for name, value in network.state_dict().items()}
    spec_json = spec.model_dump(mode="json", exclude_none=True)  # a DQN/C51 spec reads as before slates existed
    return {
        CONFIG_FILE: (json.dumps(spec_json, sort_keys=True, indent=2) + "\n").encode(),
        WEIGHTS_FILE: save_tensors(tensors),
    }


def network_from_files(files: dict[str, bytes]) -> tuple[NetworkSpec, nn.Module]:
    """Inverse of ``network_files``: the spec and the network with its weights loaded, in eval mode."""
    try:
        spec = NetworkSpec.model_validate_json(files[CONFIG_FILE])
    except ValidationError as exc:
        raise ValueError(f"{CONFIG_FILE} is not a valid value-network spec: {exc.errors()[0]['msg']}") from None
    network = build_from_spec(spec)
    network.load_state_dict(load_tensors(files[WEIGHTS_FILE]))
    return spec, network.eval()


def load_network(folder: str | os.PathLike[str]) -> tuple[NetworkSpec, nn.Module]:
    """A pulled value-network version (``AdapterRegistry.pull(..., kind="value-network")``) as a module."""
    root = Path(folder)
    return network_from_files({name: (root / name).read_bytes() for name in (CONFIG_FILE, WEIGHTS_FILE)})
