"""SlateQ's decomposition and its item-value network: what slate actors and the value learner share.

SlateQ (Ie et al. 2019; the agent is ``consumers.value.slateq``) learns one value per
item and combines them with the user's choice model, which the recommender knows:

  Q(s, A)  = sum_{i in A} P(i | s, A) * Qbar(s, i) + P(none | s, A) * Qbar(s, none)
  P(i | s, A) = v_i / (v_0 + sum_{j in A} v_j)            v: the choice model's unnormalised weights

The learner trains Qbar; actors and ``rlpipe eval`` pick slates with it, from a
published version (``pipeline.value_network``: ``value_config.json`` names agent
``slateq`` and holds the ``SlateSpec``, so the network and the choice model rebuild
from the JSON alone).  Slate selection, given the weights v and item values q of the
candidates: ``optimal`` enumerates every k-subset (exact; C(5, 2) = 10 for RecSim's
default), ``topk`` takes the k largest v_i (q_i - q_none), ``greedy`` adds one item at a
time, each the one that raises the slate's value most.  The order inside a slate does
not matter to the choice model, so slates are subsets in ascending index order.

The item network sees the user's interests and the item's one-hot topic (all zeros
for no click).  A steps-table observation is the interests first and the candidates'
topics last (``split_observation``; RecSim's time budget between them stays hidden).
Shapes are named by suffix: ``_B`` per row, ``_C`` per candidate, ``_S`` per slate,
``_K`` per slot, ``_T`` per topic.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Literal, Protocol

import numpy as np
import torch
from torch import nn

SlateSelection = Literal["optimal", "topk", "greedy"]


class SlateEnvSpec(Protocol):
    """What SlateQ needs of the environment (``schemas.value.SlateSpec`` and RecSim's config both have it)."""

    num_topics: int
    num_candidates: int
    slate_size: int
    choice_model: str  # "proportional" or "softmax"
    no_click_mass: float
    min_normalizer: float


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


def select_slates(
    weights_BC: torch.Tensor, item_q_BC: torch.Tensor, no_click_weight: float, no_click_q_B: torch.Tensor,
    slate_size: int, method: SlateSelection, slates_SK: np.ndarray | None = None,
) -> torch.Tensor:
    """The slate ``method`` picks in every row, (B, K) candidate indices in ascending order: ``select_slate``
    for a batch (the same slates, ties to the lowest index).  ``optimal`` scores ``slates_SK`` (every k-subset);
    ``topk`` and ``greedy`` never enumerate slates, so they serve candidate sets too large for that."""
    if method == "optimal":
        if slates_SK is None:
            raise ValueError("optimal slate selection needs every k-subset: pass slates_SK=all_slates(C, k)")
        values_BS = slate_values(weights_BC, item_q_BC, no_click_weight, no_click_q_B, slates_SK)
        return torch.as_tensor(slates_SK)[values_BS.argmax(dim=1)]
    if method == "topk":
        gain_BC = weights_BC * (item_q_BC - no_click_q_B[:, None])
        ranked_BC = torch.sort(gain_BC, dim=1, descending=True, stable=True).indices
        return ranked_BC[:, :slate_size].sort(dim=1).values
    if method == "greedy":
        # Adding item c to the chosen set A: (sum_A v q + v_c q_c + v_0 q_0) / (v_0 + sum_A v + v_c).
        numerator_B = no_click_weight * no_click_q_B
        denominator_B = torch.full_like(numerator_B, no_click_weight)
        free_BC = torch.ones_like(weights_BC, dtype=torch.bool)
        for _ in range(slate_size):
            value_BC = (numerator_B[:, None] + weights_BC * item_q_BC) / (denominator_B[:, None] + weights_BC)
            best_B = value_BC.masked_fill(~free_BC, -torch.inf).argmax(dim=1)  # argmax: the first of equal maxima
            free_BC[torch.arange(len(best_B)), best_B] = False
            numerator_B = numerator_B + (weights_BC * item_q_BC).gather(1, best_B[:, None]).squeeze(1)
            denominator_B = denominator_B + weights_BC.gather(1, best_B[:, None]).squeeze(1)
        return torch.nonzero(~free_BC)[:, 1].view(-1, slate_size)
    raise ValueError(f"unknown slate selection {method!r}; use optimal, topk or greedy")


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


def candidate_weights(interests_BT: torch.Tensor, topics_BC: torch.Tensor, env: SlateEnvSpec) -> tuple[torch.Tensor, float]:
    """The choice weights of every candidate (its score is the user's interest in its topic), and no click's."""
    scores_BC = interests_BT.gather(1, topics_BC)
    weights_BC, no_click = choice_weights(scores_BC.numpy(), env)
    return torch.as_tensor(weights_BC, dtype=torch.float32), no_click


# ---- the item-value network --------------------------------------------------------


class ItemValueNetwork(nn.Module):
    """Qbar(s, i): an MLP over the user's interests and the item's one-hot topic, one value out."""

    def __init__(self, num_topics: int, hidden_sizes: Sequence[int]) -> None:
        super().__init__()
        self.num_topics = num_topics
        layers: list[nn.Module] = []
        width = 2 * num_topics
        for hidden in hidden_sizes:
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, 1))
        self.layers = nn.Sequential(*layers)

    def forward(self, features_BF: torch.Tensor) -> torch.Tensor:
        """Values of (interests, one-hot topic) rows, shape (..., 1)."""
        return self.layers(features_BF)

    def item_values(self, interests_BT: torch.Tensor, topics_BC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Qbar(s, i) for every candidate, (B, C), and Qbar(s, none), (B,)."""
        return item_values(self, self.num_topics, interests_BT, topics_BC)


def item_values(network: nn.Module, num_topics: int, interests_BT: torch.Tensor,
                topics_BC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``network``'s Qbar(s, i) for every candidate, (B, C), and Qbar(s, none), (B,).

    Each row of the network's input is (interests_T, one-hot topic_T); no click's topic is all zeros.
    """
    batch, count = topics_BC.shape
    onehot_BCT = nn.functional.one_hot(topics_BC, num_topics).float()
    onehot_BCT = torch.cat([onehot_BCT, torch.zeros(batch, 1, num_topics)], dim=1)
    user_BCT = interests_BT[:, None, :].expand(batch, count + 1, num_topics)
    q_BC = network(torch.cat([user_BCT, onehot_BCT], dim=-1)).squeeze(-1)
    return q_BC[:, :count], q_BC[:, count]


def build_item_network(num_topics: int, hidden_sizes: Sequence[int], seed: int = 0) -> ItemValueNetwork:
    """An item-value network initialised from ``seed`` alone (torch's global generator is forked, not disturbed)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ItemValueNetwork(num_topics, hidden_sizes)


def split_observation(obs_BO: np.ndarray, env: SlateEnvSpec) -> tuple[np.ndarray, np.ndarray]:
    """A steps-table observation's interests (B, T) and candidate topics (B, C, int): its first and last values."""
    obs_BO = np.asarray(obs_BO)
    interests_BT = obs_BO[:, : env.num_topics].astype(np.float32)
    topics_BC = np.rint(obs_BO[:, obs_BO.shape[1] - env.num_candidates :]).astype(np.int64)
    return interests_BT, topics_BC


def best_slate(network: nn.Module, env: SlateEnvSpec, selection: SlateSelection,
               observation: Sequence[float]) -> tuple[int, ...]:
    """The slate ``selection`` picks for one observation with ``network``'s item values."""
    interests_BT, topics_BC = (torch.as_tensor(a) for a in split_observation(np.asarray([observation]), env))
    with torch.no_grad():
        q_BC, no_click_q_B = item_values(network, env.num_topics, interests_BT, topics_BC)
    weights_BC, no_click = candidate_weights(interests_BT, topics_BC, env)
    return select_slate(weights_BC[0].numpy().astype(np.float64), q_BC[0].numpy().astype(np.float64), no_click,
                        env.slate_size, selection, float(no_click_q_B[0]))


def random_slate(num_candidates: int, slate_size: int, rng: np.random.Generator) -> tuple[int, ...]:
    """A uniformly random k-subset of the candidates, ascending."""
    return tuple(sorted(int(i) for i in rng.choice(num_candidates, slate_size, replace=False)))
