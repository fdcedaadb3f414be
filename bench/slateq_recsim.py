"""SlateQ on RecSim interest evolution against the myopic and random recommenders, on held-out users.

1. per agent seed (``--seeds``): SlateQ (``consumers.value.slateq``) learns online for
   ``--episodes`` training sessions (users seeded 1,000,000 + 10,000 x seed + episode, never
   evaluated): epsilon-greedy slates (epsilon 1 -> ``--epsilon-end`` linearly over the first
   half), every step (clicked or not) into a bounded replay memory, ``--updates`` updates
   per environment step once ``--batch`` steps are stored;
2. ``--users`` held-out users (seeds 0..users-1) each play one session with
   - SlateQ: the optimal slate of the learned item values (no exploration),
   - myopic: the slate with the most expected immediate engagement (every item's value =
     its watch time, so the highest-interest items),
   - random: uniformly random slates (one generator per agent seed);
   the same user seed starts from the same interests and candidates for every recommender.
Engagement per session = minutes watched (the episode return).  Prints a markdown table for
docs/value.md: mean engagement with its 95% CI over users x seeds, per-seed means, and the
paired differences (same user, same seed) of SlateQ against each baseline.

Run: nice .venv/bin/python bench/slateq_recsim.py [--seeds 3] [--episodes 300] [--users 100]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from bench.cpu import LoadAverage
from bench.options import positive_int
from consumers.value.slateq import SlateQAgent, SlateQConfig, SlateTransitions, choice_weights, select_slate
from producers.envs.parsing import format_answer
from producers.envs.recsim import InterestEvolution, InterestEvolutionConfig
from schemas.evaluation import mean_ci95, paired_difference

Policy = Callable[[InterestEvolution], tuple[int, ...]]
TRAIN_SEED_BASE = 1_000_000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=positive_int, default=3,
                        help="Agent seeds (networks, exploration, training users).")
    parser.add_argument("--episodes", type=positive_int, default=300, help="Training sessions per seed.")
    parser.add_argument("--users", type=positive_int, default=100, help="Held-out users (seeds 0..users-1).")
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--td", choices=["q_learning", "sarsa"], default="q_learning")
    parser.add_argument("--selection", choices=["optimal", "topk", "greedy"], default="optimal")
    parser.add_argument("--batch", type=positive_int, default=64)
    parser.add_argument("--updates", type=float, default=1.0, help="Updates per environment step.")
    parser.add_argument("--capacity", type=positive_int, default=20_000, help="Replay memory (steps).")
    parser.add_argument("--epsilon-end", type=float, default=0.05)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--target-period", type=positive_int, default=100)
    parser.add_argument("--threads", type=positive_int, default=1)
    return parser.parse_args(argv)


def interests(env: InterestEvolution) -> list[float]:
    """What RecSim shows of the user: the interest per topic (the time budget stays hidden)."""
    return list(env.interests)


def topics(env: InterestEvolution) -> list[int]:
    return [d.topic for d in env.candidates]


def play(env: InterestEvolution, seed: int, policy: Policy, on_step: Callable[..., None] | None = None) -> float:
    """One session for user ``seed``; ``on_step(before, slate, reward, clicked_slot, done)`` sees every step."""
    env.reset(seed)
    while not env.done:
        before = (interests(env), topics(env))
        slate = policy(env)
        result = env.step(format_answer([", ".join(str(i + 1) for i in slate)]))
        if on_step is not None:
            response = env.last_response
            clicked = slate[response.position] if response and response.clicked else -1
            on_step(before, slate, result.reward, clicked, result.terminated, result.truncated)
    return env.episode_return


def myopic_policy(config: InterestEvolutionConfig) -> Policy:
    """Most expected immediate engagement: every item is worth its watch time, so interest decides."""
    def act(env: InterestEvolution) -> tuple[int, ...]:
        weights, no_click = choice_weights([env.interests[t] for t in topics(env)], config)
        lengths = np.array([d.length for d in env.candidates])
        return select_slate(weights, lengths, no_click, config.slate_size, "optimal")
    return act


def random_policy(config: InterestEvolutionConfig, seed: int) -> Policy:
    rng = random.Random(seed)
    return lambda env: tuple(sorted(rng.sample(range(config.num_candidates), config.slate_size)))


class Trainer:
    """Online SlateQ: epsilon-greedy play, a bounded replay memory of steps, updates per step."""

    def __init__(self, agent: SlateQAgent, args: argparse.Namespace, seed: int) -> None:
        self.agent, self.args = agent, args
        self.rng = np.random.default_rng(seed)
        self.memory: deque[tuple] = deque(maxlen=args.capacity)
        self.pending: tuple | None = None  # the last clicked step, waiting for its next state
        self.steps = 0
        self.credit = 0.0
        self.epsilon = 1.0
        self.metrics: dict[str, float] = {}

    def act(self, env: InterestEvolution) -> tuple[int, ...]:
        size = self.agent.env.slate_size
        if self.rng.random() < self.epsilon:
            return tuple(sorted(int(i) for i in self.rng.choice(len(env.candidates), size, replace=False)))
        return self.agent.act(interests(env), topics(env))

    def observe(self, before, slate, reward, clicked, terminated, truncated) -> None:
        """Close the pending step with this state and slate; this step waits for the next one (or ends)."""
        if self.pending is not None:
            self.memory.append((*self.pending, self.args.gamma, before[0], before[1], slate))
        step = (before[0], before[1], clicked, reward)
        self.pending = None if terminated or truncated else step
        if terminated:
            self.memory.append((*step, 0.0, before[0], before[1], slate))
        self.steps += 1
        self.credit += self.args.updates
        while self.credit >= 1.0 and len(self.memory) >= self.args.batch:
            self.credit -= 1.0
            self.metrics = self.agent.train_step(self.sample())

    def sample(self) -> SlateTransitions:
        rows = [self.memory[i] for i in self.rng.integers(len(self.memory), size=self.args.batch)]
        columns = list(zip(*rows, strict=True))
        return SlateTransitions(
            interests_BT=np.array(columns[0]), topics_BC=np.array(columns[1]), clicked_B=np.array(columns[2]),
            reward_B=np.array(columns[3]), bootstrap_B=np.array(columns[4]), next_interests_BT=np.array(columns[5]),
            next_topics_BC=np.array(columns[6]), next_slate_BK=np.array(columns[7]),
        )

    def train(self, env: InterestEvolution, seed: int) -> list[float]:
        returns = []
        for episode in range(self.args.episodes):
            fraction = min(1.0, episode / max(1, self.args.episodes // 2))
            self.epsilon = 1.0 + (self.args.epsilon_end - 1.0) * fraction
            returns.append(play(env, TRAIN_SEED_BASE + 10_000 * seed + episode, self.act, self.observe))
        return returns


def run_seed(config: InterestEvolutionConfig, args: argparse.Namespace, seed: int) -> dict[str, list[float]]:
    env = InterestEvolution(config)
    agent = SlateQAgent(SlateQConfig(gamma=args.gamma, learning_rate=args.lr, batch_size=args.batch,
                                     target_update_period=args.target_period, selection=args.selection,
                                     td=args.td, seed=seed), config)
    trainer = Trainer(agent, args, seed)
    started = time.monotonic()
    train_returns = trainer.train(env, seed)
    seconds = time.monotonic() - started
    users = range(args.users)
    slateq = [play(env, u, lambda e: agent.act(interests(e), topics(e))) for u in users]
    myopic = [play(env, u, myopic_policy(config)) for u in users]
    randomly = random_policy(config, seed)
    random_returns = [play(env, u, randomly) for u in users]
    last = train_returns[-max(1, args.episodes // 10):]
    print(f"seed {seed}: {trainer.steps} env steps, {agent.steps} updates, {seconds:.0f} s; "
          f"training return (last 10%) {statistics.fmean(last):.1f}; held-out SlateQ {statistics.fmean(slateq):.1f} "
          f"myopic {statistics.fmean(myopic):.1f} random {statistics.fmean(random_returns):.1f}; "
          f"last |TD| {trainer.metrics.get('td_abs_mean', 0.0):.2f} Q {trainer.metrics.get('q_mean', 0.0):.1f}",
          flush=True)
    return {"slateq": slateq, "myopic": myopic, "random": random_returns}


def print_table(by_seed: dict[int, dict[str, list[float]]], args: argparse.Namespace) -> None:
    print(f"\n| recommender | engagement per session (min, mean +/- 95% CI over {args.users} users x "
          f"{len(by_seed)} seeds) | per-seed means |")
    print("| --- | --- | --- |")
    for name in ("slateq", "myopic", "random"):
        mean, ci = mean_ci95([r for runs in by_seed.values() for r in runs[name]])
        per_seed = ", ".join(f"{statistics.fmean(runs[name]):.1f}" for runs in by_seed.values())
        print(f"| {name} | {mean:.1f} +/- {ci:.1f} | {per_seed} |")
    print("\n| SlateQ minus | paired difference (same user, same seed) | CI above 0 | seeds where SlateQ's mean is higher |")
    print("| --- | --- | --- | --- |")
    for name in ("myopic", "random"):
        diff = paired_difference({s: r["slateq"] for s, r in by_seed.items()}, {s: r[name] for s, r in by_seed.items()})
        wins = sum(statistics.fmean(r["slateq"]) > statistics.fmean(r[name]) for r in by_seed.values())
        print(f"| {name} | {diff['mean']:+.1f} +/- {diff['ci95']:.1f} ({diff['pairs']} pairs) | {diff['above']} "
              f"| {wins} of {len(by_seed)} |")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    config = InterestEvolutionConfig()
    with LoadAverage() as load:
        by_seed = {seed: run_seed(config, args, seed) for seed in range(args.seeds)}
    print_table(by_seed, args)
    print(f"\n{load}")


if __name__ == "__main__":
    main()
