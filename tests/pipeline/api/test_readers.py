"""The API's readers of the log keep reading when the broker's store lists slowly.

Tansu with object storage lists a partition's record batches on every fetch that
finds data, and stops listing when the fetch's wait (``fetch_max_wait_ms``) runs
out: it then answers as if nothing new were there.  A reader whose wait is
shorter than a listing sees nothing, for as long as the listing stays slower
(a long log, a remote store).  Here the store holds every listing 80 ms.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from pipeline.api import results
from pipeline.api.engines import request_reader
from pipeline.api.results import ResultSignals
from pipeline.devstack.broker import TansuBroker
from pipeline.devstack.s3_server import LocalS3Server
from pipeline.io.bus import EventPublisher
from schemas.api import ApiRequestAccepted, ApiResultReady
from schemas.config import BusConfig
from schemas.events import make_event
from tests.fixtures.kafka import FAST_GROUP

LISTING_DELAY_S = 0.08


@pytest.fixture(scope="module")
def slow_listing_bus() -> Iterator[BusConfig]:
    """A Tansu broker keeping its log on the local S3 server, whose listings take 80 ms."""
    with LocalS3Server(listing_delay_s=LISTING_DELAY_S) as s3:
        broker = TansuBroker(storage_engine=s3.storage_url(), environment=s3.broker_environment())
        with broker:
            yield BusConfig(bootstrap_servers=broker.bootstrap_servers, namespace=f"t{uuid.uuid4().hex[:12]}",
                            connect_timeout_s=5.0)


def call(n: int) -> ApiRequestAccepted:
    return ApiRequestAccepted(request_id=f"sess-1.sample.{n}", tenant="alice", session_id="sess-1", op="sample",
                              model_id="sess-1.sample", seq_id=n, body_path=f"sessions/sess-1/requests/{n}.json",
                              body_sha256="0" * 64)


def test_an_engine_reads_each_call_while_listings_take_longer_than_a_short_fetch_wait(slow_listing_bus) -> None:
    reader = request_reader(slow_listing_bus, "api-sampler-test", FAST_GROUP)
    try:
        with EventPublisher(slow_listing_bus) as publisher:
            seen: list[str] = []
            for n in range(1, 4):
                publisher.publish("requests", make_event("sess-1", call(n)), key="sess-1.sample")
                deadline = time.monotonic() + 15
                while len(seen) < n and time.monotonic() < deadline:
                    seen += [e.event.payload.request_id for e in reader.poll(timeout_s=0.5)]
                assert seen == [f"sess-1.sample.{m}" for m in range(1, n + 1)], f"call {n} was not read in 15 s"
    finally:
        reader.close()


def test_a_waiting_poll_is_woken_by_its_result_while_listings_are_slow(slow_listing_bus, monkeypatch) -> None:
    positioned = threading.Event()

    class TellingFollower(results.EventFollower):
        """The follower, telling when it has fixed where it starts (the end of the log, before it returns)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            positioned.set()

    monkeypatch.setattr(results, "EventFollower", TellingFollower)
    signals, stopped = ResultSignals(), threading.Event()
    follower = signals.follow(slow_listing_bus, stopped.is_set)
    # the result is published after that: published earlier, it is behind where the follower starts
    assert positioned.wait(60.0), "the results follower never started"

    async def wait_for_result() -> float:
        with signals.watch("sess-1.sample.7") as woken, EventPublisher(slow_listing_bus) as publisher:
            ready = ApiResultReady(request_id="sess-1.sample.7", session_id="sess-1", op="sample", ok=True,
                                   result_path="sessions/sess-1/results/7.pb", result_format="pb",
                                   result_sha256="0" * 64)
            started = time.monotonic()
            publisher.publish("results", make_event("sess-1", ready), key="sess-1.sample")
            await asyncio.wait_for(woken.wait(), timeout=10)
            return time.monotonic() - started

    try:
        assert asyncio.run(wait_for_result()) < 5.0
    finally:
        stopped.set()
        follower.join(timeout=5)
