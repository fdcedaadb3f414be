"""The registry's slow-step option: same results, each step at least ``step_delay_s`` slower."""

from __future__ import annotations

import random
import time

import pytest
from pydantic import ValidationError

from producers.envs.registry import delay_steps, env_from_spec, make_env
from schemas.config import EnvSpec

DELAY_S = 0.03


def play(env, seed: int = 7, turns: int = 5) -> tuple[list[tuple], list[float]]:
    """(step results, seconds per step) of ``turns`` random answers from a fixed answer stream."""
    rng = random.Random(0)
    env.reset(seed)
    results, seconds = [], []
    for _ in range(turns):
        if env.done:
            break
        started = time.monotonic()
        step = env.step(env.random_answer(rng))
        seconds.append(time.monotonic() - started)
        results.append((step.observation, step.reward, step.terminated, step.truncated, step.info))
    return results, seconds


def test_delayed_env_is_slower_by_the_delay_and_otherwise_identical():
    plain, _ = play(make_env("cartpole"))
    slow, seconds = play(make_env("cartpole", step_delay_s=DELAY_S))
    assert slow == plain
    assert len(seconds) == 5 and min(seconds) >= DELAY_S


def test_env_from_spec_honours_overrides_and_delay():
    env = env_from_spec(EnvSpec(name="cartpole", overrides={"max_turns": 3}, step_delay_s=DELAY_S))
    assert env.config.max_turns == 3
    results, seconds = play(env, turns=10)
    assert len(results) <= 3 and min(seconds) >= DELAY_S


def test_no_delay_leaves_step_untouched():
    env = make_env("cartpole")
    assert "step" not in vars(env)  # the class's own method, not a wrapper


@pytest.mark.parametrize("delay_s", [-0.1, 61.0])
def test_delay_out_of_bounds_is_refused(delay_s):
    with pytest.raises(ValueError, match="step delay"):
        delay_steps(make_env("cartpole"), delay_s)
    with pytest.raises(ValidationError, match="step_delay_s"):
        EnvSpec(step_delay_s=delay_s)


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("cartpole", "left or right"),
        ("acrobot", "-1, 0 or +1"),
        ("sokoban", "Up, Down, Left or Right"),
        ("tetris", "Left, Right or Down"),
        ("recsim-interest-evolution", "distinct candidate numbers"),
        ("building-hvac", "supply-water setpoint (310-355 K)"),
    ],
)
def test_an_action_the_environment_does_not_know_is_named_with_what_it_would_take(name: str, says: str) -> None:
    env = make_env(name)
    env.reset(0)
    result = env.step("<answer>jump</answer>")
    assert not result.info["action_is_valid"] and result.info["format_error"] == ""
    assert result.info["rejected_action"] == "jump"
    assert says in env.action_help()
    ok = make_env(name)
    ok.reset(0)
    assert ok.step(ok.random_answer(random.Random(0))).info["rejected_action"] is None
