"""SlateQ (Ie et al. 2019): a slate's long-term value decomposed into item values, for RecSim slates.

A slate A of k items out of the candidates is too many actions for one Q-value
each, so SlateQ learns one value per item and combines them with the user's
choice model (``pipeline.slate_network``, shared with the slate actors, holds the
decomposition, the slate selections and the item-value network):

  Q(s, A)  = sum_{i in A} P(i | s, A) * Qbar(s, i) + P(none | s, A) * Qbar(s, none)
  target on the consumed item i (the clicked one, or "none") with reward r:
    Q-learning: y = r + bootstrap * Q_target(s', A*), A* the slate the configured selection picks
                with Q_target's item values (optimal: the max over every slate; topk, greedy: theirs)
    SARSA:      y = r + bootstrap * Q_target(s', A'_shown)
  loss = Huber(y - Qbar(s, i)).
The target's slate is the one the agent would show (RecSim's SlateQ pairs each serving
method with the same target method), so the values learned are those of the policy that
acts, and topk and greedy never enumerate slates.
The no-click option is an item with its own learned value (the paper's null item).
RecSim's agent gives it value 0, which makes every no-click look like the end of the
session: with about half the steps unclicked its values settle near r / (1 - gamma / 2)
and learn nothing of the future (the quality that lengthens a session).

Observations are what RecSim shows the agent: the user's interest per topic and the
candidates' topics (``numeric_state`` without the hidden time budget).
``SlateQLearnerAgent`` puts the agent behind the value learner's interface (replay
batches of steps-table transitions in, ``TrainMetrics`` out), so ``rlpipe run
--preset slateq-recsim`` trains it on the pipeline; ``bench/slateq_recsim.py`` drives
``SlateQAgent`` directly.  Shapes are named by suffix: ``_B`` per transition, ``_C`` per
candidate, ``_S`` per slate, ``_K`` per slot, ``_T`` per topic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn

from consumers.value.agent import TrainMetrics, load_networks_state, networks_state_dict
from consumers.value.config import ValueLearnerConfig
from consumers.value.targets import huber_loss
from pipeline.slate_network import (
    SlateEnvSpec,
    SlateSelection,
    all_slates,
    best_slate,
    build_item_network,
    candidate_weights,
    choice_weights,
    item_values,
    select_slate,
    select_slates,
    slate_value,
    slate_values,
    split_observation,
)

__all__ = [
    "SlateEnvSpec", "SlateQAgent", "SlateQConfig", "SlateQLearnerAgent", "SlateSelection", "SlateTransitions",
    "all_slates", "choice_weights", "select_slate", "select_slates", "slate_value", "slate_values", "slateq_targets",
]


@dataclass(frozen=True)
class SlateQConfig:
    """What a SlateQ agent needs besides the environment's configuration."""

    gamma: float = 0.9
    hidden_sizes: tuple[int, ...] = (64, 64)
    learning_rate: float = 1e-3
    adam_eps: float = 1e-8
    huber_delta: float = 1.0
    batch_size: int = 64
    target_update_period: int = 100
    max_grad_norm: float = 10.0
    selection: SlateSelection = "optimal"
    td: Literal["q_learning", "sarsa"] = "q_learning"
    seed: int = 0


def slateq_targets(rewards_B: torch.Tensor, bootstrap_B: torch.Tensor, next_value_B: torch.Tensor) -> torch.Tensor:
    """y = r + bootstrap * Q_target(s', A') with A' the selection's slate (Q-learning) or the next one shown (SARSA)."""
    return rewards_B + bootstrap_B * next_value_B


# ---- the agent ------------------------------------------------------------------------


@dataclass(frozen=True)
class SlateTransitions:
    """A batch of steps: the state, the clicked candidate (-1: no click), the reward and the next state."""

    interests_BT: np.ndarray
    topics_BC: np.ndarray  # int, candidate topics
    clicked_B: np.ndarray  # int, the clicked candidate's index, -1 for no click
    reward_B: np.ndarray
    bootstrap_B: np.ndarray  # gamma, 0 after the session ended
    next_interests_BT: np.ndarray
    next_topics_BC: np.ndarray
    next_slate_BK: np.ndarray  # int, the slate shown next (SARSA); anything when bootstrap is 0


class SlateQAgent:
    """Item value network Qbar(s, i), its target copy and Adam; ``act`` and ``train_step`` as for DQN."""

    def __init__(self, config: SlateQConfig, env: SlateEnvSpec) -> None:
        self.config, self.env = config, env
        self.num_topics = env.num_topics
        # every k-subset, for the optimal selection only (SlateSpec bounds their number for it)
        self.slates_SK = all_slates(env.num_candidates, env.slate_size) if config.selection == "optimal" else None
        self.online: nn.Module = build_item_network(env.num_topics, config.hidden_sizes, config.seed)
        self.target: nn.Module = build_item_network(env.num_topics, config.hidden_sizes, config.seed)
        self.optimizer = torch.optim.Adam(self.online.parameters(), lr=config.learning_rate, eps=config.adam_eps)
        self.steps = 0

    def item_values(
        self, network: nn.Module, interests_BT: torch.Tensor, topics_BC: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Qbar(s, i) for every candidate, (B, C), and Qbar(s, none), (B,)."""
        return item_values(network, self.num_topics, interests_BT, topics_BC)

    def act(self, interests_T: Sequence[float], topics_C: Sequence[int]) -> tuple[int, ...]:
        """The slate the configured selection picks with the online network."""
        return best_slate(self.online, self.env, self.config.selection, [*interests_T, *topics_C])

    def next_values(self, batch: SlateTransitions) -> torch.Tensor:
        """Q_target(s', A'): the value of the slate the selection picks (Q-learning) or of the shown one (SARSA)."""
        interests_BT = torch.as_tensor(batch.next_interests_BT, dtype=torch.float32)
        topics_BC = torch.as_tensor(batch.next_topics_BC, dtype=torch.int64)
        with torch.no_grad():
            q_BC, no_click_q_B = self.item_values(self.target, interests_BT, topics_BC)
        weights_BC, no_click = candidate_weights(interests_BT, topics_BC, self.env)
        if self.config.td == "sarsa":
            slate_BK = torch.as_tensor(batch.next_slate_BK, dtype=torch.int64)
        else:
            slate_BK = select_slates(weights_BC, q_BC, no_click, no_click_q_B, self.env.slate_size,
                                     self.config.selection, self.slates_SK)
        return slate_value(weights_BC.gather(1, slate_BK), q_BC.gather(1, slate_BK), no_click, no_click_q_B)

    def train_step(self, batch: SlateTransitions) -> dict[str, float]:
        """One Huber step of Qbar(s, consumed item) towards the SlateQ target; returns loss, |TD| and Q means."""
        targets_B = slateq_targets(
            torch.as_tensor(batch.reward_B, dtype=torch.float32),
            torch.as_tensor(batch.bootstrap_B, dtype=torch.float32),
            self.next_values(batch),
        )
        interests_BT = torch.as_tensor(batch.interests_BT, dtype=torch.float32)
        topics_BC = torch.as_tensor(batch.topics_BC, dtype=torch.int64)
        clicked_B = torch.as_tensor(batch.clicked_B, dtype=torch.int64)
        q_BC, no_click_q_B = self.item_values(self.online, interests_BT, topics_BC)
        clicked_q_B = q_BC.gather(1, clicked_B.clamp(min=0)[:, None]).squeeze(1)
        q_B = torch.where(clicked_B >= 0, clicked_q_B, no_click_q_B)
        td_B = targets_B - q_B
        loss = huber_loss(td_B, self.config.huber_delta).mean()
        self.optimizer.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.online.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        self.steps += 1
        if self.steps % self.config.target_update_period == 0:
            self.target.load_state_dict(self.online.state_dict())
        return {"loss": loss.item(), "td_abs_mean": td_B.detach().abs().mean().item(),
                "q_mean": q_B.detach().mean().item(), "grad_norm": float(grad_norm)}


# ---- behind the value learner's interface --------------------------------------------


def replay_to_slate_transitions(batch: Mapping[str, np.ndarray], env: SlateEnvSpec) -> SlateTransitions:
    """A replay batch of steps-table transitions (``action``: the consumed candidate, -1 none) as SlateQ's batch.

    bootstrap = discount * (1 - terminal), as ``ValueAgent.train_step``; SARSA's next slate is not stored
    (the pipeline's SlateQ is Q-learning), so ``next_slate_BK`` is zeros.
    """
    interests_BT, topics_BC = split_observation(batch["observation"], env)
    next_interests_BT, next_topics_BC = split_observation(batch["next_observation"], env)
    bootstrap_B = np.asarray(batch["discount"], np.float32) * (1.0 - np.asarray(batch["terminal"], np.float32))
    return SlateTransitions(
        interests_BT=interests_BT, topics_BC=topics_BC, clicked_B=np.asarray(batch["action"], np.int64),
        reward_B=np.asarray(batch["reward"], np.float32), bootstrap_B=bootstrap_B,
        next_interests_BT=next_interests_BT, next_topics_BC=next_topics_BC,
        next_slate_BK=np.zeros((len(bootstrap_B), env.slate_size), np.int64),
    )


class SlateQLearnerAgent:
    """SlateQ as the value learner's agent: replay batches in, ``TrainMetrics`` out, state as named tensors.

    The learner (``consumers.value.learner``) samples the replay memory uniformly and calls
    ``train_step``; it publishes ``online`` (the item-value network) and checkpoints ``state_dict``.
    """

    def __init__(self, config: ValueLearnerConfig, env: SlateEnvSpec, selection: SlateSelection) -> None:
        self.env = env
        self.slateq = SlateQAgent(SlateQConfig(
            gamma=config.gamma, hidden_sizes=config.hidden_sizes, learning_rate=config.learning_rate,
            adam_eps=config.adam_eps, huber_delta=config.huber_delta, batch_size=config.batch_size,
            target_update_period=config.target_update_period, max_grad_norm=config.max_grad_norm,
            selection=selection, seed=config.seed,
        ), env)
        self.online = self.slateq.online

    @property
    def training_steps(self) -> int:
        return self.slateq.steps

    def train_step(self, batch: Mapping[str, np.ndarray]) -> TrainMetrics:
        metrics = self.slateq.train_step(replay_to_slate_transitions(batch, self.env))
        return TrainMetrics(
            loss=metrics["loss"], td_abs_mean=metrics["td_abs_mean"], q_mean=metrics["q_mean"],
            grad_norm=metrics["grad_norm"],
            target_synced=self.slateq.steps % self.slateq.config.target_update_period == 0,
            priorities_B=np.ones(len(batch["action"])),  # uniform replay only (ValueLearnerConfig refuses others)
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        return networks_state_dict(self.slateq.online, self.slateq.target, self.slateq.optimizer, self.slateq.steps)

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self.slateq.steps = load_networks_state(state, self.slateq.online, self.slateq.target, self.slateq.optimizer)
