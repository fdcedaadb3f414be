"""Slate actors and slate eval: a slate per step, epsilon-greedy on the newest published item-value network."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from pipeline.config import resolve_config
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from pipeline.runtime import create_run
from pipeline.slate_network import best_slate
from pipeline.value_network import NetworkSpec, build_from_spec, network_files
from producers.envs.recsim import InterestEvolution
from producers.eval_cli import app as eval_app
from producers.slate_actor import SlateActor, check_slate_environment
from producers.value_actor import EPSILON_FEATURE, VERSION_FEATURE, ValueNetworkWatcher
from producers.value_eval import evaluate_value_version
from schemas.steps import check_steps_table
from schemas.value import SlateSpec, ValueActorConfig, ValueRunConfig

SLATE = SlateSpec()
SPEC = NetworkSpec(agent="slateq", observation_size=26, num_actions=5, hidden_sizes=(8,), slate=SLATE)


def publish_favouring(registry: AdapterRegistry, topic: int) -> torch.nn.Module:
    """Publish an item-value network worth 10 for items of ``topic``, 0 for every other item and no click."""
    network = build_from_spec(SPEC)
    with torch.no_grad():
        for layer in network.layers:
            if isinstance(layer, torch.nn.Linear):
                layer.weight.zero_()
                layer.bias.zero_()
        network.layers[0].weight[0, 20 + topic] = 1.0  # hidden unit 0 = one-hot of the topic
        network.layers[-1].weight[0, 0] = 10.0
    registry.publish_files(network_files(SPEC, network), "slateq:recsim-interest-evolution",
                           len(registry.versions()), 1, kind="value-network")
    return network


def make_actor(store: ObjectStore, tmp_path: Path, **config) -> SlateActor:  # type: ignore[no-untyped-def]
    watcher = ValueNetworkWatcher(AdapterRegistry(store, "srun"), tmp_path / "cache", poll_s=0.0)
    return SlateActor(run_id="srun", actor_id="a0", env=InterestEvolution(), archive=TrajectoryArchive(store),
                      watcher=watcher, config=ValueActorConfig(**config))


def test_before_a_version_a_slate_actor_writes_random_slates_as_a_steps_batch(memory_store, tmp_path) -> None:
    actor = make_actor(memory_store, tmp_path, steps_per_batch=100)
    event = actor.write_batch()
    table = TrajectoryArchive(memory_store).read_steps(event.path, event.sha256)
    check_steps_table(table)
    slates = [tuple(int(i) for i in a) for a in table["action"].to_pylist()]
    assert all(len(s) == 2 and s[0] < s[1] <= 4 for s in slates) and len(set(slates)) > 5  # random 2-subsets
    assert set(table[VERSION_FEATURE].to_pylist()) == {0.0} and set(table[EPSILON_FEATURE].to_pylist()) == {1.0}
    assert table["is_last"].to_pylist().count(True) == event.num_groups and event.reward_mean > 0


def test_with_a_version_and_no_exploration_the_actor_recommends_its_best_slate(memory_store, tmp_path) -> None:
    network = publish_favouring(AdapterRegistry(memory_store, "srun"), topic=3)
    actor = make_actor(memory_store, tmp_path, steps_per_batch=50, final_epsilon=0.0, epsilon_decay_steps=1)
    actor.env_steps = 10  # past the decay: epsilon 0
    table = TrajectoryArchive(memory_store).read_steps(actor.write_batch().path)
    assert set(table[VERSION_FEATURE].to_pylist()) == {1.0} and set(table[EPSILON_FEATURE].to_pylist()) == {0.0}
    for observation, action in zip(table["observation"].to_pylist(), table["action"].to_pylist(), strict=True):
        assert tuple(int(i) for i in action) == best_slate(network, SLATE, "optimal", observation)
    topics_RC = np.array(table["observation"].to_pylist())[:, -5:]
    shown = np.array(table["action"].to_pylist()).astype(int)
    has_3 = (topics_RC == 3).any(axis=1)
    assert has_3.any() and all((topics_RC[r, shown[r]] == 3).any() for r in np.flatnonzero(has_3))


def test_a_slate_actor_refuses_an_environment_that_differs_from_the_runs_slate_section() -> None:
    check_slate_environment(InterestEvolution(), 26, SLATE)
    with pytest.raises(ValueError, match="slate_size 3"):
        check_slate_environment(InterestEvolution(slate_size=3), 26, SLATE)
    with pytest.raises(ValueError, match="observation_size"):
        check_slate_environment(InterestEvolution(), 25, SLATE)


def test_rlpipe_eval_of_a_slateq_run_plays_held_out_users_with_the_best_slates(tmp_path: Path) -> None:
    store = ObjectStore((tmp_path / "store").as_uri())
    config = resolve_config("slateq-recsim", overrides=["run_id=srun", f"store.root={store.url('')}"], environ={})
    create_run(store, config, config.env.name)
    network = publish_favouring(AdapterRegistry(store, "srun"), topic=3)
    result = evaluate_value_version(config, store, version=1, episodes=2)
    env, returns = InterestEvolution(), []
    for seed in range(config.env.eval_seed_offset, config.env.eval_seed_offset + 2):
        env.reset(seed)
        while not env.done:
            slate = best_slate(network, SLATE, "optimal", env.numeric_state())
            env.step(f"<answer>{slate[0] + 1}, {slate[1] + 1}</answer>")
        returns.append(env.episode_return)
    assert (result.policy, result.version, result.returns) == ("value-network", 1, returns)

    out = CliRunner().invoke(eval_app, ["--run", "srun", "--root", store.url(""), "--version", "latest",
                                        "--version", "0", "--episodes", "2", "--baseline", "random", "--json"])
    assert out.exit_code == 0, out.output
    payload = json.loads(out.output)
    assert [(r["policy"], r["version"]) for r in payload["results"]][:2] == [("value-network", 1), ("value-network", 0)]
    assert payload["results"][0]["returns"] == returns and payload["results"][1]["returns"] != returns


def stop_after(calls: int) -> Callable[[], bool]:
    """A ``should_stop`` that says stop from its ``calls``-th call on (the actor asks once per wait)."""
    counter = itertools.count(1)
    return lambda: next(counter) >= calls


def test_with_max_batches_ahead_the_actor_waits_for_the_learners_newest_version(memory_store, tmp_path) -> None:
    actor = make_actor(memory_store, tmp_path, steps_per_batch=20, max_batches_ahead=2, registry_poll_s=0.0)
    # before the first version the learner is still filling its replay memory (time-limit cuts drop transitions,
    # so how many batches that takes is not known in advance): the actor does not wait
    assert actor.run(should_stop=stop_after(40), max_batches=3) == 3
    publish_favouring(AdapterRegistry(memory_store, "srun"), topic=1)  # a version at learner step 1
    assert actor.run(should_stop=stop_after(40), max_batches=5) == 3  # two ahead of step 1: it waits, none more
    with pytest.raises(ValueError, match=r"at least learner.publish_every \(3\)"):
        ValueRunConfig(observation_size=26, num_actions=5, learner={"agent": "slateq", "min_replay_size": 500,
                                                                    "publish_every": 3},
                       actor={"steps_per_batch": 400, "max_batches_ahead": 2}, slate=SLATE)
