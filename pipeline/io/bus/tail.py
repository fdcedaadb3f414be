"""``tail``: the last messages of a topic, then new ones, read without joining a group.

It never moves anyone's committed offsets; the command line's ``rlpipe topics tail``
and the report read the log through it.  Messages retention removes while they are
being read are skipped: the read goes on from the earliest one left and says so in
one warning.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kafka import KafkaConsumer, TopicPartition
from kafka.partitioner.default import murmur2

from pipeline.io.bus.admin import resolve_topic
from pipeline.io.bus.connection import _CLIENT_ID, _bus_errors, _connect, kafka_client_settings
from pipeline.io.bus.errors import BusError, UnknownTopicError
from pipeline.io.bus.records import _key_text, decode_record
from schemas.config import BusConfig
from schemas.events import Envelope, NewerEventTypeError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TailRecord:
    """A message as ``tail`` shows it: the event, or why it is not one."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: str | None
    event: Envelope | None
    error: str | None
    raw: bytes | None


def _tail_record(record: Any) -> TailRecord:
    try:
        event, error = decode_record(record)
    except NewerEventTypeError as exc:  # shown as it is, readers skip it
        event, error = None, str(exc)
    return TailRecord(
        topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        timestamp_ms=int(record.timestamp),
        key=_key_text(record.key),
        event=event,
        error=error,
        raw=record.value,
    )


def _matches_run(item: TailRecord, run_id: str | None) -> bool:
    if run_id is None:
        return True
    return (item.event.run_id if item.event is not None else item.key) == run_id


def tail(
    bus_config: BusConfig,
    kind_or_topic: str,
    n: int = 10,
    follow: bool = False,
    run_id: str | None = None,
    bootstrap_servers: str | None = None,
    follow_for_s: float | None = None,
    read_timeout_s: float = 10.0,
) -> Iterator[TailRecord]:
    """The last ``n`` messages of each partition (oldest first), then new ones as they arrive if ``follow``.

    Reads without joining a group (assign + seek to ``end - n``), so it never moves
    anyone's committed offsets.  With ``run_id``, only that run's messages are shown
    (undecodable ones by their key).  ``follow_for_s`` bounds following; None follows
    until the caller stops iterating.  The backlog is read completely however long it
    is (``n=10**9`` reads a whole topic); ``read_timeout_s`` is the longest wait for
    its next message before ``BusError`` says the read stalled.
    """
    if n < 0:
        raise ValueError(f"n must be zero or more, got {n}")
    topic = resolve_topic(bus_config.namespace, kind_or_topic)
    with _reader(bus_config, bootstrap_servers, "tail") as consumer:
        ends = _assign_last(consumer, topic, n)
        backlog, newer = _read_until(consumer, ends, idle_timeout_s=read_timeout_s)
        yield from (item for item in backlog if _matches_run(item, run_id))
        if follow:
            yield from (item for item in newer if _matches_run(item, run_id))
        stop_at = None if follow_for_s is None else time.monotonic() + follow_for_s
        while follow and (stop_at is None or time.monotonic() < stop_at):
            wait_ms = 500 if stop_at is None else max(0, min(500, int((stop_at - time.monotonic()) * 1000)))
            positions = {tp: consumer.position(tp) for tp in ends}
            batches = consumer.poll(timeout_ms=wait_ms)
            _note_removed(consumer, positions, batches)
            for records in batches.values():
                yield from (item for item in map(_tail_record, records) if _matches_run(item, run_id))


@contextlib.contextmanager
def _reader(bus_config: BusConfig, bootstrap_servers: str | None, what: str) -> Iterator[KafkaConsumer]:
    """A consumer outside any group (nothing committed), its errors one line each (``what`` names the read)."""
    settings = kafka_client_settings(bus_config, bootstrap_servers)
    settings |= {"client_id": f"{_CLIENT_ID}-tail", "group_id": None, "enable_auto_commit": False}
    settings |= {"allow_auto_create_topics": False, "request_timeout_ms": 30_000}
    # a position retention removed meanwhile goes on from the earliest message left (kafka-python's default,
    # latest, would skip to the end and return nothing of what is left)
    settings |= {"auto_offset_reset": "earliest"}
    consumer: KafkaConsumer = _connect(KafkaConsumer, bus_config, settings)
    try:
        with _bus_errors(bus_config, settings["bootstrap_servers"], what):
            yield consumer
    finally:
        consumer.close(autocommit=False, timeout_ms=2000)


@dataclass(frozen=True)
class RunLog:
    """What the log still holds of one run: its messages, and since when none can be missing.

    ``complete_since_ms`` is None when nothing ever aged out of the run's partition (its first
    offset is 0); else the time of its oldest retained message (now, when every one aged out).
    """

    records: list[TailRecord]
    complete_since_ms: int | None


def run_log(bus_config: BusConfig, kind_or_topic: str, run_id: str, read_timeout_s: float = 10.0) -> RunLog:
    """Every retained message of ``run_id`` on a topic, read from the one partition its key hashes to.

    Publishers key a run's events by its id, and kafka-python's default partitioner sends
    every one to ``murmur2(run_id) % partitions``; a topic whose partition count changed
    holds a run's older events on another partition as well (those are not read here).
    """
    topic = resolve_topic(bus_config.namespace, kind_or_topic)
    with _reader(bus_config, None, "read") as consumer:
        partitions = _partitions(consumer, topic)
        tp = TopicPartition(topic, partitions[(murmur2(run_id.encode()) & 0x7FFFFFFF) % len(partitions)])
        consumer.assign([tp])
        begin, end = int(consumer.beginning_offsets([tp])[tp]), int(consumer.end_offsets([tp])[tp])
        consumer.seek(tp, begin)
        backlog, _ = _read_until(consumer, {tp: end}, idle_timeout_s=read_timeout_s)
    since = complete_since_ms(begin, backlog, now_ms=int(time.time() * 1000))
    return RunLog([item for item in backlog if _matches_run(item, run_id)], since)


def complete_since_ms(first_offset: int, records: list[TailRecord], now_ms: int) -> int | None:
    """Since when a partition holds every message, from its first offset and the ``records`` it still holds:
    None when nothing aged out (offset 0), else the oldest record's time (``now_ms`` when none is left)."""
    if first_offset == 0:
        return None
    return min((item.timestamp_ms for item in records), default=now_ms)


def _assign_last(consumer: KafkaConsumer, topic: str, n: int) -> dict[TopicPartition, int]:
    """Assign every partition of ``topic`` positioned ``n`` before its end; returns the end offsets."""
    tps = [TopicPartition(topic, p) for p in _partitions(consumer, topic)]
    consumer.assign(tps)
    ends = consumer.end_offsets(tps)
    begins = consumer.beginning_offsets(tps)
    for tp in tps:
        consumer.seek(tp, max(int(begins[tp]), int(ends[tp]) - n))
    return {tp: int(ends[tp]) for tp in tps}


def _partitions(consumer: KafkaConsumer, topic: str) -> list[int]:
    """The partitions of ``topic``, in order (``UnknownTopicError`` when it does not exist)."""
    partitions = sorted(consumer.partitions_for_topic(topic) or ())
    if not partitions:
        raise UnknownTopicError(f"topic {topic} does not exist; see `rlpipe topics list`")
    return partitions


def _read_until(
    consumer: KafkaConsumer, ends: dict[TopicPartition, int], idle_timeout_s: float
) -> tuple[list[TailRecord], list[TailRecord]]:
    """Everything before ``ends`` ordered by time (then partition, offset), and what came after, in arrival order.

    Reads as long as messages keep coming; ``BusError`` if none arrive for ``idle_timeout_s`` while some are
    still missing, so a long topic is read completely and a stalled broker is reported instead of cut short.
    """
    backlog: list[TailRecord] = []
    newer: list[TailRecord] = []
    last_progress = time.monotonic()
    while any(consumer.position(tp) < end for tp, end in ends.items()):
        positions = {tp: consumer.position(tp) for tp in ends}
        batches = consumer.poll(timeout_ms=200)
        _note_removed(consumer, positions, batches)
        if batches:
            last_progress = time.monotonic()
        elif time.monotonic() - last_progress > idle_timeout_s:
            missing = sum(max(0, end - consumer.position(tp)) for tp, end in ends.items())
            raise BusError(f"reading stalled: no message for {idle_timeout_s:g}s with {missing} still to read")
        for tp, records in batches.items():
            for record in records:
                (backlog if record.offset < ends[tp] else newer).append(_tail_record(record))
    backlog.sort(key=lambda item: (item.timestamp_ms, item.partition, item.offset))
    return backlog, newer


def _note_removed(consumer: KafkaConsumer, positions: dict[TopicPartition, int],
                  batches: dict[TopicPartition, list[Any]]) -> None:
    """One warning per partition whose read jumped ahead of ``positions`` (where it stood before the poll that
    gave ``batches``): retention removed those messages before they were read."""
    for tp, before in positions.items():
        records = batches.get(tp)
        first = records[0].offset if records else consumer.position(tp)
        if first > before:
            log.warning("%s partition %d: offsets %d to %d were removed by retention before they were read; "
                        "reading on from offset %d, the earliest left", tp.topic, tp.partition, before, first - 1,
                        first)
