"""The value learner loop: steps batches -> replay memory -> DQN/C51 -> versions and checkpoints, exactly once."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from consumers.checkpoint import CheckpointStore
from consumers.sources import BatchRef
from consumers.value.config import ValueLearnerConfig
from consumers.value.learner import ValueLearner
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from pipeline.runtime import Announcer
from pipeline.value_network import load_network
from producers.envs.classic import CartPole
from producers.value_actor import ValueActor, ValueNetworkWatcher
from schemas.events import DeadLetter, Envelope, LearnerProgress, TrajectoryBatchCommitted
from schemas.steps import steps_to_table
from schemas.value import ValueActorConfig

BATCHES = 12
CONFIG = ValueLearnerConfig(
    hidden_sizes=(16,), batch_size=16, min_replay_size=64, replay_capacity=300, replay_scheme="prioritized",
    n_step=3, updates_per_transition=0.25, checkpoint_every=4, publish_every=2, target_update_period=20,
)


class ListSource:
    """Announcements from a list, positions ``mem:0`` -> index after the batch (a broker in miniature)."""

    def __init__(self, refs: list[BatchRef]) -> None:
        self.refs, self.index, self.committed = refs, 0, {}

    def poll(self, timeout_s: float) -> list[BatchRef]:
        if self.index >= len(self.refs):
            return []
        self.index += 1
        return [self.refs[self.index - 1]]

    def seek(self, positions: dict[str, int]) -> None:
        self.index = positions.get("mem:0", 0)

    def commit(self, positions: dict[str, int]) -> None:
        self.committed = dict(positions)

    def keep_alive(self) -> None:
        pass

    def exhausted(self) -> bool:
        return self.index >= len(self.refs)


@pytest.fixture(scope="module")
def batches(tmp_path_factory: pytest.TempPathFactory) -> tuple[ObjectStore, list[BatchRef]]:
    """Twelve CartPole steps batches of random play, announced in order (shared by the module's tests)."""
    root = tmp_path_factory.mktemp("value-store")
    store = ObjectStore((root / "store").as_uri())
    actor = ValueActor(run_id="actors", actor_id="a0", env=CartPole(), archive=TrajectoryArchive(store),
                       watcher=ValueNetworkWatcher(AdapterRegistry(store, "actors"), root / "cache"),
                       config=ValueActorConfig(steps_per_batch=40))
    refs = []
    for index in range(BATCHES):
        event = actor.write_batch()
        refs.append(BatchRef(event.batch_id, event.path, event.sha256, {"mem:0": index + 1}))
    return store, refs


def make_learner(store: ObjectStore, run_id: str, refs: list[BatchRef], announced: list | None = None,
                 **overrides) -> ValueLearner:  # type: ignore[no-untyped-def]
    config = CONFIG.model_copy(update=overrides)
    return ValueLearner(
        run_id=run_id, env_name="cartpole", config=config, observation_size=4, num_actions=2,
        archive=TrajectoryArchive(store), registry=AdapterRegistry(store, run_id),
        checkpoints=CheckpointStore(store, run_id), source=ListSource(refs),
        announce=(announced if announced is not None else []).append,
    )


def assert_same_memory(left: dict[str, np.ndarray], right: dict[str, np.ndarray]) -> None:
    assert left.keys() == right.keys()
    for name in left:
        np.testing.assert_array_equal(left[name], right[name], err_msg=name)


def test_the_replay_memory_rebuilt_from_the_store_equals_the_one_before_the_restart(batches, tmp_path: Path) -> None:
    store, refs = batches
    first = make_learner(store, "rebuild", refs)
    first.resume()
    first.run(poll_timeout_s=0.0)
    assert first.state.step == BATCHES and first.memory.add_count > first.memory.capacity  # it wrapped around
    assert first.agent.training_steps > 0 and first.state.step % CONFIG.checkpoint_every == 0
    before = first.memory.to_state_dict()
    second = make_learner(store, "rebuild", refs)
    assert second.resume() is True
    assert_same_memory(second.memory.to_state_dict(), before)
    for name, tensor in first.agent.state_dict().items():
        torch.testing.assert_close(second.agent.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    assert second.source.index == BATCHES  # sought to the checkpoint's position


def test_published_versions_are_value_networks_an_actor_loads(batches, tmp_path: Path) -> None:
    store, refs = batches
    announced: list = []
    learner = make_learner(store, "publish", refs, announced)
    learner.run(poll_timeout_s=0.0)
    registry = AdapterRegistry(store, "publish")
    versions = registry.versions()
    assert versions == list(range(1, len(versions) + 1)) and len(versions) >= 3
    assert {registry.show(v).kind for v in versions} == {"value-network"}
    spec, network = load_network(registry.pull(versions[-1], tmp_path / "cache", kind="value-network"))
    assert (spec.observation_size, spec.num_actions, spec.hidden_sizes) == (4, 2, (16,))
    obs = torch.randn(5, 4)
    torch.testing.assert_close(network.q_values(obs), learner.agent.online.q_values(obs).detach())
    assert sum(type(p).__name__ == "AdapterPublished" for p in announced) == len(versions)


def test_a_restart_between_checkpoints_repeats_no_batch_and_gives_the_same_weights(batches) -> None:
    store, refs = batches
    straight = make_learner(store, "straight", refs)
    straight.run(poll_timeout_s=0.0)
    crashed = make_learner(store, "crash", refs, max_steps=10)  # checkpoints at 4 and 8; 9 and 10 are lost
    crashed.run(poll_timeout_s=0.0)
    resumed = make_learner(store, "crash", refs)
    resumed.resume()
    assert resumed.state.step == 8 and resumed.source.index == 8
    resumed.run(poll_timeout_s=0.0)
    assert resumed.state.step == BATCHES and resumed.duplicates_skipped == 0
    assert sorted(resumed.state.trained) == sorted(ref.batch_id for ref in refs)  # each batch trained once
    for name, tensor in straight.agent.state_dict().items():
        torch.testing.assert_close(resumed.agent.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    versions = AdapterRegistry(store, "crash").versions()
    assert versions == list(range(1, len(versions) + 1))  # dense, though steps 9-10 published twice


def test_a_batch_announced_twice_is_trained_once_and_a_tampered_one_is_dead_lettered(batches) -> None:
    store, refs = batches
    tampered = BatchRef(refs[1].batch_id + "x", refs[1].path, "0" * 64, {"mem:0": 3})
    twice = [refs[0], BatchRef(refs[0].batch_id, refs[0].path, refs[0].sha256, {"mem:0": 2}), tampered,
             BatchRef(refs[2].batch_id, refs[2].path, refs[2].sha256, {"mem:0": 4})]
    announced: list = []
    learner = make_learner(store, "dup", twice, announced, publish_every=1, min_replay_size=1)
    learner.run(poll_timeout_s=0.0)
    assert learner.duplicates_skipped == 1 and learner.dead_lettered == 1
    assert learner.state.trained == {refs[0].batch_id: 1, refs[2].batch_id: 2}  # neither skip made a step
    assert learner.state.positions == {"mem:0": 4} and learner.state.version == 3
    # the dead-lettered batch is the second read (publish_every 1): v2 holds step 1's weights and says so
    read_at = {m.version: (m.learner_step, m.metrics["batches_read"]) for m in learner.registry.list()}
    assert read_at == {1: (1, 1), 2: (1, 2), 3: (2, 3)}
    assert [p.key for p in announced if isinstance(p, DeadLetter)] == [tampered.batch_id]
    assert learner.last_metrics["batches_dead_lettered"] == 1


def test_a_claim_check_naming_no_file_a_folder_or_a_path_through_a_file_is_dead_lettered(batches) -> None:
    """The store is immutable: none of them ever becomes readable, so raising would stop the learner there for good."""
    store, refs = batches
    folder = refs[0].path.rsplit("/", 1)[0]
    unreadable = [BatchRef("gone", f"{folder}/gone.parquet", "0" * 64, {"mem:0": 1}),
                  BatchRef("folder", folder, "0" * 64, {"mem:0": 2}),
                  BatchRef("through", f"{refs[0].path}/more.parquet", "0" * 64, {"mem:0": 3})]
    announced: list = []
    learner = make_learner(store, "no-file", [*unreadable, BatchRef(refs[0].batch_id, refs[0].path, refs[0].sha256,
                                                                    {"mem:0": 4})], announced)
    learner.run(poll_timeout_s=0.0)
    assert [(p.key, p.origin_offset) for p in announced if isinstance(p, DeadLetter)] == [
        ("gone", 0), ("folder", 1), ("through", 2)]
    assert learner.state.trained == {refs[0].batch_id: 1} and learner.state.positions == {"mem:0": 4}


def test_a_stop_after_a_dead_lettered_batch_does_not_read_it_again_after_the_restart(batches) -> None:
    """A batch dead-lettered after the last step (no step covers its position) is passed at the stop: the restart
    neither dead-letters it again nor publishes again the version that fell due at it, and counts it as read."""
    store, refs = batches
    tampered = BatchRef(refs[1].batch_id + "x", refs[1].path, "0" * 64, {"mem:0": 3})
    log = [refs[0], refs[1], tampered, BatchRef(refs[2].batch_id, refs[2].path, refs[2].sha256, {"mem:0": 4})]
    announced: list = []
    first = make_learner(store, "dead-stop", log[:3], announced, publish_every=1, min_replay_size=1)
    first.run(poll_timeout_s=0.0)
    first.finish()
    assert first.state.step == 2 and first.state.version == 3 and first.batches_read == 3
    again: list = []
    second = make_learner(store, "dead-stop", log, again, publish_every=1, min_replay_size=1)
    second.resume()
    assert second.batches_read == 3 and second.state.version == 3
    second.run(poll_timeout_s=0.0)
    assert not [p for p in again if isinstance(p, DeadLetter)]
    assert second.state.step == 3 and second.last_metrics["batches_dead_lettered"] == 1
    read_at = {m.version: (m.learner_step, m.metrics["batches_read"]) for m in second.registry.list()}
    assert read_at == {1: (1, 1), 2: (2, 2), 3: (2, 3), 4: (3, 4)}
    second.finish()
    third = make_learner(store, "dead-stop", log, [], publish_every=1, min_replay_size=1)
    third.resume()
    assert third.batches_read == 4  # the step log records the dead-lettered batch with the step after it


class EventLog:
    """A publisher standing in for the broker: what it holds, in order."""

    def __init__(self) -> None:
        self.events: list[Envelope] = []

    def publish(self, kind: str, event: Envelope) -> tuple[int, int]:
        self.events.append(event)
        return 0, len(self.events) - 1


def test_a_learner_killed_after_a_dead_letter_sends_it_again_under_the_same_event_id(batches) -> None:
    """Killed after a batch's dead letter but before a checkpoint passed the batch, the learner reads the batch
    again on its next start and dead-letters it again: one ``event_id`` for both, so readers count one letter."""
    store, refs = batches
    tampered = BatchRef(refs[1].batch_id + "x", refs[1].path, "0" * 64, {"mem:0": 3})
    log = [refs[0], refs[1], tampered, BatchRef(refs[2].batch_id, refs[2].path, refs[2].sha256, {"mem:0": 4})]
    broker = EventLog()
    killed = make_learner(store, "dead-kill", log[:3], publish_every=1, min_replay_size=1, checkpoint_every=1)
    killed.announce = Announcer(broker, "dead-kill")  # type: ignore[arg-type]
    killed.run(poll_timeout_s=0.0)  # steps 1 and 2 checkpointed, then the tampered batch dead-lettered; no stop
    assert killed.state.step == 2 and killed.dead_lettered == 1
    again = make_learner(store, "dead-kill", log, publish_every=1, min_replay_size=1, checkpoint_every=1)
    again.announce = Announcer(broker, "dead-kill")  # type: ignore[arg-type]
    again.resume()
    again.run(poll_timeout_s=0.0)
    letters = [event for event in broker.events if isinstance(event.payload, DeadLetter)]
    assert [event.payload.key for event in letters] == [tampered.batch_id] * 2 and again.dead_lettered == 1
    assert letters[0].event_id == letters[1].event_id


@pytest.mark.parametrize("last", ["dead-lettered", "already trained"])
def test_a_learner_waiting_after_a_batch_no_step_covers_announces_that_it_read_past_it(batches, last: str) -> None:
    """No step covers a last batch dead-lettered or already trained, so the step's progress stops before it; while
    the learner waits it announces the position past it (what ``rlpipe run`` waits for before it stops it)."""
    store, refs = batches
    second = (BatchRef(refs[1].batch_id + "x", refs[1].path, "0" * 64, {"mem:0": 2}) if last == "dead-lettered"
              else BatchRef(refs[0].batch_id, refs[0].path, refs[0].sha256, {"mem:0": 2}))
    announced: list = []
    learner = make_learner(store, f"wait-{last[:4]}", [refs[0], second], announced, publish_every=1,
                           min_replay_size=1)
    learner.source = source = OpenSource([refs[0], second])
    idle = itertools.count()
    learner.run(should_stop=lambda: source.index >= 2 and next(idle) >= 3, poll_timeout_s=0.0)
    assert learner.state.step == 1
    progress = [p for p in announced if isinstance(p, LearnerProgress)]
    assert progress[-1].positions == {"mem:0": 2} and progress[-1].step == 1
    assert len(progress) == 2, "the same progress announced again on every idle poll"


class RenewedLogSource(ListSource):
    """A log created again under the same name: the old positions point past its end."""

    def log_identity(self) -> dict[str, str]:
        return {"mem": "second-log"}

    def positions_elsewhere(self, positions: dict[str, int], recorded: dict[str, str]) -> list[str]:
        return sorted(key for key in positions if recorded.get("mem") != "second-log")


def test_a_learner_resuming_on_a_new_log_reads_it_from_the_start_and_skips_what_it_trained(batches) -> None:
    store, refs = batches
    first = make_learner(store, "renewed", refs[:4])
    first.run(poll_timeout_s=0.0)  # checkpoint at step 4, positions {"mem:0": 4}
    again = make_learner(store, "renewed", refs[:6])
    again.source = RenewedLogSource(refs[:6])  # the same announcements again, from offset 0
    again.resume()
    assert again.state.positions == {"mem:0": 0} and again.state.log_identity == {"mem": "second-log"}
    again.run(poll_timeout_s=0.0)
    assert again.duplicates_skipped == 4 and again.state.step == 6
    assert list(again.state.trained) == [ref.batch_id for ref in refs[:6]]


def store_steps(store: ObjectStore, name: str, rows: list[dict], position: int) -> BatchRef:
    key = f"runs/actors/env-steps/date=2026-01-01/{name}.parquet"
    sha256 = TrajectoryArchive(store).write_steps(key, steps_to_table(rows))
    return BatchRef(name, key, sha256, {"mem:0": position})


def episode(name: str, length: int = 10, width: int = 4, action: float = 0.0, reward: float = 1.0,
            value: float = 0.1) -> list[dict]:
    return [dict(episode_id=name, step=t, is_first=t == 0, is_last=t == length - 1, is_terminal=t == length - 1,
                 observation=[value] * width, action=[action], reward=reward,
                 discount=0.0 if t == length - 1 else 1.0) for t in range(length)]


BAD_BATCHES = {
    "nan_reward": (episode("b", reward=float("nan")), "reward"),
    "inf_observation": (episode("b", value=float("inf")), "observation"),
    "wide_observation": (episode("b", width=5), "5 values"),
    "action_out_of_range": (episode("b", action=7.0), "action 7"),
    "negative_action": (episode("b", action=-1.0), "action -1"),
}


@pytest.mark.parametrize("bad", sorted(BAD_BATCHES))
@pytest.mark.parametrize("agent", ["dqn", "c51"])
def test_a_batch_whose_contents_cannot_train_is_dead_lettered_and_the_next_one_trains(tmp_path: Path, bad: str,
                                                                                     agent: str) -> None:
    store = ObjectStore((tmp_path / "store").as_uri())
    rows, named = BAD_BATCHES[bad]
    refs = [store_steps(store, "good", episode("g"), 1), store_steps(store, "poisoned", rows, 2),
            store_steps(store, "after", episode("a"), 3)]
    announced: list = []
    learner = make_learner(store, "bad", refs, announced, agent=agent, min_replay_size=1, batch_size=4)
    learner.resume()
    learner.run(poll_timeout_s=0.0)
    letters = [p for p in announced if isinstance(p, DeadLetter)]
    assert [p.key for p in letters] == ["poisoned"] and named in letters[0].reason
    assert sorted(learner.state.trained) == ["after", "good"] and learner.state.positions == {"mem:0": 3}
    assert learner.agent.training_steps > 0


def test_a_nan_batch_taken_before_training_starts_never_reaches_the_memory(tmp_path: Path) -> None:
    store = ObjectStore((tmp_path / "store").as_uri())
    refs = [store_steps(store, "nan", episode("n", reward=float("nan")), 1), store_steps(store, "good", episode("g"), 2),
            store_steps(store, "more", episode("m"), 3)]
    for _ in range(2):  # and again after a restart, which rebuilds the memory from the step log
        learner = make_learner(store, "wedge", refs, min_replay_size=15, batch_size=4, checkpoint_every=1)
        learner.resume()
        learner.run(poll_timeout_s=0.0)
        assert sorted(learner.state.trained) == ["good", "more"] and np.isfinite(learner.memory.reward).all()


def test_a_replay_memory_that_could_never_hold_its_minimum_is_refused() -> None:
    with pytest.raises(ValueError, match="min_replay_size 500 exceeds replay_capacity 200"):
        ValueLearnerConfig(replay_capacity=200, min_replay_size=500, batch_size=64)


def test_a_value_learner_that_would_never_update_is_refused_up_front() -> None:
    """updates_per_transition 0: the network never trains and no version is published before the last step, so
    actors waiting on max_batches_ahead would wait for ever."""
    from schemas.value import ValueLearnerConfig

    with pytest.raises(ValueError, match="updates_per_transition"):
        ValueLearnerConfig(updates_per_transition=0.0)
    assert ValueLearnerConfig(updates_per_transition=0.25).updates_per_transition == 0.25


class OpenSource(ListSource):
    """A source that never runs dry (a live broker): the learner's last batch read is not a run's last."""

    def exhausted(self) -> bool:
        return False


def waits_for_the_learner(actor: ValueActor) -> bool:
    """Whether ``actor`` pauses for a newer version (it gives up after a few looks at the registry)."""
    looks = itertools.count()
    actor.wait_for_learner(lambda: next(looks) >= 3)
    return next(looks) > 1


@pytest.mark.parametrize("publish_every", [1, 2])
def test_an_actor_at_max_batches_ahead_does_not_wait_for_ever_on_a_dead_lettered_batch(
        tmp_path: Path, publish_every: int) -> None:
    """max_batches_ahead = publish_every (the least the run allows) and one batch of the actor's dead-lettered.

    Each round the actor writes until the bound stops it (at most 3 batches), then the learner reads all of them.
    The learner has then read every batch the actor wrote, so an actor still waiting would wait for ever: a
    dead-lettered batch counts as read for the versions' cadence and for the actor's bound.
    """
    store = ObjectStore((tmp_path / "store").as_uri())
    actor = ValueActor(run_id="ahead", actor_id="a0", env=CartPole(), archive=TrajectoryArchive(store),
                       watcher=ValueNetworkWatcher(AdapterRegistry(store, "ahead"), tmp_path / "cache"),
                       config=ValueActorConfig(steps_per_batch=40, max_batches_ahead=publish_every,
                                               registry_poll_s=0.0))
    refs: list[BatchRef] = []
    learner = make_learner(store, "ahead", refs, publish_every=publish_every, min_replay_size=16, batch_size=8)
    learner.source = source = OpenSource(refs)
    for _ in range(5):
        for _ in range(3):
            if waits_for_the_learner(actor):
                break
            event = actor.write_batch()
            sha256 = "0" * 64 if len(refs) == 2 else event.sha256  # the third batch's file does not match its event
            refs.append(BatchRef(event.batch_id, event.path, sha256, {"mem:0": len(refs) + 1}))
        learner.run(should_stop=lambda: source.index >= len(refs) and not learner.incoming, poll_timeout_s=0.0)
        assert not waits_for_the_learner(actor), f"the learner read all {len(refs)} batches and published none more"
    assert learner.dead_lettered == 1 and learner.state.step == len(refs) - 1 >= 5


def test_max_batches_ahead_bounds_each_actor_by_the_learners_reads_of_its_own_batches(tmp_path: Path) -> None:
    """Two actors at max_batches_ahead 2.  The learner has read five batches, all a0's: a1 has written none, so it
    may write 2 before it waits, not 2 + 5.  Each version records the batches read per actor (trained or
    dead-lettered), and a restarted learner counts on from the step log."""
    store = ObjectStore((tmp_path / "store").as_uri())

    def actor(actor_id: str) -> ValueActor:
        return ValueActor(run_id="two", actor_id=actor_id, env=CartPole(), archive=TrajectoryArchive(store),
                          watcher=ValueNetworkWatcher(AdapterRegistry(store, "two"), tmp_path / actor_id),
                          config=ValueActorConfig(steps_per_batch=40, max_batches_ahead=2, registry_poll_s=0.0))

    a0, a1 = actor("a0"), actor("a1")
    refs: list[BatchRef] = []

    def announce(event: TrajectoryBatchCommitted, sha256: str | None = None) -> None:
        refs.append(BatchRef(event.batch_id, event.path, sha256 or event.sha256, {"mem:0": len(refs) + 1},
                             event.producer_id))

    learner = make_learner(store, "two", refs, publish_every=1, min_replay_size=16, batch_size=8)
    learner.source = source = OpenSource(refs)

    def read_all(learner: ValueLearner) -> None:
        learner.run(should_stop=lambda: source.index >= len(refs) and not learner.incoming, poll_timeout_s=0.0)

    for _ in range(5):
        announce(a0.write_batch())
        read_all(learner)
    assert learner.batches_read == 5 and learner.state.version == 5
    written = 0
    while written < 8 and not waits_for_the_learner(a1):
        announce(a1.write_batch(), "0" * 64 if written == 1 else None)  # its second is dead-lettered when read
        written += 1
    assert written == 2  # its own two unread batches stop it
    assert not waits_for_the_learner(a0)  # every batch of a0's was read
    read_all(learner)
    assert learner.dead_lettered == 1 and not waits_for_the_learner(a1)
    per_actor = {key: value for key, value in learner.registry.latest().metrics.items() if "/" in key}
    assert per_actor == {"batches_read/a0": 5.0, "batches_read/a1": 2.0}
    learner.finish()
    again = make_learner(store, "two", refs, publish_every=1, min_replay_size=16, batch_size=8)
    again.source = source
    again.resume()
    assert dict(again.read_by_producer) == {"a0": 5, "a1": 2}


def test_with_keep_versions_only_the_newest_value_networks_keep_their_files(batches, tmp_path: Path) -> None:
    """A value run publishes a version per batch read; ``keep_versions`` bounds the files a long run leaves."""
    store, refs = batches
    learner = make_learner(store, "kept", refs, publish_every=1, min_replay_size=1, keep_versions=2)
    learner.run(poll_timeout_s=0.0)
    registry = AdapterRegistry(store, "kept")
    versions = registry.versions()
    assert len(versions) >= 4 and versions == list(range(1, len(versions) + 1))  # the numbers all stay
    assert registry.versions_with_files() == versions[-2:]
    assert registry.retired_reason(1) is not None and "value.learner.keep_versions=2" in registry.retired_reason(1)
    load_network(registry.pull(versions[-1], tmp_path / "cache", kind="value-network"))
