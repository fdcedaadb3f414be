"""A learner while the broker is away: it goes on once the broker is back, and trains every batch once.

The embedded stack's broker keeps its log (and its groups' offsets) on the local S3 server, so stopping it and
starting it again on its port is an outage of the broker alone.  The learner reads through a real consumer group
and publishes with a 2 s wait for acknowledgements (30 s by default), so an outage of a few seconds outlasts it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from consumers.sources import KafkaSource, learner_group_id
from pipeline.devstack.stack import DevStack
from pipeline.io.archive import TrajectoryArchive, batch_committed_payload
from pipeline.io.bus import BusError, EventPublisher, group_lag, tail
from pipeline.runtime import Announcer
from schemas.config import BusConfig
from schemas.events import AdapterPublished, LearnerCheckpointed
from tests.consumers import test_learner
from tests.consumers.test_learner import RUN, make_learner, write_batches
from tests.fixtures import outages
from tests.fixtures.kafka import FAST_GROUP
from tests.fixtures.outages import BrokerAwayAt, logged, train_in_thread, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

stack = outages.stack  # the fixture: the embedded stack, its broker one a test stops and starts

store, setup = test_learner.store, test_learner.setup  # a file store, the tiny model's prompt


def announce_new(archive: TrajectoryArchive, announce: Announcer, known: set[str]) -> list[str]:
    """Announce the run's stored batches not announced yet; their ids."""
    ids = {key.rsplit("/", 1)[-1].removesuffix(".parquet"): key for key in sorted(archive.list_batches(RUN))}
    new = [batch_id for batch_id in ids if batch_id not in known]
    for batch_id in new:
        announce(batch_committed_payload(archive.describe_batch(ids[batch_id], RUN)))
    known.update(new)
    return new


def test_a_learner_goes_on_after_the_broker_was_away_and_trains_each_batch_once(
        stack: DevStack, store, setup, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.WARNING, logger="rlpipe.learner")
    bus = BusConfig(bootstrap_servers=f"127.0.0.1:{stack.broker.port}", namespace="outage", connect_timeout_s=5.0)
    archive = TrajectoryArchive(store)
    producer_side = EventPublisher(bus, send_timeout_s=20.0)  # its client reconnects within a few seconds
    learner_side = EventPublisher(bus, send_timeout_s=2.0, create_topics=False)
    learner, _ = make_learner(store, setup, max_steps=4)  # one 16-row batch a step
    learner.announce = learner.outputs.announce = Announcer(learner_side, RUN)
    learner.source = KafkaSource(bus, RUN, **FAST_GROUP)
    learner.resume()
    errors: list[BaseException] = []
    stop = threading.Event()
    learner.outputs.stopping = stop.is_set  # as the process's stop flag: a stop ends a wait for the broker

    def train() -> None:
        try:
            learner.run(should_stop=stop.is_set, poll_timeout_s=0.5)
        except BaseException as exc:  # the assertion below names it
            errors.append(exc)

    announced: set[str] = set()
    write_batches(archive, setup, 2, np.random.default_rng(0))
    announce_new(archive, Announcer(producer_side, RUN), announced)
    thread = threading.Thread(target=train, name="learner", daemon=True)  # never outlives the session
    thread.start()
    try:
        wait_for(lambda: learner.state.step == 2 or bool(errors), 90, "the learner never trained its first batches")
        stack.broker.stop()
        # waiting for rows while the broker is away: its progress announcements are refused
        wait_for(logged(caplog, "progress of step 2 not announced"), 60, "no progress announcement was refused")
        assert not errors, f"the learner ended during the outage: {errors[0]!r}"
        stack.broker.start()
        write_batches(archive, setup, 2, np.random.default_rng(1), first=2)
        announce_new(archive, Announcer(producer_side, RUN), announced)
        thread.join(90)
        assert not errors, f"the learner ended: {errors[0]!r}"
        assert not thread.is_alive(), "the learner never trained the batches announced after the outage"
    finally:
        stop.set()
        thread.join(60)
        producer_side.close()
        learner_side.close()
        learner.source.close()
    assert learner.state.step == 4 and set(learner.state.trained) == announced
    assert sorted(learner.state.trained.values()) == [1, 2, 3, 4]  # one batch a step, none twice
    (lag,) = group_lag(bus, learner_group_id(RUN))
    assert lag.committed == 4  # the last checkpoint's offsets, committed once the broker was back


# ---- the broker away while a step's writes are announced ----------------------------------------------------------

def announced_in_order(bus: BusConfig) -> tuple[list[int], list[int]]:
    """The versions ``AdapterPublished`` names and the steps ``LearnerCheckpointed`` names, in log order, each
    event once (by ``event_id``, as readers count them: a start announces its checkpoint and later versions again)."""
    events = [record.event for kind in ("adapters", "control") for record in tail(bus, kind, n=100, run_id=RUN)]
    seen: set = set()
    once = [event for event in events if event is not None and not (event.event_id in seen or seen.add(event.event_id))]
    versions = [event.payload.version for event in once if isinstance(event.payload, AdapterPublished)]
    steps = [event.payload.step for event in once if isinstance(event.payload, LearnerCheckpointed)]
    return versions, steps


def is_event(kind: type) -> Callable[..., bool]:
    return lambda payload: isinstance(payload, kind)


def learner_on_kafka(stack: DevStack, store, setup, namespace: str, max_steps: int):  # type: ignore[no-untyped-def]
    """A learner reading ``RUN`` from the stack's broker and announcing with a 2 s wait; its publisher and bus."""
    bus = BusConfig(bootstrap_servers=f"127.0.0.1:{stack.broker.port}", namespace=namespace, connect_timeout_s=5.0)
    learner_side = EventPublisher(bus, send_timeout_s=2.0)
    learner, _ = make_learner(store, setup, max_steps=max_steps)  # one 16-row batch a step
    learner.announce = learner.outputs.announce = Announcer(learner_side, RUN)
    learner.source = KafkaSource(bus, RUN, **FAST_GROUP)
    return learner, learner_side, bus


def stop_of(learner) -> threading.Event:  # type: ignore[no-untyped-def]
    """The learner's stop flag, as a process's SIGTERM sets it: it ends the loop and a wait for the broker."""
    stop = threading.Event()
    learner.outputs.stopping = stop.is_set
    return stop


# what the learner's wait names, by where the broker goes away (at step 2)
WAITED_FOR = {"AdapterPublished": "AdapterPublished v2 (step 2)",
              "LearnerCheckpointed": "LearnerCheckpointed of step 2 (its offsets not committed)",
              "commit": "the offsets of step 2's checkpoint"}


@pytest.mark.parametrize("where", sorted(WAITED_FOR))
def test_a_learner_waits_out_a_broker_outage_in_its_writes_and_announces_each_in_order(
        stack: DevStack, store, setup, where: str, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    """The broker goes away as step 2 announces its version, announces its checkpoint or commits its offsets: the
    learner waits (its training blocked by the step in flight), then announces and commits every step in order."""
    caplog.set_level(logging.WARNING, logger="rlpipe.learner")
    what = WAITED_FOR[where]
    learner, learner_side, bus = learner_on_kafka(stack, store, setup, f"writes-{where.lower()}", max_steps=4)
    archive = TrajectoryArchive(store)
    write_batches(archive, setup, 4, np.random.default_rng(0))
    with EventPublisher(bus, send_timeout_s=20.0) as producer_side:
        announced = set(announce_new(archive, Announcer(producer_side, RUN), set()))
    if where == "commit":
        away = BrokerAwayAt(stack, learner.source.commit, lambda positions: True, 2)
        learner.source.commit = away
    else:
        kind = AdapterPublished if where == "AdapterPublished" else LearnerCheckpointed
        away = BrokerAwayAt(stack, learner.outputs.announce, is_event(kind), 2)
        learner.outputs.announce = away
    learner.resume()
    errors: list[BaseException] = []
    stop = stop_of(learner)
    thread = train_in_thread(learner, stop, errors)
    try:
        assert away.stopped.wait(90), "the learner never reached step 2's writes"
        wait_for(logged(caplog, f"the broker did not take {what}"), 90, f"the broker never refused {what}")
        assert not errors, f"the learner ended during the outage: {errors[0]!r}"
        assert learner.state.step <= 3  # the next step waits for step 2's writes
        stack.broker.start()
        thread.join(90)
        assert not errors, f"the learner ended: {errors[0]!r}"
        assert not thread.is_alive(), "the learner never finished its steps after the outage"
    finally:
        stop.set()
        thread.join(60)
        learner_side.close()
        learner.source.close()
    assert logged(caplog, f"the broker took {what} after")(), "the wait never said it was over"
    assert learner.state.step == 4 and set(learner.state.trained) == announced
    assert sorted(learner.state.trained.values()) == [1, 2, 3, 4]
    versions, steps = announced_in_order(bus)
    assert versions == [1, 2, 3, 4] and steps == [1, 2, 3, 4]  # none skipped, none twice, in order
    (lag,) = group_lag(bus, learner_group_id(RUN))
    assert lag.committed == 4


# where the stop finds the learner: what the broker never took, the step the next start resumes from, the versions
# and checkpoints announced in the end (a step stopped before its checkpoint is trained and published again, as
# the next version; the next start announces the version or checkpoint the broker never took first)
STOPPED_AT = {
    "AdapterPublished": ("AdapterPublished v2 (step 2)", 1, [1, 2, 3, 4, 5], [1, 2, 3, 4]),
    "LearnerCheckpointed": ("LearnerCheckpointed of step 2", 2, [1, 2, 3, 4], [1, 2, 3, 4]),
}


@pytest.mark.parametrize("where", sorted(STOPPED_AT))
def test_a_learner_stopped_while_the_broker_is_away_says_what_was_not_announced_and_resumes_once(
        stack: DevStack, store, setup, where: str, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    """Stopped while step 2's version or checkpoint waits for the broker: it ends within bounded time with one line
    naming what was not announced; the next start, the broker back, resumes from the newest checkpoint (whether
    its event was announced or not), announcing first what the broker never took, and trains each batch once."""
    caplog.set_level(logging.WARNING, logger="rlpipe.learner")
    what, resumed_at, versions_announced, steps_announced = STOPPED_AT[where]
    learner, learner_side, bus = learner_on_kafka(stack, store, setup, f"stopped-{where.lower()}", max_steps=4)
    archive = TrajectoryArchive(store)
    write_batches(archive, setup, 4, np.random.default_rng(0))
    with EventPublisher(bus, send_timeout_s=20.0) as producer_side:
        announced = set(announce_new(archive, Announcer(producer_side, RUN), set()))
    kind = AdapterPublished if where == "AdapterPublished" else LearnerCheckpointed
    away = BrokerAwayAt(stack, learner.outputs.announce, is_event(kind), 2)
    learner.outputs.announce = away
    learner.resume()
    errors: list[BaseException] = []
    stop = stop_of(learner)
    thread = train_in_thread(learner, stop, errors)
    try:
        assert away.stopped.wait(90), "the learner never reached step 2's writes"
        wait_for(logged(caplog, f"the broker did not take {what}"), 90, f"the broker never refused {what}")
        assert not errors, f"the learner ended before it was stopped: {errors[0]!r}"
        stopped = time.monotonic()
        stop.set()
        thread.join(30)
        assert not thread.is_alive(), "a stop during the outage did not end the learner"
        assert time.monotonic() - stopped < 30
    finally:
        stop.set()
        thread.join(60)
        with contextlib.suppress(BusError):
            learner_side.close(timeout_s=1.0)
        learner.source.close()
    assert len(errors) == 1 and isinstance(errors[0], BusError), errors
    message = str(errors[0])
    assert "\n" not in message and f"never took {what}" in message
    assert "rlpipe learner start" in message and "once" in message
    stack.broker.start()
    again, again_side, _ = learner_on_kafka(stack, store, setup, f"stopped-{where.lower()}", max_steps=4)
    try:
        assert again.resume() and again.state.step == resumed_at
        again.run(poll_timeout_s=0.5)
    finally:
        again_side.close()
        again.source.close()
    assert again.state.step == 4 and set(again.state.trained) == announced
    assert sorted(again.state.trained.values()) == [1, 2, 3, 4]
    assert announced_in_order(bus) == (versions_announced, steps_announced)
    (lag,) = group_lag(bus, learner_group_id(RUN))
    assert lag.committed == 4
