"""``LearnerCatchUp`` on the real broker: whether a run's learner has read every batch announced for it."""

from __future__ import annotations

import time

from pipeline.devstack.catch_up import LearnerCatchUp
from pipeline.io.bus import EventPublisher, resolve_topic
from pipeline.runtime import Announcer
from schemas.config import BusConfig
from schemas.events import LearnerProgress
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
    learner only after a step)."""
    topic = resolve_topic(bus_config.namespace, "trajectories")
    since = time.time()
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
    catch_up = LearnerCatchUp(bus_config, "empty", time.time())
    try:
        assert settles_on(catch_up, True)
    finally:
        catch_up.close()
