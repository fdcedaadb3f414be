"""SlateQ (Ie et al. 2019): a slate's long-term value decomposed into item values, for RecSim slates.

A slate A of k items out of the candidates is too many actions for one Q-value
each, so SlateQ learns one value per item and combines them with the user's
choice model, which the recommender knows (here: RecSim's, ``producers.envs.recsim``):

  Q(s, A)  = sum_{i in A} P(i | s, A) * Qbar(s, i) + P(none | s, A) * Qbar(s, none)
  P(i | s, A) = v_i / (v_0 + sum_{j in A} v_j)            v: the choice model's unnormalised weights
  target on the consumed item i (the clicked one, or "none") with reward r:
    Q-learning: y = r + bootstrap * max_{A'} Q_target(s', A')
    SARSA:      y = r + bootstrap * Q_target(s', A'_shown)
  loss = Huber(y - Qbar(s, i)).
The no-click option is an item with its own learned value (the paper's null item).
RecSim's agent gives it value 0, which makes every no-click look like the end of the
session: with about half the steps unclicked its values settle near r / (1 - gamma / 2)
and learn nothing of the future (the quality that lengthens a session).

Slate selection, given the weights v and item values q of the candidates:
``optimal`` enumerates every k-subset (exact; C(5, 2) = 10 for RecSim's default),
``topk`` takes the k largest v_i (q_i - q_none), ``greedy`` adds one item at a time, each the one
that raises the slate's value most.  The order inside a slate does not matter to
the choice model, so slates are subsets in ascending index order.

Observations are what RecSim shows the agent: the user's interest per topic and the
candidates' topics (``numeric_state`` without the hidden time budget).  An item's
value network sees the interests and the item's one-hot topic (all zeros for no click).  Shapes are named by
suffix: ``_B`` per transition, ``_C`` per candidate, ``_S`` per slate, ``_K`` per slot,
``_T`` per topic.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
import torch
from torch import nn

from consumers.value.targets import huber_loss

SlateSelection = Literal["optimal", "topk", "greedy"]


class SlateEnvSpec(Protocol):
    """What SlateQ needs of the environment's configuration (RecSim's ``InterestEvolutionConfig`` has it)."""

    num_topics: int
    num_candidates: int
    slate_size: int
    choice_model: str  # "proportional" or "softmax"
    no_click_mass: float
    min_normalizer: float


@dataclass(frozen=True)
class SlateQConfig:
    """What a SlateQ agent needs besides the environment's configuration."""

    gamma: float = 0.9
    hidden_sizes: tuple[int, ...] = (64, 64)
    learning_rate: float = 1e-3
    batch_size: int = 64
    target_update_period: int = 100
    max_grad_norm: float = 10.0
    selection: SlateSelection = "optimal"
    td: Literal["q_learning", "sarsa"] = "q_learning"
    seed: int = 0


# ---- the decomposition, as pure functions ------------------------------------------


def choice_weights(scores: Sequence[float] | np.ndarray, env: SlateEnvSpec) -> tuple[np.ndarray, float]:
    """The choice model's unnormalised weights of items with these scores, and the no-click weight.

    Proportional: v = score - min_normalizer; softmax: v = exp(score) (the same ratios as
    ``producers.envs.recsim.choice_probabilities``, which normalises them over one slate).
    """
    scores = np.asarray(scores, dtype=np.float64)
    if env.choice_model == "softmax":
        return np.exp(scores), math.exp(env.no_click_mass)
    return scores - env.min_normalizer, env.no_click_mass - env.min_normalizer


def slate_value(weights_K, item_q_K, no_click_weight: float, no_click_q=0.0):
    """Q(s, A) = (sum_i v_i q_i + v_0 q_0) / (v_0 + sum_i v_i) over the slate's items (the last axis).

    Arrays or tensors; ``no_click_q`` is one value or one per row.
    """
    return ((weights_K * item_q_K).sum(-1) + no_click_weight * no_click_q) / (no_click_weight + weights_K.sum(-1))


def all_slates(num_candidates: int, slate_size: int) -> np.ndarray:
    """Every k-subset of the candidates, ascending, as an (S, K) index array."""
    return np.array(list(itertools.combinations(range(num_candidates), slate_size)), dtype=np.int64)


def slate_values(
    weights_BC: torch.Tensor, item_q_BC: torch.Tensor, no_click_weight: float, no_click_q_B: torch.Tensor,
    slates_SK: np.ndarray,
) -> torch.Tensor:
    """Q(s, A) for every slate of ``slates_SK`` and every row: (B, S)."""
    index_SK = torch.as_tensor(slates_SK)
    return slate_value(weights_BC[:, index_SK], item_q_BC[:, index_SK], no_click_weight, no_click_q_B[:, None])


def select_slate(
    weights_C: np.ndarray, item_q_C: np.ndarray, no_click_weight: float, slate_size: int, method: SlateSelection,
    no_click_q: float = 0.0,
) -> tuple[int, ...]:
    """The slate ``method`` picks from the candidates' choice weights and item values (ascending indices).

    ``topk`` ranks by v_i (q_i - q_0): an item is worth showing by how much more it is worth than no click.
    """
    if method == "optimal":
        slates_SK = all_slates(len(weights_C), slate_size)
        values_S = slate_value(weights_C[slates_SK], item_q_C[slates_SK], no_click_weight, no_click_q)
        return tuple(int(i) for i in slates_SK[int(np.argmax(values_S))])
    if method == "topk":
        ranked = sorted(range(len(weights_C)), key=lambda i: (-weights_C[i] * (item_q_C[i] - no_click_q), i))
        return tuple(sorted(ranked[:slate_size]))
    if method == "greedy":
        chosen: list[int] = []
        for _ in range(slate_size):
            def value_with(i: int) -> float:
                slate = [*chosen, i]
                return float(slate_value(weights_C[slate], item_q_C[slate], no_click_weight, no_click_q))
            rest = [i for i in range(len(weights_C)) if i not in chosen]
            chosen.append(max(rest, key=lambda i: (value_with(i), -i)))
        return tuple(sorted(chosen))
    raise ValueError(f"unknown slate selection {method!r}; use optimal, topk or greedy")


def slateq_targets(rewards_B: torch.Tensor, bootstrap_B: torch.Tensor, next_value_B: torch.Tensor) -> torch.Tensor:
    """y = r + bootstrap * Q_target(s', A') with A' the best slate (Q-learning) or the next one shown (SARSA)."""
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
        self.slates_SK = all_slates(env.num_candidates, env.slate_size)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            self.online = _mlp(2 * env.num_topics, config.hidden_sizes)
        self.target = _mlp(2 * env.num_topics, config.hidden_sizes)
        self.target.load_state_dict(self.online.state_dict())
        self.optimizer = torch.optim.Adam(self.online.parameters(), lr=config.learning_rate)
        self.steps = 0

    def item_values(
        self, network: nn.Module, interests_BT: torch.Tensor, topics_BC: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Qbar(s, i) for every candidate, (B, C), and Qbar(s, none), (B,)."""
        batch, count = topics_BC.shape
        onehot_BCT = nn.functional.one_hot(topics_BC, self.num_topics).float()
        onehot_BCT = torch.cat([onehot_BCT, torch.zeros(batch, 1, self.num_topics)], dim=1)
        user_BCT = interests_BT[:, None, :].expand(batch, count + 1, self.num_topics)
        q_BC = network(torch.cat([user_BCT, onehot_BCT], dim=-1)).squeeze(-1)
        return q_BC[:, :count], q_BC[:, count]

    def weights(self, interests_BT: torch.Tensor, topics_BC: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The choice weights of every candidate (their score is the user's interest in the topic)."""
        scores_BC = interests_BT.gather(1, topics_BC)
        weights_BC, no_click = choice_weights(scores_BC.numpy(), self.env)
        return torch.as_tensor(weights_BC, dtype=torch.float32), no_click

    def act(self, interests_T: Sequence[float], topics_C: Sequence[int]) -> tuple[int, ...]:
        """The slate the configured selection picks with the online network."""
        interests_BT = torch.tensor([interests_T], dtype=torch.float32)
        topics_BC = torch.tensor([topics_C], dtype=torch.int64)
        with torch.no_grad():
            q_BC, no_click_q_B = self.item_values(self.online, interests_BT, topics_BC)
        weights_BC, no_click = self.weights(interests_BT, topics_BC)
        return select_slate(weights_BC[0].numpy().astype(np.float64), q_BC[0].numpy().astype(np.float64), no_click,
                            self.env.slate_size, self.config.selection, float(no_click_q_B[0]))

    def next_values(self, batch: SlateTransitions) -> torch.Tensor:
        """Q_target(s', A'): the best slate's value (Q-learning) or the shown slate's (SARSA)."""
        interests_BT = torch.as_tensor(batch.next_interests_BT, dtype=torch.float32)
        topics_BC = torch.as_tensor(batch.next_topics_BC, dtype=torch.int64)
        with torch.no_grad():
            q_BC, no_click_q_B = self.item_values(self.target, interests_BT, topics_BC)
        weights_BC, no_click = self.weights(interests_BT, topics_BC)
        if self.config.td == "sarsa":
            shown_BK = torch.as_tensor(batch.next_slate_BK, dtype=torch.int64)
            return slate_value(weights_BC.gather(1, shown_BK), q_BC.gather(1, shown_BK), no_click, no_click_q_B)
        return slate_values(weights_BC, q_BC, no_click, no_click_q_B, self.slates_SK).max(dim=1).values

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
        loss = huber_loss(td_B).mean()
        self.optimizer.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.online.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        self.steps += 1
        if self.steps % self.config.target_update_period == 0:
            self.target.load_state_dict(self.online.state_dict())
        return {"loss": loss.item(), "td_abs_mean": td_B.detach().abs().mean().item(),
                "q_mean": q_B.detach().mean().item(), "grad_norm": float(grad_norm)}


def _mlp(input_size: int, hidden_sizes: Sequence[int]) -> nn.Module:
    layers: list[nn.Module] = []
    for size in hidden_sizes:
        layers += [nn.Linear(input_size, size), nn.ReLU()]
        input_size = size
    layers.append(nn.Linear(input_size, 1))
    return nn.Sequential(*layers)
