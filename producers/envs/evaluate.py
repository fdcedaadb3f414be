"""Run scripted policies against environments and summarise the returns.

Pure and reusable: the ``envs eval`` command, smoke tests and baselines all call
``run_episode`` / ``evaluate``; printing lives in the CLI.  A policy is any
function from the environment (in its current state) to an answer text, so the
heuristic, random and human (stdin) policies share one loop.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from producers.envs.base import StepResult, TextEnv
from producers.envs.registry import make_env

Policy = Callable[[TextEnv], str]
PolicyName = Literal["heuristic", "random"]
OnStep = Callable[[TextEnv, str, StepResult], None]
OnReset = Callable[[TextEnv, str], None]
Z_95 = 1.959963984540054  # two-sided 95% normal quantile


@dataclass(frozen=True)
class EpisodeResult:
    """One episode's outcome."""

    seed: int
    episode_return: float
    turns: int
    env_steps: int
    success: bool
    terminated: bool
    truncated: bool
    invalid_turns: int
    seconds: float


@dataclass(frozen=True)
class EvalSummary:
    """Returns of ``episodes`` episodes (seeds ``seed_start`` ...) of one policy on one environment."""

    env: str
    policy: str
    episodes: int
    seed_start: int
    mean_return: float
    ci95: float  # half-width of the normal-approximation 95% interval of the mean
    std_return: float
    min_return: float
    max_return: float
    success_rate: float
    mean_env_steps: float
    env_steps_per_second: float
    results: list[EpisodeResult] = field(default_factory=list, repr=False)

    def to_dict(self, with_episodes: bool = False) -> dict[str, Any]:
        """JSON-ready summary (episodes included on request)."""
        data = asdict(self)
        if not with_episodes:
            data.pop("results")
        return data


def heuristic_policy(env: TextEnv) -> str:
    """The environment's own scripted policy."""
    return env.heuristic_answer()


def random_policy(seed: int) -> Policy:
    """Uniformly random valid answers from a generator of its own (the env's RNG stays untouched)."""
    rng = random.Random(f"random-policy:{seed}")
    return lambda env: env.random_answer(rng)


def make_policy(name: str, seed: int) -> Policy:
    """A named scripted policy for episode ``seed``."""
    if name == "heuristic":
        return heuristic_policy
    if name == "random":
        return random_policy(seed)
    raise ValueError(f"unknown policy {name!r}; choose heuristic or random")


def run_episode(
    env: TextEnv,
    policy: Policy,
    seed: int,
    on_step: OnStep | None = None,
    on_reset: OnReset | None = None,
) -> EpisodeResult:
    """Reset to ``seed`` and let ``policy`` answer until the episode ends.

    ``on_reset`` sees the first observation and ``on_step`` each turn (answer and result),
    so a caller can display an episode without a loop of its own.
    """
    start = time.perf_counter()
    first_observation = env.reset(seed)
    if on_reset is not None:
        on_reset(env, first_observation)
    invalid = 0
    result: StepResult | None = None
    while not env.done:
        answer = policy(env)
        result = env.step(answer)
        invalid += not result.info["action_is_valid"]
        if on_step is not None:
            on_step(env, answer, result)
    assert result is not None  # every episode takes at least one turn
    return EpisodeResult(
        seed=seed,
        episode_return=env.episode_return,
        turns=env.turn,
        env_steps=env.env_steps,
        success=bool(result.info["success"]),
        terminated=result.terminated,
        truncated=result.truncated,
        invalid_turns=invalid,
        seconds=time.perf_counter() - start,
    )


def summarise(env_name: str, policy: str, seed_start: int, results: list[EpisodeResult]) -> EvalSummary:
    """Mean return with a 95% interval (normal approximation, sample std), success rate, speed."""
    if not results:
        raise ValueError("no episodes to summarise; run at least one")
    returns = [r.episode_return for r in results]
    std = statistics.stdev(returns) if len(returns) > 1 else 0.0
    steps = sum(r.env_steps for r in results)
    seconds = sum(r.seconds for r in results)
    return EvalSummary(
        env=env_name,
        policy=policy,
        episodes=len(results),
        seed_start=seed_start,
        mean_return=statistics.fmean(returns),
        ci95=Z_95 * std / math.sqrt(len(returns)),
        std_return=std,
        min_return=min(returns),
        max_return=max(returns),
        success_rate=sum(r.success for r in results) / len(results),
        mean_env_steps=steps / len(results),
        env_steps_per_second=steps / seconds if seconds > 0 else float("inf"),
        results=results,
    )


def evaluate(
    name: str,
    policy: PolicyName | str,
    episodes: int,
    seed_start: int = 0,
    overrides: dict[str, Any] | None = None,
) -> EvalSummary:
    """Run ``episodes`` episodes of a named policy on seeds ``seed_start, seed_start + 1, ...``."""
    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    make_policy(policy, seed_start)  # fail fast on a bad policy name
    env = make_env(name, overrides)
    results = [run_episode(env, make_policy(policy, seed), seed) for seed in range(seed_start, seed_start + episodes)]
    return summarise(name, policy, seed_start, results)
