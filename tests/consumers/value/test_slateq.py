"""SlateQ's decomposition, slate selection and targets against hand-computed small cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from consumers.value.slateq import (
    SlateQAgent,
    SlateQConfig,
    SlateTransitions,
    all_slates,
    choice_weights,
    select_slate,
    select_slates,
    slate_value,
    slateq_targets,
)
from producers.envs.recsim import InterestEvolutionConfig, choice_probabilities
from schemas.value import SlateSpec

SMALL_ENV = InterestEvolutionConfig(num_topics=3, num_candidates=3, slate_size=2)


def test_choice_weights_match_the_environments_probabilities():
    weights, no_click = choice_weights([0.5, -0.5], SMALL_ENV)  # proportional: score + 1, no click 1 + 1
    assert weights.tolist() == [1.5, 0.5] and no_click == 2.0
    total = weights.sum() + no_click
    assert [*(weights / total), no_click / total] == pytest.approx(choice_probabilities([0.5, -0.5], SMALL_ENV))
    soft = SMALL_ENV.model_copy(update={"choice_model": "softmax"})
    weights, no_click = choice_weights([0.5, -0.5], soft)
    total = weights.sum() + no_click
    assert [*(weights / total), no_click / total] == pytest.approx(choice_probabilities([0.5, -0.5], soft))


def test_slate_value_is_the_choice_weighted_sum_of_item_values():
    # P = 1.5/4, 0.5/4 (no click 2/4 adds nothing): 0.375 * 10 + 0.125 * 4 = 4.25
    assert slate_value(np.array([1.5, 0.5]), np.array([10.0, 4.0]), 2.0) == pytest.approx(4.25)
    # With no click worth 3: (15 + 2 + 2 * 3) / 4
    assert slate_value(np.array([1.5, 0.5]), np.array([10.0, 4.0]), 2.0, 3.0) == pytest.approx(5.75)


def test_selection_optimal_greedy_and_topk():
    # Slates: {0,1} (19 + 0.19) / 5.8 = 3.309; {0,2} (19 + 0.01) / 4 = 4.7525; {1,2} 0.2 / 4 = 0.05.
    weights, q, no_click = np.array([1.9, 1.9, 0.1]), np.array([10.0, 0.1, 0.1]), 2.0
    assert select_slate(weights, q, no_click, 2, "optimal") == (0, 2)
    assert select_slate(weights, q, no_click, 2, "greedy") == (0, 2)
    assert select_slate(weights, q, no_click, 2, "topk") == (0, 1)  # largest v q, blind to the dilution
    with pytest.raises(ValueError, match="optimal, topk or greedy"):
        select_slate(weights, q, no_click, 2, "best")  # type: ignore[arg-type]


def _agent(td: str, no_click_value: float = 0.0) -> SlateQAgent:
    agent = SlateQAgent(SlateQConfig(gamma=0.9, td=td, target_update_period=10_000), SMALL_ENV)  # type: ignore[arg-type]
    linear = nn.Linear(6, 1)  # item value by topic alone: 10, 4, 8 (+ the bias, no click's value)
    with torch.no_grad():
        linear.weight.copy_(torch.tensor([[0.0, 0.0, 0.0, 10.0, 4.0, 8.0]]))
        linear.bias.fill_(no_click_value)
    agent.target = linear
    return agent


def _batch(bootstrap: float, clicked: int = 1) -> SlateTransitions:
    return SlateTransitions(
        interests_BT=np.zeros((1, 3)), topics_BC=np.array([[0, 1, 2]]), clicked_B=np.array([clicked]),
        reward_B=np.array([4.0]), bootstrap_B=np.array([bootstrap]),
        next_interests_BT=np.array([[0.5, -0.5, 0.0]]), next_topics_BC=np.array([[0, 1, 2]]),
        next_slate_BK=np.array([[0, 1]]),
    )


def test_q_learning_target_bootstraps_on_the_best_next_slate():
    # Next weights 1.5, 0.5, 1.0 and values 10, 4, 8: best slate {0,2} = (15 + 8) / 4.5.
    agent = _agent("q_learning")
    assert agent.next_values(_batch(0.9)).item() == pytest.approx(23 / 4.5, rel=1e-6)
    targets = slateq_targets(torch.tensor([4.0]), torch.tensor([0.9]), agent.next_values(_batch(0.9)))
    assert targets.item() == pytest.approx(4 + 0.9 * 23 / 4.5, rel=1e-6)


@pytest.mark.parametrize(
    ("selection", "next_interests", "topic_values", "expected"),
    [
        # Next weights 1.9, 1.9, 0.1 (no click 2, worth 0) and values 10, 0.1, 0.1:
        # {0,1} (19 + 0.19) / 5.8 = 3.3086, {0,2} (19 + 0.01) / 4 = 4.7525, {1,2} 0.2 / 4 = 0.05.
        ("optimal", [0.9, 0.9, -0.9], [10.0, 0.1, 0.1], 19.01 / 4),
        ("greedy", [0.9, 0.9, -0.9], [10.0, 0.1, 0.1], 19.01 / 4),  # item 0 first, then 2 (4.7525 > 3.3086)
        ("topk", [0.9, 0.9, -0.9], [10.0, 0.1, 0.1], 19.19 / 5.8),  # the two largest v q: {0,1}
        # Next weights 0.5, 0.5, 1.5 and values 8, 8, 4: {0,1} 8 / 3 = 2.667, {0,2} and {1,2} 10 / 4 = 2.5.
        ("optimal", [-0.5, -0.5, 0.5], [8.0, 8.0, 4.0], 8 / 3),
        ("greedy", [-0.5, -0.5, 0.5], [8.0, 8.0, 4.0], 2.5),  # item 2 alone is best (6 / 3.5), so {0,2}
        ("topk", [-0.5, -0.5, 0.5], [8.0, 8.0, 4.0], 2.5),  # v q = 4, 4, 6: {0,2}
    ],
)
def test_q_learning_target_bootstraps_on_the_slate_the_configured_selection_shows(
    selection, next_interests, topic_values, expected
):
    # As RecSim's SlateQ pairs them (top-k, greedy or optimal serving with the same target): the target is the
    # value of the slate the agent would show in s', so the values learned are those of the policy that acts.
    agent = SlateQAgent(SlateQConfig(selection=selection), SMALL_ENV)
    linear = nn.Linear(6, 1)
    with torch.no_grad():
        linear.weight.copy_(torch.tensor([[0.0, 0.0, 0.0, *topic_values]]))
        linear.bias.zero_()
    agent.target = linear
    batch = SlateTransitions(
        interests_BT=np.zeros((1, 3)), topics_BC=np.array([[0, 1, 2]]), clicked_B=np.array([0]),
        reward_B=np.array([1.0]), bootstrap_B=np.array([0.9]),
        next_interests_BT=np.array([next_interests]), next_topics_BC=np.array([[0, 1, 2]]),
        next_slate_BK=np.array([[0, 1]]),
    )
    assert agent.next_values(batch).item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("method", ["optimal", "topk", "greedy"])
def test_batched_selection_picks_the_slates_acting_picks(method):
    rng = np.random.default_rng(0)
    weights_BC = rng.uniform(0.0, 2.0, size=(200, 5))
    q_BC, no_click_q_B = rng.normal(5.0, 3.0, size=(200, 5)), rng.normal(2.0, 1.0, size=200)
    # in 20 rows candidates 1 and 3 are twins (same weight and value): ties, which both break towards the lowest index
    weights_BC[:20, 1], q_BC[:20, 1] = weights_BC[:20, 3], q_BC[:20, 3]
    picked_BK = select_slates(torch.as_tensor(weights_BC), torch.as_tensor(q_BC), 2.0, torch.as_tensor(no_click_q_B),
                              2, method, all_slates(5, 2))
    expected = [select_slate(w, q, 2.0, 2, method, float(q0))
                for w, q, q0 in zip(weights_BC, q_BC, no_click_q_B, strict=True)]
    assert [tuple(row) for row in picked_BK.tolist()] == expected
    twin_picked = [row for row in picked_BK[:20].tolist() if (1 in row) != (3 in row)]  # the tie decided the pick
    assert twin_picked and all(1 in row for row in twin_picked)


def test_topk_and_greedy_targets_serve_candidate_sets_too_large_to_enumerate():
    many = SlateSpec(num_topics=20, num_candidates=100, slate_size=10, selection="greedy")  # C(100, 10) = 1.7e13
    rng = np.random.default_rng(0)
    batch = SlateTransitions(
        interests_BT=rng.uniform(-1, 1, (4, 20)), topics_BC=rng.integers(0, 20, (4, 100)), clicked_B=np.full(4, -1),
        reward_B=np.ones(4), bootstrap_B=np.full(4, 0.9), next_interests_BT=rng.uniform(-1, 1, (4, 20)),
        next_topics_BC=rng.integers(0, 20, (4, 100)), next_slate_BK=np.zeros((4, 10), np.int64),
    )
    for selection in ("greedy", "topk"):
        agent = SlateQAgent(SlateQConfig(selection=selection, hidden_sizes=(8,)), many)
        assert agent.next_values(batch).shape == (4,)


def test_no_click_has_a_value_of_its_own_in_the_target():
    # Values 12, 6, 10, no click 2: {0,1} (18 + 3 + 4) / 4, {0,2} (18 + 10 + 4) / 4.5, {1,2} (3 + 10 + 4) / 3.5
    agent = _agent("q_learning", no_click_value=2.0)
    assert agent.next_values(_batch(0.9)).item() == pytest.approx(32 / 4.5, rel=1e-6)


def test_sarsa_target_bootstraps_on_the_slate_shown_next_and_stops_at_the_end():
    agent = _agent("sarsa")
    assert agent.next_values(_batch(0.9)).item() == pytest.approx(4.25, rel=1e-6)  # shown {0,1}
    assert slateq_targets(torch.tensor([4.0]), torch.tensor([0.0]), agent.next_values(_batch(0.0))).item() == 4.0


def test_train_step_moves_the_clicked_items_value_towards_the_target():
    agent = _agent("q_learning")
    batch = _batch(0.0)  # target 4 for the clicked candidate (topic 1)
    def values() -> tuple[float, float]:
        q_BC, no_click_q_B = agent.item_values(agent.online, torch.zeros(1, 3), torch.tensor([[0, 1, 2]]))
        return q_BC[0, 1].item(), no_click_q_B[0].item()

    before = values()[0]
    for _ in range(200):
        metrics = agent.train_step(batch)
    after = values()[0]
    assert abs(after - 4.0) < abs(before - 4.0) and after == pytest.approx(4.0, abs=0.1)
    assert set(metrics) == {"loss", "td_abs_mean", "q_mean", "grad_norm"}
    no_click = _batch(0.0, clicked=-1)  # no click, reward 4 here: the no-click value moves to 4
    for _ in range(300):
        agent.train_step(no_click)
    assert values()[1] == pytest.approx(4.0, abs=0.1)


def test_act_picks_the_optimal_slate_of_the_online_network():
    agent = _agent("q_learning")
    agent.online = agent.target
    assert agent.act([0.5, -0.5, 0.0], [0, 1, 2]) == (0, 2)
