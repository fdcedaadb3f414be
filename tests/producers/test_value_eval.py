"""``rlpipe eval`` of a value run: greedy play of a published value network on held-out seeds."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from pipeline.config import resolve_config
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from pipeline.runtime import create_run
from producers.envs.classic import CartPole
from producers.eval_cli import app as eval_app
from producers.value_eval import evaluate_value_version
from tests.producers.test_value_actor import publish_preferring


def always(action: int, seeds: range) -> list[float]:
    """Returns of CartPole played with one fixed action on ``seeds``."""
    env, choices, returns = CartPole(), CartPole().answer_choices(), []
    for seed in seeds:
        env.reset(seed)
        while not env.done:
            env.step(choices[action])
        returns.append(env.episode_return)
    return returns


def test_a_value_version_is_played_greedily_on_held_out_seeds(tmp_path: Path) -> None:
    store = ObjectStore((tmp_path / "store").as_uri())
    config = resolve_config("dqn-cartpole", overrides=["run_id=vrun", f"store.root={store.url('')}"], environ={})
    create_run(store, config, config.env.name)
    publish_preferring(AdapterRegistry(store, "vrun"), action=1)
    result = evaluate_value_version(config, store, version=1, episodes=3)
    seeds = range(config.env.eval_seed_offset, config.env.eval_seed_offset + 3)
    assert (result.policy, result.version, result.seed_start) == ("value-network", 1, seeds.start)
    assert result.returns == always(1, seeds)

    out = CliRunner().invoke(eval_app, ["--run", "vrun", "--root", store.url(""), "--version", "latest",
                                        "--version", "0", "--episodes", "3", "--json"])
    assert out.exit_code == 0, out.output
    payload = json.loads(out.output)
    assert [(r["policy"], r["version"]) for r in payload["results"]] == [("value-network", 1), ("value-network", 0)]
    assert payload["results"][0]["returns"] == result.returns and len(payload["saved"]) == 2
    table = CliRunner(env={"COLUMNS": "120"}).invoke(
        eval_app, ["--run", "vrun", "--root", store.url(""), "--version", "latest", "--version", "0",
                   "--episodes", "3", "--no-save"])
    assert table.exit_code == 0, table.output
    rows = [line for line in table.output.splitlines() if line.startswith("│")]
    assert "value-network" in rows[0] and "uniform random" in rows[1]  # v0 plays no network


def test_a_version_whose_network_does_not_fit_the_environment_is_refused_in_one_line(tmp_path: Path) -> None:
    """``rlpipe eval --env acrobot`` on a CartPole run: the network reads 4 values and scores 2 actions, Acrobot has
    6 and 3, so the version cannot play it (CartPole's other versions, cartpole-v1, can)."""
    store = ObjectStore((tmp_path / "store").as_uri())
    config = resolve_config("dqn-cartpole", overrides=["run_id=vfit", f"store.root={store.url('')}"], environ={})
    create_run(store, config, config.env.name)
    publish_preferring(AdapterRegistry(store, "vfit"), action=1)
    out = CliRunner().invoke(eval_app, ["--run", "vfit", "--root", store.url(""), "--version", "1",
                                        "--episodes", "2", "--env", "acrobot", "--no-save"])
    assert out.exit_code != 0 and not isinstance(out.exception, RuntimeError), out.output
    assert "reads 4 observation values and scores 2 actions" in out.output and "acrobot" in out.output
    assert len(out.output.strip().splitlines()) == 1
    wider = CliRunner().invoke(eval_app, ["--run", "vfit", "--root", store.url(""), "--version", "1",
                                          "--episodes", "2", "--env", "cartpole-v1", "--no-save", "--json"])
    assert wider.exit_code == 0, wider.output


def test_a_value_version_plays_the_held_out_part_of_its_environment(tmp_path: Path, monkeypatch) -> None:
    """Value and language-model evaluation play one environment: the run's, as held-out evaluation plays it
    (``held_out_spec``).  Here CartPole's held-out episodes are made 3 turns long, so every return is at most 3."""
    monkeypatch.setattr(CartPole, "held_out_overrides", classmethod(lambda cls, overrides: {**overrides,
                                                                                             "max_turns": 3}))
    store = ObjectStore((tmp_path / "store").as_uri())
    config = resolve_config("dqn-cartpole", overrides=["run_id=vheld", f"store.root={store.url('')}"], environ={})
    create_run(store, config, config.env.name)
    publish_preferring(AdapterRegistry(store, "vheld"), action=1)
    result = evaluate_value_version(config, store, version=1, episodes=3)
    assert result.returns == [3.0, 3.0, 3.0] and max(always(1, range(config.env.eval_seed_offset,
                                                                       config.env.eval_seed_offset + 3))) > 3


def test_a_missing_value_version_is_refused_naming_what_v0_plays(tmp_path: Path) -> None:
    """A value run's v0 is no base model: it plays uniformly at random, as ``rlpipe eval`` names it in its table."""
    store = ObjectStore((tmp_path / "store").as_uri())
    config = resolve_config("dqn-cartpole", overrides=["run_id=vmiss", f"store.root={store.url('')}"], environ={})
    create_run(store, config, config.env.name)
    publish_preferring(AdapterRegistry(store, "vmiss"), action=1)
    out = CliRunner().invoke(eval_app, ["--run", "vmiss", "--root", store.url(""), "--version", "99", "--no-save"])
    assert out.exit_code == 2, out.output
    assert "has no value-network version 99 (versions 1-1, 0 = uniform random)" in out.output, out.output
    assert "base model" not in out.output
