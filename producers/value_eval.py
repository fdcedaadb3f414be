"""Evaluate a value-network version on held-out seeds: greedy play, one episode per seed.

``rlpipe eval --run RUN`` of a value run (``RunConfig.value``) lands here instead
of the language-model rollout: the version is pulled from the registry (kind
``value-network``, digests verified), and each held-out seed (from
``env.eval_seed_offset``, never a training seed) is played with argmax_a Q(s, a), on the
environment as every held-out evaluation plays it (``held_out_env``).
Version 0 (nothing trained yet) is the uniform random policy.  A SlateQ version
(agent ``slateq``) recommends its best slate each step (``play_slates``; version 0
random slates), and the return is the session's engagement (RecSim: minutes watched).  The result is the
same ``EvalResult`` the report reads for language-model runs (policy
``value-network``).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from pipeline.slate_network import best_slate, random_slate
from pipeline.value_network import NetworkSpec, load_network
from producers.envs.base import TextEnv
from producers.envs.registry import held_out_env
from producers.slate_actor import check_slate_environment, slate_answer
from schemas.config import RunConfig
from schemas.evaluation import EvalResult

POLICY = "value-network"


def play_greedy(env: TextEnv, network: nn.Module | None, seed: int, rng: np.random.Generator) -> tuple[float, bool]:
    """One episode with argmax_a Q(s, a) (uniform actions when ``network`` is None): (return, success)."""
    choices = env.answer_choices() or []
    env.reset(seed)
    success = False
    while not env.done:
        if network is None:
            action = int(rng.integers(len(choices)))
        else:
            with torch.no_grad():
                observation = torch.as_tensor(env.numeric_state(), dtype=torch.float32).view(1, -1)
                action = int(network.q_values(observation)[0].argmax())
        success = bool(env.step(choices[action]).info.get("success"))
    return float(env.episode_return), success


def play_slates(env: TextEnv, network: nn.Module | None, spec: NetworkSpec | None, seed: int,
                rng: np.random.Generator) -> tuple[float, bool]:
    """One session with the version's best slate each step (random slates when ``network`` is None)."""
    env.reset(seed)
    config: Any = env.config
    while not env.done:
        if network is None or spec is None or spec.slate is None:
            slate = random_slate(config.num_candidates, config.slate_size, rng)
        else:
            slate = best_slate(network, spec.slate, spec.slate.selection, env.numeric_state())
        env.step(slate_answer(slate))
    return float(env.episode_return), False


def check_version_fits(spec: NetworkSpec, env: TextEnv, version: int) -> None:
    """Refuse a version whose network cannot play ``env`` (``rlpipe eval --env`` naming an environment of another
    shape), before any episode."""
    if spec.slate is not None:
        check_slate_environment(env, spec.observation_size, spec.slate)
        return
    env.reset(0)
    shape = (len(env.numeric_state()), len(env.answer_choices() or []))
    if shape != (spec.observation_size, spec.num_actions):
        raise ValueError(f"value-network v{version} reads {spec.observation_size} observation values and scores "
                         f"{spec.num_actions} actions, environment {env.name} has {shape[0]} and {shape[1]}; "
                         "evaluate it on its run's environment (leave out --env)")


def evaluate_value_version(config: RunConfig, store: ObjectStore, version: int, episodes: int) -> EvalResult:
    """Play ``episodes`` held-out seeds greedily with value-network ``version`` (0: uniform random)."""
    network, spec = None, None
    cache = Path(tempfile.mkdtemp(prefix="rlpipe-value-eval-"))
    try:
        if version:
            spec, network = load_network(AdapterRegistry(store, config.run_id).pull(version, cache, kind="value-network"))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    env, rng = held_out_env(config.env), np.random.default_rng(0)
    if spec is not None:
        check_version_fits(spec, env, version)
    seeds = range(config.env.eval_seed_offset, config.env.eval_seed_offset + episodes)
    if config.value is not None and config.value.slate is not None:
        outcomes = [play_slates(env, network, spec, seed, rng) for seed in seeds]
    else:
        outcomes = [play_greedy(env, network, seed, rng) for seed in seeds]
    return EvalResult.from_episodes(
        run_id=config.run_id, env=config.env.name, version=version, seed_start=config.env.eval_seed_offset,
        returns=[r for r, _ in outcomes], successes=[s for _, s in outcomes], policy=POLICY,
    )
