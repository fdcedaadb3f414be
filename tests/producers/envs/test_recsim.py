"""RecSim interest evolution: documents, choice model, interest evolution, budget accounting.

Expected values are derived here from RecSim's published settings (20 clusters,
means linspace(-3, 0, 14) + linspace(0, 3, 6), no-click mass 1.0, min_normalizer
-1, step penalty 0.5, budget 200, user_update_alpha 0.9 / 3.4), not read back
from the environment.
"""

from __future__ import annotations

import math
import random
import statistics

import pytest

from producers.envs.evaluate import evaluate, run_episode
from producers.envs.recsim import (
    InterestEvolution,
    InterestEvolutionConfig,
    choice_probabilities,
    sample_choice,
)

ALPHA = 0.9 / 3.4
CHI2_DF2_P001 = 13.815510557964274  # chi-square critical value, 2 degrees of freedom, p = 0.001 (= -2 ln 0.001)


def expected_means():
    trashy = [-3 + 3 * i / 13 for i in range(14)]
    nutritious = [3 * i / 5 for i in range(6)]
    return trashy + nutritious


def proportional(scores):
    weights = [s + 1.0 for s in scores] + [2.0]  # scores and no-click mass 1.0, all minus (-1.0)
    return [w / sum(weights) for w in weights]


def pearson(counts, expected):
    return sum((c - e) ** 2 / e for c, e in zip(counts, expected, strict=True))


def test_documents_follow_the_cluster_model():
    env = InterestEvolution()
    env.reset(0)
    assert env.means == pytest.approx(expected_means())
    by_topic: dict[int, list[float]] = {}
    for _ in range(600):
        env._resample_candidates()
        assert len(env.candidates) == 5
        for doc in env.candidates:
            assert 0 <= doc.topic < 20 and doc.length == 4.0
            by_topic.setdefault(doc.topic, []).append(doc.quality)
    assert len(by_topic) == 20  # 3000 draws cover every cluster
    for topic, qualities in by_topic.items():
        assert statistics.fmean(qualities) == pytest.approx(expected_means()[topic], abs=0.06)
        assert statistics.stdev(qualities) == pytest.approx(0.1, abs=0.05)


def test_user_starts_with_uniform_interests_and_budget_200():
    env = InterestEvolution()
    env.reset(3)
    assert len(env.interests) == 20 and all(-1 <= x <= 1 for x in env.interests)
    assert env.budget == 200.0
    assert env.numeric_state()[20] == 200.0


def test_choice_probabilities_proportional_and_softmax():
    scores = [0.5, -0.8]
    assert choice_probabilities(scores, InterestEvolutionConfig()) == pytest.approx([1.5 / 3.7, 0.2 / 3.7, 2.0 / 3.7])
    soft = choice_probabilities(scores, InterestEvolutionConfig(choice_model="softmax"))
    z = math.exp(0.5) + math.exp(-0.8) + math.exp(1.0)
    assert soft == pytest.approx([math.exp(0.5) / z, math.exp(-0.8) / z, math.e / z])


@pytest.mark.parametrize("model", ["proportional", "softmax"])
def test_sampled_choices_match_probabilities_chi_square(model):
    cfg = InterestEvolutionConfig(choice_model=model)
    scores = [0.9, -0.4]
    if model == "proportional":
        probs = proportional(scores)
    else:
        z = math.exp(0.9) + math.exp(-0.4) + math.e
        probs = [math.exp(0.9) / z, math.exp(-0.4) / z, math.e / z]
    rng = random.Random(1234)
    n = 20_000
    counts = [0, 0, 0]
    for _ in range(n):
        slot = sample_choice(choice_probabilities(scores, cfg), rng)
        counts[2 if slot is None else slot] += 1
    assert pearson(counts, [p * n for p in probs]) < CHI2_DF2_P001


def test_env_clicks_match_choice_model_and_interest_flip_odds():
    """Through ``step``: click frequencies by slot vs the model's probabilities summed over steps.

    The user and candidates change every step, so the expected counts are sums of
    per-step probabilities (Pearson's statistic is then conservative).
    """
    n = 4000
    env = InterestEvolution(max_turns=n, max_actions_total=n, max_env_steps=n)
    env.reset(99)
    env.budget = 1e9  # keep the session alive
    counts, expected = [0, 0, 0], [0.0, 0.0, 0.0]
    towards, towards_expected, clicks = 0, 0.0, 0
    for _ in range(n):
        slate_topics = [env.candidates[0].topic, env.candidates[1].topic]
        before = list(env.interests)
        for k, p in enumerate(proportional([before[t] for t in slate_topics])):
            expected[k] += p
        env.step("<answer>1, 2</answer>")
        slot = int(env.step_records[-1]["features"]["click_position"])
        counts[2 if slot < 0 else slot] += 1
        if slot >= 0:
            topic = slate_topics[slot]
            x = before[topic]
            clicks += 1
            towards_expected += (x + 1) / 2
            moved = env.interests[topic] - x
            # |move| = alpha (1 - x) with alpha = 0.3 (1 - |x|); it never reaches the clip at +/-1 from inside.
            assert abs(moved) == pytest.approx(0.3 * (1 - abs(x)) * (1 - x), abs=1e-12)
            towards += moved > 0
            assert [v for i, v in enumerate(env.interests) if i != topic] == [
                v for i, v in enumerate(before) if i != topic
            ]
    assert pearson(counts, expected) < CHI2_DF2_P001
    # towards-moves ~ sum of Bernoulli((x+1)/2): z-test at 4 sigma (variance <= clicks / 4)
    assert abs(towards - towards_expected) < 4 * math.sqrt(clicks / 4)


def test_budget_accounting_over_an_episode():
    env = InterestEvolution()
    env.reset(5)
    rng = random.Random(0)
    budget = 200.0
    while not env.done:
        result = env.step(env.random_answer(rng))
        feats = env.step_records[-1]["features"]
        if feats["clicked"]:
            watch = min(budget, 4.0)
            assert feats["watch_time"] == pytest.approx(watch)
            assert result.reward == pytest.approx(watch)
            budget = budget - watch + ALPHA * watch * feats["click_quality"]
        else:
            assert result.reward == 0.0
            budget -= 0.5
        assert env.budget == pytest.approx(budget, abs=1e-9)
        assert result.terminated == (budget <= 0)
    assert result.terminated and budget <= 0
    assert env.step_records[-1]["is_terminal"]


def test_last_click_watches_only_the_remaining_budget():
    env = InterestEvolution()
    env.reset(1)
    env.budget = 1.5
    env.interests = [1.0] * 20  # proportional weights 2, 2 vs no-click 2: clicks are likely, retry until one
    for _ in range(50):
        before = env.budget
        result = env.step("<answer>1, 2</answer>")
        if env.step_records[-1]["features"]["clicked"]:
            assert result.reward == pytest.approx(min(before, 4.0))
            break
        assert env.budget == pytest.approx(before - 0.5)
        if env.done:
            break
    assert env.done or env.budget < 1.5


@pytest.mark.parametrize(
    ("text", "ok"),
    [("3, 1", True), ("1 2", True), ("[2, 4]", True), ("5,3", True), ("1, 1", False), ("0, 1", False),
     ("6, 1", False), ("2", False), ("1, 2, 3", False), ("a, b", False), ("-1, 2", False)],
)
def test_slate_parsing(text, ok):
    env = InterestEvolution()
    env.reset(0)
    assert (env._parse_action(text) is not None) is ok
    result = env.step(f"<answer>{text}</answer>")
    assert result.info["action_is_valid"] is ok
    if not ok:
        assert result.reward == pytest.approx(-0.1) and env.env_steps == 0


def test_render_lists_candidates_and_history():
    env = InterestEvolution()
    text = env.reset(2)
    for i, doc in enumerate(env.candidates):
        assert f"{i + 1}. topic {doc.topic} (user interest {env.interests[doc.topic]:+.2f}" in text
    env.step("<answer>1, 2</answer>")
    text = env.observation()
    assert "step 1:" in text and ("clicked topic" in text or "no click" in text)
    hidden = InterestEvolution(show_interests=False)
    assert "interest" not in hidden.reset(2).split("Candidates:")[1]


def test_same_seed_same_episode():
    def episode(seed):
        env = InterestEvolution()
        obs = []
        run_episode(env, lambda e: e.heuristic_answer(), seed, on_step=lambda e, a, r: obs.append(r.observation))
        return obs, env.episode_return

    assert episode(4) == episode(4)
    assert episode(4) != episode(5)


def test_heuristic_beats_random():
    heuristic = evaluate("recsim-interest-evolution", "heuristic", 20, seed_start=0)
    rand = evaluate("recsim-interest-evolution", "random", 20, seed_start=0)
    assert heuristic.mean_return - heuristic.ci95 > rand.mean_return + rand.ci95


@pytest.mark.parametrize(
    "overrides", [{"slate_size": 6}, {"min_normalizer": -0.5}, {"no_click_mass": -2.0}, {"num_candidates": 0}]
)
def test_config_rejects_unrunnable_settings(overrides):
    with pytest.raises(ValueError):
        InterestEvolutionConfig(**overrides)


def test_a_longer_truncation_cap_alone_raises_the_turn_and_slate_limits():
    config = InterestEvolutionConfig(max_env_steps=800)
    assert (config.max_turns, config.max_actions_total) == (800, 800)
    assert InterestEvolutionConfig(max_env_steps=800, max_turns=30).max_turns == 30
