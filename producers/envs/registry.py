"""Environments registered by name, each with its default configuration."""

from __future__ import annotations

import importlib
from typing import Any

from producers.envs.base import EnvConfig, TextEnv

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


def make_env(name: str, overrides: dict[str, Any] | None = None) -> TextEnv:
    """Build environment ``name`` with its defaults updated by ``overrides`` (validated)."""
    cls = env_class(name)
    config: EnvConfig = cls.Config.model_validate(overrides or {})
    return cls(config)
