"""``LearnerCatchUp`` on the real broker: whether a run's learner has read every batch announced for it."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

from consumers.checkpoint import CheckpointStore
from consumers.sources import BatchRef
from consumers.value.config import ValueLearnerConfig
from consumers.value.learner import ValueLearner
from pipeline.devstack.catch_up import LearnerCatchUp
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.bus import EventPublisher, resolve_topic
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from pipeline.membership import control_topic_ends
from pipeline.runtime import Announcer
from producers.envs.classic import CartPole
from producers.value_actor import ValueActor, ValueNetworkWatcher
from schemas.config import BusConfig
from schemas.events import LearnerProgress
from schemas.value import ValueActorConfig
from tests.consumers.value.test_learner import OpenSource
from tests.producers.test_service import announce_batch


def settles_on(catch_up: LearnerCatchUp, expected: bool, within_s: float = 10.0) -> bool:
    """Whether ``catch_up()`` says ``expected`` within ``within_s`` (its followers read in the background)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if catch_up() == expected:
            return True
        time.sleep(0.2)
    return False


def test_the_learner_has_caught_up_once_its_progress_passes_the_runs_last_batch(bus_config: BusConfig) -> None:
    """Another run's batches written after this run's last one do not count (the group's lag would: the topic is
    shared); a progress announced before the check was built counts (a learner waiting says it every 5 s, a value
    learner once each time it changed)."""
    topic = resolve_topic(bus_config.namespace, "trajectories")
    since = control_topic_ends(bus_config)  # the launch
    with EventPublisher(bus_config) as publisher:
        offsets = [announce_batch(publisher, "mine", index) for index in range(3)]
        announce_batch(publisher, "other", 0)  # after this run's last batch, in the same topic
        announce = Announcer(publisher, "mine")
        announce(LearnerProgress(step=1, version=1, positions={f"{topic}:0": offsets[1] + 1}))  # read two of three

        catch_up = LearnerCatchUp(bus_config, "mine", since)
        try:
            assert not settles_on(catch_up, True, within_s=3.0), "caught up with a batch still unread"
            announce(LearnerProgress(step=1, version=1, positions={f"{topic}:0": offsets[2] + 1}))
            assert settles_on(catch_up, True), "the learner read every batch, but is not seen to"
        finally:
            catch_up.close()
    later = LearnerCatchUp(bus_config, "mine", since)  # built after the learner's last progress
    try:
        assert settles_on(later, True), "a progress announced before the check was built is not seen"
    finally:
        later.close()


def test_a_run_with_no_batch_written_is_caught_up_at_once(bus_config: BusConfig) -> None:
    catch_up = LearnerCatchUp(bus_config, "empty", control_topic_ends(bus_config))
    try:
        assert settles_on(catch_up, True)
    finally:
        catch_up.close()


def test_a_value_learner_whose_last_batch_is_dead_lettered_is_seen_to_have_caught_up(
        bus_config: BusConfig, tmp_path: Path) -> None:
    """A value run's actor writes two batches and the second is dead-lettered: no step covers it, yet the learner
    has read it, and ``rlpipe run`` must not wait for ever before it stops the learner."""
    topic = resolve_topic(bus_config.namespace, "trajectories")
    store = ObjectStore((tmp_path / "store").as_uri())
    actor = ValueActor(run_id="dqn", actor_id="a0", env=CartPole(), archive=TrajectoryArchive(store),
                       watcher=ValueNetworkWatcher(AdapterRegistry(store, "dqn"), tmp_path / "cache"),
                       config=ValueActorConfig(steps_per_batch=40))
    since = control_topic_ends(bus_config)  # the launch
    with EventPublisher(bus_config) as publisher:
        announce = Announcer(publisher, "dqn")
        refs = []
        for index in range(2):
            event = actor.write_batch()
            offset = announce(event)[1]
            sha256 = "0" * 64 if index == 1 else event.sha256  # the second's file does not match its event
            refs.append(BatchRef(event.batch_id, event.path, sha256, {f"{topic}:0": offset + 1}, event.producer_id))
        learner = ValueLearner(
            run_id="dqn", env_name="cartpole", observation_size=4, num_actions=2,
            config=ValueLearnerConfig(hidden_sizes=(8,), batch_size=8, min_replay_size=8, publish_every=1),
            archive=TrajectoryArchive(store), registry=AdapterRegistry(store, "dqn"),
            checkpoints=CheckpointStore(store, "dqn"), source=(source := OpenSource(refs)), announce=announce)
        idle = itertools.count()
        learner.run(should_stop=lambda: source.index >= 2 and next(idle) >= 3, poll_timeout_s=0.0)
        publisher.flush()
        assert learner.state.step == 1 and learner.dead_lettered == 1
    catch_up = LearnerCatchUp(bus_config, "dqn", since)
    try:
        assert settles_on(catch_up, True), "the learner read the dead-lettered batch, but is not seen to"
    finally:
        catch_up.close()
