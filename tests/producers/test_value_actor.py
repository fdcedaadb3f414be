"""Numeric actors: whole episodes as steps batches, epsilon-greedy on the newest published value network."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.io.archive import TrajectoryArchive
from pipeline.io.bus import PublishError
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from pipeline.value_network import NetworkSpec, build_from_spec, network_files
from producers.envs.classic import Acrobot, CartPole
from producers.sink import batch_events
from producers.value_actor import (
    EPSILON_FEATURE,
    VERSION_FEATURE,
    ValueActor,
    ValueNetworkWatcher,
    stored_events,
)
from schemas.events import TrajectoryBatchCommitted
from schemas.steps import check_steps_table
from schemas.value import ValueActorConfig

SPEC = NetworkSpec(agent="dqn", observation_size=4, num_actions=2, hidden_sizes=(8,))


def publish_preferring(registry: AdapterRegistry, action: int) -> None:
    """Publish a Q-network whose Q-values favour ``action`` everywhere (a large bias on its output)."""
    network = build_from_spec(SPEC)
    with torch.no_grad():
        for layer in network.layers:
            if isinstance(layer, torch.nn.Linear):
                layer.weight.zero_()
        network.layers[-1].bias.copy_(torch.tensor([1.0, 0.0] if action == 0 else [0.0, 1.0]))
    registry.publish_files(network_files(SPEC, network), "dqn:cartpole", len(registry.versions()), 1,
                           kind="value-network")


def make_actor(store: ObjectStore, tmp_path: Path, env=None, **config) -> tuple[ValueActor, list]:  # type: ignore[no-untyped-def]
    announced: list = []
    watcher = ValueNetworkWatcher(AdapterRegistry(store, "vrun"), tmp_path / "cache", poll_s=0.0)
    actor = ValueActor(run_id="vrun", actor_id="a0", env=env or CartPole(), archive=TrajectoryArchive(store),
                       watcher=watcher, config=ValueActorConfig(**config), announce=announced.append)
    return actor, announced


def test_a_batch_is_whole_episodes_in_a_steps_table_announced_with_its_digest(memory_store: ObjectStore,
                                                                            tmp_path: Path) -> None:
    actor, announced = make_actor(memory_store, tmp_path, steps_per_batch=50)
    event = actor.write_batch()
    assert announced == [event] and isinstance(event, TrajectoryBatchCommitted)
    table = TrajectoryArchive(memory_store).read_steps(event.path, event.sha256)
    check_steps_table(table)
    assert event.path.startswith("runs/vrun/env-steps/date=") and table.num_rows == event.num_rows >= 50
    assert table["is_last"].to_pylist().count(True) == event.num_groups  # every episode ends in the batch
    assert set(table[VERSION_FEATURE].to_pylist()) == {0.0} and set(table[EPSILON_FEATURE].to_pylist()) == {1.0}
    assert (event.policy_version_min, event.policy_version_max, event.num_tokens) == (0, 0, 0)
    assert set(np.concatenate(table["action"].to_numpy(zero_copy_only=False))) <= {0.0, 1.0}


def test_the_actor_switches_to_a_new_version_between_episodes_and_acts_greedily(memory_store: ObjectStore,
                                                                             tmp_path: Path) -> None:
    registry = AdapterRegistry(memory_store, "vrun")
    actor, _ = make_actor(memory_store, tmp_path, steps_per_batch=20, final_epsilon=0.0, epsilon_decay_steps=1)
    publish_preferring(registry, action=1)
    first = TrajectoryArchive(memory_store).read_steps(actor.write_batch().path)
    assert actor.watcher.version == 1
    assert set(first[VERSION_FEATURE].to_pylist()) == {1.0}
    assert {float(a[0]) for a in first["action"].to_pylist()} == {1.0}  # greedy: always the favoured action
    publish_preferring(registry, action=0)
    second = TrajectoryArchive(memory_store).read_steps(actor.write_batch().path)
    assert set(second[VERSION_FEATURE].to_pylist()) == {2.0}
    assert {float(a[0]) for a in second["action"].to_pylist()} == {0.0}


def test_epsilon_decays_over_the_actors_own_steps(memory_store: ObjectStore, tmp_path: Path) -> None:
    actor, _ = make_actor(memory_store, tmp_path, epsilon_decay_steps=100, final_epsilon=0.1)
    assert actor.epsilon() == 1.0  # nothing published yet: uniform
    publish_preferring(AdapterRegistry(memory_store, "vrun"), action=0)
    actor.watcher.refresh(force=True)
    actor.env_steps = 50
    assert actor.epsilon() == pytest.approx(0.55)
    actor.env_steps = 1_000
    assert actor.epsilon() == pytest.approx(0.1)


def test_a_lora_version_is_not_loaded_as_a_value_network(memory_store: ObjectStore, tmp_path: Path) -> None:
    AdapterRegistry(memory_store, "vrun").publish_files(
        {"adapter_config.json": b"{}", "adapter_model.safetensors": b"x"}, "tiny", 0, 1)
    actor, _ = make_actor(memory_store, tmp_path)
    assert actor.watcher.refresh(force=True) is False and actor.watcher.version == 0


def test_acrobot_plays_with_three_actions(memory_store: ObjectStore, tmp_path: Path) -> None:
    actor, _ = make_actor(memory_store, tmp_path, env=Acrobot(max_env_steps=30), steps_per_batch=30)
    table = TrajectoryArchive(memory_store).read_steps(actor.write_batch().path)
    assert len(table["observation"][0]) == 6 and {a[0] for a in table["action"].to_pylist()} <= {0.0, 1.0, 2.0}


def test_an_environment_that_does_not_fit_the_runs_network_is_refused() -> None:
    from producers.value_actor import check_environment

    check_environment(CartPole(), observation_size=4, num_actions=2)
    with pytest.raises(ValueError, match=r"fix value\.observation_size and value\.num_actions"):
        check_environment(Acrobot(), observation_size=4, num_actions=2)


def test_a_batch_stored_but_never_announced_is_announced_as_it_would_have_been(memory_store: ObjectStore,
                                                                              tmp_path: Path) -> None:
    from producers.value_actor import steps_orphan_sweep

    actor, _ = make_actor(memory_store, tmp_path, steps_per_batch=30)
    sent = actor.write_batch()
    lost: list = []

    def killed(payload) -> None:  # the actor dies between its file and its event
        lost.append(payload)
        raise KeyboardInterrupt

    actor.announce = killed
    with pytest.raises(KeyboardInterrupt):
        actor.write_batch()
    archive = TrajectoryArchive(memory_store)
    table = archive.read_steps(sent.path)
    older = table.replace_schema_metadata({k: v for k, v in table.schema.metadata.items() if b"summary" not in k})
    archive.write_steps(sent.path.replace(sent.batch_id, "s-older"), older)  # an older actor's: no event fields
    memory_store.put(sent.path.replace(sent.batch_id, "s-broken"), b"not parquet")
    again: list = []
    sweep = steps_orphan_sweep(archive, "vrun", again.append, min_age_s=0.0, announced=lambda: [sent.batch_id])
    assert sweep.sweep() == [lost[0].batch_id]  # the two others are left alone, and the actor starts
    assert again == lost  # every field as the actor would have announced it


def test_the_actor_beats_with_its_episodes_steps_and_busy_share(memory_store: ObjectStore, tmp_path: Path) -> None:
    """A value actor sends ProducerHeartbeat like a language-model producer (the report's throughput and duty
    cycle, the dashboard): episodes as samples, environment steps, batches, and the share of time spent acting."""
    from schemas.events import ProducerHeartbeat

    actor, announced = make_actor(memory_store, tmp_path, steps_per_batch=50)
    actor.heartbeat_interval_s = 0.0  # a beat after every batch
    assert actor.run(max_batches=3) == 3
    beats = [p for p in announced if isinstance(p, ProducerHeartbeat)]
    assert len(beats) == 3 and all(b.producer_id == "a0" and b.tokens_total == 0 for b in beats)
    last = beats[-1]
    assert (last.batches_total, last.samples_total, last.env_steps_total) == (3, actor.episodes, actor.env_steps)
    assert last.interval_s > 0 and last.env_steps_per_s > 0 and 0.5 < last.busy_fraction <= 1.0
    quiet, said = make_actor(memory_store, tmp_path / "q", steps_per_batch=50)
    quiet.run(max_batches=2)  # the default interval (5 s) has not passed: no beat yet
    assert not [p for p in said if isinstance(p, ProducerHeartbeat)]


def test_a_restarted_actor_goes_on_exploring_from_its_earlier_batches_and_plays_none_of_them_again(
        memory_store: ObjectStore, tmp_path: Path) -> None:
    publish_preferring(AdapterRegistry(memory_store, "vrun"), action=0)
    first, announced = make_actor(memory_store, tmp_path, steps_per_batch=60, epsilon_decay_steps=400)
    first_batches = [TrajectoryArchive(memory_store).read_steps(first.write_batch().path) for _ in range(4)]
    epsilon_before = first.epsilon()
    other = TrajectoryBatchCommitted(**{**announced[0].model_dump(), "batch_id": "s-other", "producer_id": "a1"})
    second, _ = make_actor(memory_store, tmp_path, steps_per_batch=60, epsilon_decay_steps=400)  # same id, restarted
    second.resume([*announced, announced[1], other])  # a batch announced twice counts once; another actor's not
    assert (second.env_steps, second.episodes) == (first.env_steps, first.episodes)
    assert second.epsilon_at_steps() == pytest.approx(epsilon_before) and epsilon_before < 1.0  # once it loads v1
    table = TrajectoryArchive(memory_store).read_steps(second.write_batch().path)
    earlier_ids = {i for batch in first_batches for i in batch["episode_id"].to_pylist()}
    assert not earlier_ids & set(table["episode_id"].to_pylist())  # episode ids (and their seeds) go on
    assert max(table[EPSILON_FEATURE].to_pylist()) <= epsilon_before
    assert batch_events([announced[0], "not an event"]) == [announced[0]]  # payloads as the sweep announces them
    assert stored_events(TrajectoryArchive(memory_store), [announced[1].path, "runs/vrun/env-steps/gone.parquet"]) == [
        announced[1].model_copy(update={"path": announced[1].path})]  # a file's own summary, as if announced
    fresh, _ = make_actor(memory_store, tmp_path / "fresh", steps_per_batch=60, epsilon_decay_steps=400)
    fresh.resume([other])  # nothing of its own: it starts as a new actor
    assert (fresh.env_steps, fresh.episodes, fresh.epsilon_at_steps()) == (0, 0, 1.0)


class SeedRecordingCartPole(CartPole):
    """CartPole that keeps the seed of every reset."""

    def __init__(self) -> None:
        super().__init__()
        self.seeds: list[int] = []

    def reset(self, seed: int):  # type: ignore[no-untyped-def]
        self.seeds.append(seed)
        return super().reset(seed)


@pytest.mark.parametrize("seed", [0, 1, 7, 2**31 - 1])
def test_an_actor_built_without_training_seeds_never_plays_a_held_out_seed(memory_store: ObjectStore, tmp_path: Path,
                                                                           seed: int) -> None:
    """Held-out evaluation seeds start at env.eval_seed_offset (1,000,000 by default); actor seed 1 used to play
    1,000,003, 1,000,004, ... (seed * 1000003 + episode), the seeds rlpipe eval scores it on."""
    from schemas.config import EnvSpec

    env = SeedRecordingCartPole()
    actor, _ = make_actor(memory_store, tmp_path, env=env, seed=seed, steps_per_batch=30)
    actor.write_batch()
    assert env.seeds and len(set(env.seeds)) == len(env.seeds)
    assert all(0 <= s < EnvSpec().eval_seed_offset for s in env.seeds), env.seeds


def test_a_batch_whose_event_aged_out_of_the_log_is_counted_at_a_restart_and_never_announced_again(
        memory_store: ObjectStore, tmp_path: Path) -> None:
    """Retention trimmed the log to the actor's last event; its two older batches (stored in January) aged out.
    A restarted actor announces none of them again (each restart did, and the learner read them once more as
    duplicates or dead-lettered them again), yet goes on from all three, as it does from those the log holds."""
    from datetime import UTC, datetime

    from pipeline.io.bus import RunLog
    from producers.value_actor import run_history

    first, _ = make_actor(memory_store, tmp_path, steps_per_batch=30)
    events = [first.write_batch() for _ in range(3)]
    for event in events[:2]:  # written on 2026-01-05
        memory_store.put(event.path.replace(event.path.split("/")[3], "date=2026-01-05"), memory_store.get(event.path))
        memory_store.delete(event.path)
    since_ms = int(datetime(2026, 2, 1, tzinfo=UTC).timestamp() * 1000)  # the log holds every event since then
    again: list = []
    sweep, history = run_history(TrajectoryArchive(memory_store), "vrun", again.append, 0.0,
                                 lambda: RunLog([events[2]], since_ms))
    assert again == [] and len(sweep.aged_out) == 2  # counted, not announced
    sweep.sweep()
    assert again == []  # nor at the second look
    assert sorted(event.batch_id for event in history) == sorted(event.batch_id for event in events)
    second, _ = make_actor(memory_store, tmp_path / "second", steps_per_batch=30)  # the same id, restarted
    second.resume(history)
    assert (second.episodes, second.env_steps, second.batches_before) == (first.episodes, first.env_steps, 3)


def test_the_watcher_keeps_only_the_version_it_acts_with_in_its_cache(memory_store: ObjectStore,
                                                                       tmp_path: Path) -> None:
    """A value run publishes a version per batch read, for days: the actor's cache holds the loaded version's
    folder, not one for every version it ever switched to."""
    registry = AdapterRegistry(memory_store, "vrun")
    watcher = ValueNetworkWatcher(registry, tmp_path / "cache", poll_s=0.0)
    for version in range(1, 6):
        publish_preferring(registry, action=version % 2)
        assert watcher.refresh() and watcher.version == version
    assert sorted(p.name for p in (tmp_path / "cache" / "vrun").iterdir()) == ["v000005"]


def test_the_actor_polls_for_new_versions_without_listing_every_version(memory_store: ObjectStore,
                                                                        tmp_path: Path) -> None:
    """Its watcher and its wait for the learner poll every second for the whole run: after the first look they
    probe the next version number instead of listing every version (a listing grows by one per batch read)."""
    registry = AdapterRegistry(memory_store, "vrun")
    actor, _ = make_actor(memory_store, tmp_path, max_batches_ahead=4)
    publish_preferring(registry, action=0)
    listed: list[str] = []
    listing = memory_store.list

    def counting(prefix: str = "", recursive: bool = False) -> list[str]:
        listed.append(prefix)
        return listing(prefix, recursive)

    for version in range(2, 7):
        memory_store.list = counting  # type: ignore[method-assign]
        assert actor.watcher.refresh(force=True) and actor.watcher.version == version - 1
        assert not actor.watcher.refresh(force=True)
        assert actor.learner_read() is not None
        memory_store.list = listing  # type: ignore[method-assign]
        publish_preferring(registry, action=version % 2)
    assert len(listed) <= 1, listed


class AwayBroker:
    """An announcer whose broker can be away: it then refuses every event, as the publisher does once its wait for
    an acknowledgement ends."""

    def __init__(self) -> None:
        self.away = False
        self.taken: list = []

    def __call__(self, payload) -> None:  # type: ignore[no-untyped-def]
        if self.away:
            raise PublishError(f"publishing a {type(payload).__name__} to outage.trajectories failed: no "
                               "acknowledgement within 30s")
        self.taken.append(payload)


def test_an_actor_goes_on_while_the_broker_is_away_and_announces_its_batches_in_order_once_it_is_back(
        memory_store: ObjectStore, tmp_path: Path) -> None:
    broker = AwayBroker()
    watcher = ValueNetworkWatcher(AdapterRegistry(memory_store, "vrun"), tmp_path / "cache", poll_s=0.0)
    actor = ValueActor(run_id="vrun", actor_id="a0", env=CartPole(), archive=TrajectoryArchive(memory_store),
                       watcher=watcher, config=ValueActorConfig(steps_per_batch=20), announce=broker)
    actor.heartbeat_interval_s = 0.0  # a beat after every batch
    before = actor.write_batch()
    broker.away = True
    during = [actor.write_batch(), actor.write_batch()]  # stored; their events refused: the actor goes on
    actor.maybe_beat()  # a missed heartbeat does not end it either
    assert len(TrajectoryArchive(memory_store).list_steps("vrun")) == 3
    broker.away = False
    assert actor.run(max_batches=4) == 4  # the owed events go first (before the next batch's), each once
    batches = [event.batch_id for event in batch_events(broker.taken)]
    assert batches[:3] == [before.batch_id, *(event.batch_id for event in during)] and len(set(batches)) == 4
    assert [event.batch_id for event in batch_events(broker.taken)].count(before.batch_id) == 1
    assert not actor.owed.unannounced


def test_an_actor_stopped_with_batches_unannounced_says_so_in_one_line(memory_store: ObjectStore,
                                                                      tmp_path: Path) -> None:
    broker = AwayBroker()
    watcher = ValueNetworkWatcher(AdapterRegistry(memory_store, "vrun"), tmp_path / "cache", poll_s=0.0)
    actor = ValueActor(run_id="vrun", actor_id="a0", env=CartPole(), archive=TrajectoryArchive(memory_store),
                       watcher=watcher, config=ValueActorConfig(steps_per_batch=20), announce=broker)
    broker.away = True
    actor.write_batch()
    with pytest.raises(PublishError) as unannounced:
        actor.run(should_stop=lambda: True)
    message = str(unannounced.value)
    assert "\n" not in message and "1 batch of run vrun" in message and "rlpipe producer start --run vrun" in message
