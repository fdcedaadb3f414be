"""A learner while the broker is away: it goes on once the broker is back, and trains every batch once.

The embedded stack's broker keeps its log (and its groups' offsets) on the local S3 server, so stopping it and
starting it again on its port is an outage of the broker alone.  The learner reads through a real consumer group
and publishes with a 2 s wait for acknowledgements (30 s by default), so an outage of a few seconds outlasts it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from consumers.sources import KafkaSource, learner_group_id
from pipeline.devstack.gcs_emulator import free_port
from pipeline.devstack.stack import DevStack
from pipeline.io.archive import TrajectoryArchive, batch_committed_payload
from pipeline.io.bus import EventPublisher, group_lag
from pipeline.runtime import Announcer
from schemas.config import BusConfig
from tests.consumers import test_learner
from tests.consumers.test_learner import RUN, make_learner, write_batches
from tests.fixtures.kafka import FAST_GROUP

pytestmark = [pytest.mark.integration, pytest.mark.slow]

store, setup = test_learner.store, test_learner.setup  # a file store, the tiny model's prompt


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[DevStack]:
    """The embedded stack without the GCS emulator: a broker whose log outlives a stop."""
    started = DevStack(home=tmp_path / "home", kafka_port=free_port(), with_gcs=False).start()
    try:
        yield started
    finally:
        started.stop()


def announce_new(archive: TrajectoryArchive, announce: Announcer, known: set[str]) -> list[str]:
    """Announce the run's stored batches not announced yet; their ids."""
    ids = {key.rsplit("/", 1)[-1].removesuffix(".parquet"): key for key in sorted(archive.list_batches(RUN))}
    new = [batch_id for batch_id in ids if batch_id not in known]
    for batch_id in new:
        announce(batch_committed_payload(archive.describe_batch(ids[batch_id], RUN)))
    known.update(new)
    return new


def wait_for(condition, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_a_learner_goes_on_after_the_broker_was_away_and_trains_each_batch_once(
        stack: DevStack, store, setup) -> None:  # type: ignore[no-untyped-def]
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

    def train() -> None:
        try:
            learner.run(should_stop=stop.is_set, poll_timeout_s=0.5)
        except BaseException as exc:  # the assertion below names it
            errors.append(exc)

    announced: set[str] = set()
    write_batches(archive, setup, 2, np.random.default_rng(0))
    announce_new(archive, Announcer(producer_side, RUN), announced)
    thread = threading.Thread(target=train, name="learner")
    thread.start()
    try:
        wait_for(lambda: learner.state.step == 2 or bool(errors), 90, "the learner never trained its first batches")
        stack.broker.stop()
        time.sleep(8)  # waiting for rows while the broker is away: its progress announcements are refused
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
