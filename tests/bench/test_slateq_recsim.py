"""The SlateQ benchmark's parts: transitions from play, the baselines, and a tiny end-to-end run."""

from __future__ import annotations

import argparse

from bench.slateq_recsim import Trainer, myopic_policy, play, random_policy, run_seed
from consumers.value.slateq import SlateQAgent, SlateQConfig
from producers.envs.recsim import InterestEvolution, InterestEvolutionConfig

CONFIG = InterestEvolutionConfig()


def _args(**changes) -> argparse.Namespace:  # type: ignore[no-untyped-def]
    values = dict(seeds=1, episodes=2, users=2, gamma=0.9, td="q_learning", selection="optimal", batch=8, updates=0.5,
                  capacity=1_000, epsilon_end=0.05, lr=1e-3, target_period=10, threads=1)
    return argparse.Namespace(**{**values, **changes})


def test_every_step_becomes_one_transition_and_the_terminal_one_does_not_bootstrap() -> None:
    env = InterestEvolution(CONFIG)
    trainer = Trainer(SlateQAgent(SlateQConfig(), CONFIG), _args(batch=10_000), seed=0)
    steps = []
    play(env, 3, trainer.act, lambda *step: (steps.append(step), trainer.observe(*step)))
    assert steps[-1][4] and len(trainer.memory) == len(steps)  # the budget ran out: terminated
    assert [row[4] for row in trainer.memory][-1] == 0.0 and all(row[4] == 0.9 for row in list(trainer.memory)[:-1])
    clicked = [row[2] for row in trainer.memory]
    assert -1 in clicked and any(c >= 0 for c in clicked)  # unclicked steps train the no-click value


def test_myopic_picks_the_highest_interest_candidates_and_random_is_seeded() -> None:
    env = InterestEvolution(CONFIG)
    env.reset(5)
    slate = myopic_policy(CONFIG)(env)
    ranked = sorted(range(len(env.candidates)), key=lambda i: -env.interests[env.candidates[i].topic])
    assert sorted(env.interests[env.candidates[i].topic] for i in slate) == sorted(
        env.interests[env.candidates[i].topic] for i in ranked[: CONFIG.slate_size])
    assert random_policy(CONFIG, 1)(env) == random_policy(CONFIG, 1)(env)


def test_a_tiny_run_returns_per_user_engagement_for_each_recommender() -> None:
    result = run_seed(CONFIG, _args(), seed=0)
    assert set(result) == {"slateq", "myopic", "random"} and all(len(v) == 2 for v in result.values())
    assert all(r > 0 for runs in result.values() for r in runs)
