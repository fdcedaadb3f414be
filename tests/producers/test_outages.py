"""A producer while the broker is away: the batches it stores meanwhile are announced once the broker is back.

The embedded stack's broker keeps its log on the local S3 server, so stopping and starting it again on its port is
an outage of the broker alone: the topics and their offsets are there when it comes back.  The publisher waits 2 s
for an acknowledgement here (30 s by default), so an outage of a few seconds outlasts it.
"""

from __future__ import annotations

import contextlib
import time
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pipeline.devstack.stack import DevStack
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.archive_layout import producer_batch_id
from pipeline.io.bus import EventPublisher, PublishError, tail
from pipeline.io.store import ObjectStore
from pipeline.runtime import Announcer
from producers.service import Heartbeat, RunProducer
from producers.sink import StoreThenEventSink
from schemas.config import BusConfig
from tests.fixtures import outages
from tests.pipeline.io.test_archive import two_rows

pytestmark = [pytest.mark.integration, pytest.mark.slow]

stack = outages.stack  # the fixture: the embedded stack, its broker one a test stops and starts

RUN = "away"


def on_log(bus: BusConfig) -> list[str]:
    """The batch ids the run's events name on ``<ns>.trajectories``, in log order, repeats kept."""
    return [record.event.payload.batch_id for record in tail(bus, "trajectories", n=100, run_id=RUN)
            if getattr(record.event.payload, "batch_id", None) is not None]


def store_batch(sink: StoreThenEventSink) -> str:
    batch_id = producer_batch_id("p0", datetime.now(UTC))
    sink.commit(two_rows(run_id=RUN, batch_id=batch_id, producer_id="p0"), batch_id)
    return batch_id


def test_batches_stored_while_the_broker_is_away_are_announced_once_it_is_back(
        stack: DevStack, tmp_path: Path) -> None:
    bus = BusConfig(bootstrap_servers=f"127.0.0.1:{stack.broker.port}", namespace="outage", connect_timeout_s=5.0)
    publisher = EventPublisher(bus, send_timeout_s=2.0)
    archive = TrajectoryArchive(ObjectStore(f"file://{tmp_path}/store"))
    sink = StoreThenEventSink(archive, RUN, "cartpole", "p0", Announcer(publisher, RUN))
    worker: Any = SimpleNamespace(producer_id="p0", stats=SimpleNamespace(samples=0, batches=0, tokens=0, env_steps=0,
                                                                          generate_s=0.0, dropped_groups=0,
                                                                          unplayable_groups=0))
    watcher: Any = SimpleNamespace(current=lambda: None)
    heartbeat = Heartbeat(worker, watcher, Announcer(publisher, RUN), interval_s=0.0)
    run: Any = RunProducer(worker, watcher, heartbeat, publisher, None, None, None, sink)  # type: ignore[arg-type]
    try:
        before = store_batch(sink)
        stack.broker.stop()
        during = [store_batch(sink), store_batch(sink)]  # stored; their events refused: the producer goes on
        assert [info.batch_id for info in sink.unannounced] == during
        run.tick()  # a heartbeat and a second try while the broker is still away: neither ends the producer
        assert [info.batch_id for info in sink.unannounced] == during
        stack.broker.start()
        deadline = time.monotonic() + 30
        while sink.unannounced:
            assert time.monotonic() < deadline, "the batches stored during the outage were never announced"
            run.tick()
            time.sleep(0.2)
        after = store_batch(sink)
        assert sorted(set(on_log(bus))) == sorted([before, *during, after])
        assert [info.batch_id for info in sink.committed] == [before, *during, after]
    finally:
        publisher.close()


def test_a_producer_stopping_with_batches_unannounced_says_so_in_one_line(stack: DevStack, tmp_path: Path) -> None:
    """Stopped while the broker is still away: the batches stay in the store, and the error names what announces
    them (the run's next producer start, ``producers.sink.OrphanSweep``)."""
    bus = BusConfig(bootstrap_servers=f"127.0.0.1:{stack.broker.port}", namespace="stopped", connect_timeout_s=5.0)
    publisher = EventPublisher(bus, send_timeout_s=2.0)
    archive = TrajectoryArchive(ObjectStore(f"file://{tmp_path}/store"))
    sink = StoreThenEventSink(archive, RUN, "cartpole", "p0", Announcer(publisher, RUN))
    stack.broker.stop()
    try:
        stored = store_batch(sink)
        with pytest.raises(PublishError) as unannounced:
            sink.finish()
        message = str(unannounced.value)
        assert "\n" not in message and f"1 batch of run {RUN}" in message
        assert f"rlpipe producer start --run {RUN}" in message
        assert archive.list_batches(RUN) and stored in archive.list_batches(RUN)[0]
    finally:
        with contextlib.suppress(PublishError):
            publisher.close(timeout_s=1.0)


def test_batches_stored_while_the_broker_refuses_wait_for_the_next_try_instead_of_each_waiting_out_the_publisher(
        memory_store: ObjectStore) -> None:
    """Each refused announcement waits out the publisher (30 s by default): while a try is not due, a new batch is
    stored and owed without another, so a broker outage does not cost every batch the publisher's wait."""
    tries: list[str] = []

    def refusing(payload: Any) -> None:
        tries.append(payload.batch_id)
        raise PublishError("publishing a TrajectoryBatchCommitted to ns.trajectories failed: no acknowledgement")

    sink = StoreThenEventSink(TrajectoryArchive(memory_store), "r", "cartpole", "p0", refusing,
                              retry_interval_s=3600.0)
    ids = [producer_batch_id("p0", datetime.now(UTC)) for _ in range(3)]
    for batch_id in ids:
        sink.commit(two_rows(batch_id=batch_id), batch_id)
    assert tries == ids[:1]  # one try; the next is due in an hour
    assert [event.batch_id for event in sink.unannounced] == ids
    sink.retry_at = 0.0  # the try is due
    sink.retry_due()
    assert tries == ids[:1] * 2
