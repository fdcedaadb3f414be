"""The CartPole SDK loop's own pieces (``examples/tinker_cartpole.py``): its environment and advantage estimates.

The loop itself runs against a real server in ``tests/integration/test_tinker_sampling.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.examples import example_module


@pytest.fixture(scope="module")
def loop():
    with example_module("tinker_cartpole") as module:
        yield module


def test_gae_on_a_hand_computed_episode(loop):
    # deltas: 1 + 0.9*1 - 2 = -0.1, 1 + 0.9*0.5 - 1 = 0.45, 1 + 0 - 0.5 = 0.5 (the episode ended: no future)
    assert loop.gae([1, 1, 1], [2, 1, 0.5], 0.0, 0.9, 0.5) == pytest.approx([-0.1 + 0.45 * 0.675, 0.675, 0.5])
    # lambda 1: the discounted return-to-go minus the baseline (2.71 - 2, 1.9 - 1, 1 - 0.5)
    assert loop.gae([1, 1, 1], [2, 1, 0.5], 0.0, 0.9, 1.0) == pytest.approx([0.71, 0.9, 0.5])
    # cut at the step limit: the last state's baseline stands in for the future
    assert loop.gae([1], [2], 3.0, 0.9, 0.5) == pytest.approx([1 + 0.9 * 3 - 2])


def test_the_value_baseline_recovers_a_quadratic_function_of_the_state(loop):
    states = np.random.default_rng(0).normal(0, 0.5, (400, 4)) * loop.STATE_SCALE
    truth = 3 + states[:, 2] * 20 - (states[:, 2] / loop.STATE_SCALE[2] + states[:, 3] / 2) ** 2
    weights = loop.fit_value(states, truth, ridge=1e-8)
    assert loop.features(states) @ weights == pytest.approx(truth, abs=1e-5)


def play(loop, seed: int, agree: float, rng: np.random.Generator):
    """One CartPole episode of a policy that pushes as the heuristic with probability ``agree``."""
    env, episode, right = loop.CartPole(seed, 200), loop.Episode(), []
    while not env.done:
        best, state = env.heuristic(), env.state.copy()
        action = best if rng.random() < agree else 1 - best
        episode.turns.append(loop.Turn([], [1], [0.0], env.step(action), state))
        right.append(action == best)
    episode.cut, episode.last_state = not env.fell, env.state.copy()
    return episode, right


def test_gae_tells_right_pushes_from_wrong_ones_better_than_the_return_to_go(loop):
    """What ``--advantage gae`` is for: a turn's advantage follows whether its push was right.

    With the warm start's policy (the heuristic's push 62% of the time), the discounted
    return-to-go mostly says how far the episode is from its end; judged against a
    baseline of the state, a push is scored by the state it leads to.
    """
    rng, history = np.random.default_rng(1), []
    by_return, by_gae = [], []
    for step in range(6):
        played = [play(loop, 1_000 * step + i, 0.62, rng) for i in range(8)]
        to_go = [e.returns_to_go(0.9) for e, _ in played]
        history = [*history, (np.array([t.state for e, _ in played for t in e.turns]), np.concatenate(to_go))][-3:]
        weights = loop.fit_value(np.concatenate([s for s, _ in history]), np.concatenate([g for _, g in history]))
        advantages = [loop.gae([t.reward for t in e.turns], list(loop.features(np.array([t.state for t in e.turns]))
                                                                 @ weights), 0.0, 0.9, 0.5) for e, _ in played]
        right = np.concatenate([r for _, r in played]).astype(float)
        by_return.append(np.corrcoef(np.concatenate(to_go), right)[0, 1])
        by_gae.append(np.corrcoef(np.concatenate(advantages), right)[0, 1])
    assert np.mean(by_return) < 0.25 < 0.4 < np.mean(by_gae)


def test_a_long_steps_turns_are_subsampled_uniformly_and_short_ones_kept_whole(loop):
    rng = np.random.default_rng(0)
    assert loop.train_subset(300, 512, rng).tolist() == list(range(300))
    picked = loop.train_subset(1500, 512, rng)
    assert len(picked) == 512 == len(set(picked.tolist())) and picked.tolist() == sorted(picked.tolist())
    assert picked.min() >= 0 and picked.max() < 1500
    # uniform: over many draws every turn is picked about 512 / 1500 of the time, the last ones too
    counts = np.zeros(1500)
    for _ in range(200):
        counts[loop.train_subset(1500, 512, rng)] += 1
    assert abs(counts[:500].mean() - counts[-500:].mean()) < 5 and abs(counts.mean() / 200 - 512 / 1500) < 1e-9


def test_an_answer_without_an_action_costs_the_penalty_and_a_turn_and_leaves_the_cart(loop):
    """As in rlpipe's environments: the same state again, -0.1, and it counts towards the turn limit."""
    env = loop.CartPole(3, 4)
    before = env.state.copy()
    assert env.skip() == pytest.approx(-0.1) and not env.done
    assert np.array_equal(env.state, before) and (env.steps, env.turns) == (0, 1)
    env.step(1)
    env.skip()
    assert not env.done and (env.steps, env.turns) == (1, 3)
    env.step(0)
    assert env.done and not env.fell and (env.steps, env.turns) == (2, 4)  # the turn limit, not a fall
    assert loop.parse_action("<answer>up</answer>") is None and loop.parse_action("<answer> Left </answer>") == 0
