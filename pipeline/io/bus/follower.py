"""Following a topic outside any group: ``EventFollower`` (assign + seek, no commits).

For events every process must see without waiting for a group join: a producer
following ``<ns>.adapters``, or its run's batches on ``<ns>.trajectories``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any

from kafka import KafkaConsumer, TopicPartition

from pipeline.io.bus.admin import _check_event_belongs, ensure_topics, resolve_topic
from pipeline.io.bus.connection import _CLIENT_ID, _bus_errors, _connect, kafka_client_settings
from pipeline.io.bus.errors import UnknownTopicError
from pipeline.io.bus.records import ConsumedEvent, ConsumerStats, TopicPartitionKey, _key_text, decode_record
from pipeline.topics import topic_kind
from schemas.config import BusConfig
from schemas.events import NewerEventTypeError
from schemas.names import validate_name

log = logging.getLogger(__name__)


class EventFollower:
    """Reads one topic kind (or topic) without joining a consumer group, and never commits.

    For reads where every process must see every event and no position needs to
    outlive the process: a producer following ``<ns>.adapters`` (on start it reads
    the registry itself), or counting its run's unconsumed batches on
    ``<ns>.trajectories``.  It is assigned every partition and positioned before
    the constructor returns (``start``: ``"latest"`` or ``"earliest"``; ``offsets``
    overrides that per partition; ``since_s``, unix seconds, places each partition at its
    first event published at or after that moment, its end when there is none), so every
    event published after construction (or since ``since_s``) is delivered.  Without a group there is no join: on the local broker a join takes
    3-25 s and is repeated after every rebalance, and kafka-python completes one only
    inside a poll that waits.  ``poll(0)`` never waits: it hands over what earlier
    fetches brought and starts the next, so a caller polling every pass of its loop
    sees an event within a pass or two of the broker's ``fetch_max_wait_ms`` (0.5 s).

    Events of other runs are skipped when ``run_id`` is given.  Undecodable or
    misplaced messages are skipped, logged and counted (``stats.skipped_invalid``),
    not dead-lettered: every follower sees every message, so each would publish the
    same dead letter.  Not thread-safe (``KafkaConsumer`` is not).
    """

    def __init__(
        self,
        bus_config: BusConfig,
        kind: str,
        run_id: str | None = None,
        start: str = "latest",
        offsets: Mapping[int, int] | None = None,
        bootstrap_servers: str | None = None,
        create_topics: bool = True,
        fetch_max_wait_ms: int = 500,
        since_s: float | None = None,
    ) -> None:
        if start not in ("earliest", "latest"):
            raise ValueError(f"start must be 'earliest' or 'latest', got {start!r}")
        if since_s is not None and not since_s >= 0:
            raise ValueError(f"since_s must be unix seconds (zero or more), got {since_s!r}")
        self.bus_config = bus_config
        self.topic = resolve_topic(bus_config.namespace, kind)
        self.kind = topic_kind(bus_config.namespace, self.topic)
        self.run_id = validate_name(run_id, "run_id") if run_id is not None else None
        self.stats = ConsumerStats()
        settings = kafka_client_settings(bus_config, bootstrap_servers)
        self._servers: list[str] = settings["bootstrap_servers"]
        if create_topics and self.kind is not None:
            ensure_topics(bus_config, [self.kind], bootstrap_servers=",".join(self._servers))
        settings |= {
            "client_id": f"{_CLIENT_ID}-follow",
            "group_id": None,
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest",  # an offset that fell out of the log restarts at its beginning
            "allow_auto_create_topics": False,
            "request_timeout_ms": 30_000,
            "fetch_max_wait_ms": fetch_max_wait_ms,  # how long the broker may hold an empty fetch (and list: README)
        }
        self._timeout_ms = int(max(bus_config.connect_timeout_s, 5.0) * 1000)
        self._consumer: KafkaConsumer = _connect(KafkaConsumer, bus_config, settings)
        try:
            with self._errors("assign"):
                self._assign(start, offsets or {}, since_s)
        except BaseException:
            self._consumer.close(autocommit=False, timeout_ms=2000)
            raise

    def _assign(self, start: str, offsets: Mapping[int, int], since_s: float | None = None) -> None:
        # A topic another process has just created may reach this client's metadata a moment later.
        deadline = time.monotonic() + self._timeout_ms / 1000
        while not (partitions := self._consumer.partitions_for_topic(self.topic)) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not partitions:
            raise UnknownTopicError(f"topic {self.topic} does not exist; see `rlpipe topics list`")
        tps = [TopicPartition(self.topic, p) for p in sorted(partitions)]
        self._consumer.assign(tps)
        found = {} if since_s is None else self._consumer.offsets_for_times({tp: int(since_s * 1000) for tp in tps})
        for tp in tps:
            if tp.partition in offsets:
                self._consumer.seek(tp, int(offsets[tp.partition]))
            elif since_s is not None:
                at = found.get(tp)
                # none published since (Tansu answers that with timestamp -1 and offset 0, not with None): the end
                if at is None or at.timestamp < 0:
                    self._consumer.seek_to_end(tp)
                else:
                    self._consumer.seek(tp, int(at.offset))
            elif start == "latest":
                self._consumer.seek_to_end(tp)
            else:
                self._consumer.seek_to_beginning(tp)
        for tp in tps:  # resolve "latest" now: what is published from here on is delivered
            self._consumer.position(tp, timeout_ms=self._timeout_ms)

    def poll(self, timeout_s: float = 0.0, max_records: int | None = None) -> list[ConsumedEvent]:
        """The next events of the run (possibly none); ``timeout_s`` 0 never waits."""
        with self._errors("poll"):
            batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        events: list[ConsumedEvent] = []
        for records in batches.values():
            for record in records:
                item = self._accept(record)
                if item is not None:
                    events.append(item)
        return events

    def _accept(self, record: Any) -> ConsumedEvent | None:
        try:
            event, reason = decode_record(record)
        except NewerEventTypeError as exc:
            self.stats.skipped_newer_types += 1
            log.info("skipped %s:%d@%d: %s", record.topic, record.partition, record.offset, exc)
            return None
        if event is not None:
            reason = _check_event_belongs(self.kind, self.topic, event.type)
        if reason is not None or event is None:
            self.stats.skipped_invalid += 1
            log.warning("skipped %s:%d@%d: %s", record.topic, record.partition, record.offset, reason)
            return None
        if self.run_id is not None and event.run_id != self.run_id:
            self.stats.skipped_other_runs += 1
            return None
        self.stats.delivered += 1
        return ConsumedEvent(topic=record.topic, partition=record.partition, offset=record.offset,
                             key=_key_text(record.key), event=event)

    def positions(self) -> dict[TopicPartitionKey, int]:
        """The next offset this follower will read, per partition."""
        with self._errors("positions"):
            return {
                (tp.topic, tp.partition): int(self._consumer.position(tp, timeout_ms=self._timeout_ms))
                for tp in self._consumer.assignment()
            }

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        with _bus_errors(self.bus_config, self._servers, what):
            yield

    def close(self) -> None:
        """Close the client; safe to call twice."""
        self._consumer.close(autocommit=False, timeout_ms=2000)

    def __enter__(self) -> EventFollower:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
