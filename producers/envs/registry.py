"""Environments registered by name, each with its default configuration."""

from __future__ import annotations

import importlib
import time
from typing import Any

from producers.envs.base import EnvConfig, StepResult, TextEnv
from schemas.config import EnvSpec

# name -> "module:Class"; modules import lazily so one slow import doesn't tax the rest.
_REGISTRY: dict[str, str] = {
    "sokoban": "producers.envs.sokoban:Sokoban",
    "sokoban-large": "producers.envs.sokoban:SokobanLarge",
    "tetris": "producers.envs.tetris:Tetris",
    "recsim-interest-evolution": "producers.envs.recsim:InterestEvolution",
    "building-hvac": "producers.envs.building:BuildingHVAC",
    "cartpole": "producers.envs.classic:CartPole",
    "cartpole-v1": "producers.envs.classic:CartPoleV1",
    "acrobot": "producers.envs.classic:Acrobot",
    "text2sql": "producers.envs.text2sql:TextToSQL",
}


def env_names() -> list[str]:
    """All registered environment names."""
    return sorted(_REGISTRY)


def env_class(name: str) -> type[TextEnv]:
    """The class registered under ``name``; a clear error names the choices."""
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown environment {name!r}; choose one of: {', '.join(env_names())}") from None
    module_name, class_name = target.split(":")
    return getattr(importlib.import_module(module_name), class_name)


def make_env(name: str, overrides: dict[str, Any] | None = None, step_delay_s: float = 0.0) -> TextEnv:
    """Build environment ``name`` with its defaults updated by ``overrides`` (validated).

    ``step_delay_s`` > 0 makes every ``step`` that much slower (see ``delay_steps``).
    """
    cls = env_class(name)
    config: EnvConfig = cls.Config.model_validate(overrides or {})
    env = cls(config)
    return delay_steps(env, step_delay_s) if step_delay_s else env


def env_from_spec(spec: EnvSpec) -> TextEnv:
    """The environment a run configuration's ``env`` section names, slow step included."""
    return make_env(spec.name, spec.overrides, spec.step_delay_s)


def held_out_spec(spec: EnvSpec) -> EnvSpec:
    """``spec`` as held-out evaluation plays it: the environment's ``held_out_overrides`` of the run's overrides."""
    overrides = env_class(spec.name).held_out_overrides(spec.overrides)
    return spec.model_copy(update={"overrides": overrides})


def held_out_env(spec: EnvSpec) -> TextEnv:
    """The environment every held-out evaluation plays (language-model and value runs alike): ``held_out_spec``."""
    return env_from_spec(held_out_spec(spec))


def delay_steps(env: TextEnv, delay_s: float) -> TextEnv:
    """Make each ``env.step`` sleep ``delay_s`` seconds before stepping; returns ``env`` itself.

    It stands in for a slow step (a remote reward service, a database query) so
    benchmarks see realistic latency with a local simulation.  Results are
    unchanged.  The instance's ``step`` is replaced rather than the environment
    wrapped, so everything else the worker reads (``config``, ``per_turn_prompts``,
    step records) stays the environment's own.
    """
    if not 0.0 <= delay_s <= 60.0:
        raise ValueError(f"step delay must be within [0, 60] seconds, got {delay_s!r}")
    step = env.step

    def delayed_step(answer_text: str) -> StepResult:
        time.sleep(delay_s)  # sleeping releases the GIL, as waiting on a remote service would
        return step(answer_text)

    env.step = delayed_step  # type: ignore[method-assign]
    return env
