"""Consuming in a group: ``EventConsumer``, a group member that commits offsets only when told.

Offsets are committed after the work they stand for is durable.  Messages it
cannot decode or that do not belong on the topic go to ``<ns>.dlq`` as
``DeadLetter`` events and are skipped, so one poison message never blocks a topic.
A topic every run shares (a packed learner reads the trajectories topic once per run)
gets one dead letter per poison message and process: the other readers skip it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from kafka import KafkaConsumer, TopicPartition
from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.errors import AuthorizationError, CommitFailedError, KafkaError
from kafka.structs import OffsetAndMetadata

from pipeline.io.bus.admin import _check_event_belongs, ensure_topics, resolve_topic
from pipeline.io.bus.connection import _CLIENT_ID, _bus_errors, _connect, _describe, kafka_client_settings
from pipeline.io.bus.dead_letters import DEAD_LETTERED, dead_letter_run_id, poison_origin
from pipeline.io.bus.errors import BusError, CommitError, RewindError
from pipeline.io.bus.publisher import EventPublisher
from pipeline.io.bus.records import (
    ConsumedEvent,
    ConsumerStats,
    OffsetsLike,
    TopicPartitionKey,
    _key_text,
    decode_record,
    normalize_offsets,
)
from pipeline.topics import MAX_TOPIC_NAME_LENGTH, topic_kind, topic_name
from schemas.config import BusConfig
from schemas.events import DeadLetter, NewerEventError, NewerEventTypeError, encode_event, make_event
from schemas.names import validate_name

GROUP_TIMINGS_ENV = "RLPIPE_KAFKA_GROUP_TIMINGS_MS"  # consumer-group timings, JSON (group_timings_from_env)

log = logging.getLogger(__name__)

DEAD_LETTER_RAW_BYTES = 4096  # the start of a poison message (and of its key) kept in its DeadLetter
# How long keep_alive waits for a rejoin under way: longer than the broker holds a JoinGroup that every member has
# sent (Tansu, the dev stack's broker, about 3 s; Kafka's group.initial.rebalance.delay.ms, 3 s by default).  One it
# holds longer, for members yet to join, is waited on again by the next call.
KEEP_ALIVE_REJOIN_WAIT_S = 5.0


class _ApplyPendingSeeks(ConsumerRebalanceListener):
    """Seeks asked for before the group assigned a partition are applied when it is assigned."""

    def __init__(self, owner: EventConsumer) -> None:
        self.owner = owner

    def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        for tp in revoked:
            self.owner._polled.pop((tp.topic, tp.partition), None)

    def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        for tp in assigned:
            offset = self.owner._pending_seeks.pop((tp.topic, tp.partition), None)
            if offset is not None:
                self.owner._consumer.seek(tp, offset)


class EventConsumer:
    """A consumer-group member reading one topic kind (or topic), committing only on request.

    * ``poll`` returns decoded events.  Undecodable or misplaced messages are
      published to ``<ns>.dlq`` as ``DeadLetter`` (reason and origin) and skipped, once per process: another
      reader here that sent it already skips it (``stats.skipped_dead_lettered``), and a reader of a later
      process that reads it again (nothing committed past it) sends its letter under the same ``event_id``;
      events of other runs are skipped when ``run_id`` is given, as are event types
      that a newer minor version added.  All are counted in ``stats`` and covered by
      the next ``commit()``.  With ``refuse_newer``,
      an event from a newer rlpipe (of this reader's run, when ``run_id`` is given)
      raises ``NewerEventError`` instead, and nothing of that poll is consumed: for
      a reader that must not skip one, and can read it after an upgrade.
    * ``commit()`` commits everything polled so far; ``commit(offsets)`` commits the
      given next offsets (e.g. ``next_offsets(events)`` or a checkpoint's offsets);
      a group member commits only the partitions it owns at that moment.
    * ``seek`` positions partitions (applied on assignment if not yet assigned).
    * ``keep_alive`` polls with the partitions paused, so long work does not get
      the member dropped after ``max_poll_interval_ms``.
    * ``membership=False`` reads every partition of the topic without joining the
      group: no rebalances, and the group id only names the committed offsets
      (``commit``, ``committed``, ``lag`` and where reading starts).  For a reader
      that is the only one by other means, such as a learner holding its run's
      lease: group joins on the dev stack's broker can strand a group for good
      when a member goes away during a rebalance (see ``_finish_rebalance``).
      Partitions added to the topic later are not read.

    Not thread-safe (``KafkaConsumer`` is not): use one per thread.  Group timings
    default to Kafka's; tests make them small so joins and rebalances are quick.
    """

    def __init__(
        self,
        bus_config: BusConfig,
        kind: str,
        group_id: str,
        run_id: str | None = None,
        bootstrap_servers: str | None = None,
        auto_offset_reset: str = "earliest",
        session_timeout_ms: int = 45_000,
        heartbeat_interval_ms: int = 3_000,
        max_poll_interval_ms: int = 300_000,
        create_topics: bool = True,
        fetch_max_wait_ms: int = 500,
        membership: bool = True,
        refuse_newer: bool = False,
    ) -> None:
        if auto_offset_reset not in ("earliest", "latest"):
            raise ValueError(f"auto_offset_reset must be 'earliest' or 'latest', got {auto_offset_reset!r}")
        if not 0 < heartbeat_interval_ms < session_timeout_ms:
            raise ValueError("heartbeat_interval_ms must be positive and below session_timeout_ms")
        self.bus_config = bus_config
        self.topic = resolve_topic(bus_config.namespace, kind)
        self.kind = topic_kind(bus_config.namespace, self.topic)
        self.group_id = validate_name(group_id, "group_id", max_length=MAX_TOPIC_NAME_LENGTH)
        self.run_id = validate_name(run_id, "run_id") if run_id is not None else None
        self.dlq_topic = topic_name(bus_config.namespace, "dlq")
        self.stats = ConsumerStats()
        self._polled: dict[TopicPartitionKey, int] = {}
        self._pending_seeks: dict[TopicPartitionKey, int] = {}
        self._dlq: EventPublisher | None = None
        settings = kafka_client_settings(bus_config, bootstrap_servers)
        self._servers: list[str] = settings["bootstrap_servers"]
        if create_topics:
            kinds = {kind for kind in (self.kind, "dlq") if kind is not None}
            ensure_topics(bus_config, sorted(kinds), bootstrap_servers=",".join(self._servers))
        settings |= {
            "client_id": f"{_CLIENT_ID}-{self.group_id}",
            "group_id": self.group_id,
            "enable_auto_commit": False,
            "auto_offset_reset": auto_offset_reset,
            "session_timeout_ms": session_timeout_ms,
            "heartbeat_interval_ms": heartbeat_interval_ms,
            "max_poll_interval_ms": max_poll_interval_ms,
            "fetch_max_wait_ms": fetch_max_wait_ms,  # how long the broker may hold an empty fetch (and list: README)
            "request_timeout_ms": max(30_000, session_timeout_ms + 5_000),
            "allow_auto_create_topics": False,
        }
        self._timeout_ms = int(max(bus_config.connect_timeout_s, 5.0) * 1000)
        self._consumer: KafkaConsumer = _connect(KafkaConsumer, bus_config, settings)
        self.membership, self.refuse_newer = membership, refuse_newer
        if membership:
            self._consumer.subscribe([self.topic], listener=_ApplyPendingSeeks(self))
        else:  # every partition, no group membership: the group id only names the committed offsets
            self._consumer.assign(self._partitions_waiting())

    # -- reading ---------------------------------------------------------------------------------------------------

    def poll(self, timeout_s: float = 1.0, max_records: int | None = None) -> list[ConsumedEvent]:
        """The next events (possibly none after ``timeout_s``); poison messages are dead-lettered and skipped."""
        with self._errors("poll"):
            batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        events: list[ConsumedEvent] = []
        polled_before, stats_before = dict(self._polled), dataclasses.replace(self.stats)
        try:
            for tp, records in batches.items():
                for record in records:
                    item = self._accept(record)
                    self._polled[(tp.topic, tp.partition)] = record.offset + 1
                    if item is not None:
                        events.append(item)
        except BaseException:
            # Dead-lettering failed: the whole batch is delivered again by the next poll, so nothing is lost
            # (a dead letter already published may be published twice).
            self._polled, self.stats = polled_before, stats_before
            self._rewind(batches)
            raise
        return events

    def _accept(self, record: Any) -> ConsumedEvent | None:
        key = _key_text(record.key)
        try:
            event, error = decode_record(record, self.refuse_newer)
        except NewerEventTypeError as exc:
            self.stats.skipped_newer_types += 1
            log.info("skipped %s:%d@%d: %s", record.topic, record.partition, record.offset, exc)
            return None
        except NewerEventError as exc:
            if self.run_id is not None and isinstance(exc.run_id, str) and exc.run_id != self.run_id:
                self.stats.skipped_other_runs += 1  # another run's: its own readers stop on it
                return None
            raise  # this run's, or whose run cannot be told
        if event is None:
            return self._dead_letter(record, error or "undecodable message")
        wrong = _check_event_belongs(self.kind, self.topic, event.type)
        if wrong:
            return self._dead_letter(record, wrong)
        if self.run_id is not None and event.run_id != self.run_id:
            self.stats.skipped_other_runs += 1
            return None
        self.stats.delivered += 1
        return ConsumedEvent(topic=record.topic, partition=record.partition, offset=record.offset, key=key, event=event)

    def _dead_letter(self, record: Any, reason: str) -> None:
        # The key too is cut: it travels twice in a dead letter (as its key and in it), which must fit the
        # broker's message limit however large the poison message's key was, or every poll would fail on it.
        key_bytes = None if record.key is None else record.key[:DEAD_LETTER_RAW_BYTES]
        key = _key_text(key_bytes)
        if self.kind == "dlq":
            self.stats.skipped_invalid_dead_letters += 1
            log.warning("skipped invalid %s:%d@%d: %s", record.topic, record.partition, record.offset, reason)
            return None
        raw: bytes = record.value or b""
        origin = poison_origin(self._servers, record)
        letter = DeadLetter(
            reason=reason[:2000],
            origin_topic=record.topic,
            origin_partition=record.partition,
            origin_offset=record.offset,
            key=key,
            raw=raw[:DEAD_LETTER_RAW_BYTES].decode("utf-8", errors="replace"),
            raw_truncated=len(raw) > DEAD_LETTER_RAW_BYTES,
            # what tells this message from others at its offset, here and in the letter's id alike
            origin_timestamp_ms=origin.timestamp_ms,
            record_sha256=origin.sha256,
        )
        envelope = make_event(dead_letter_run_id(key, raw), letter)

        def publish() -> None:  # the publisher is made only by a reader that sends a dead letter
            self._dead_letter_publisher().publish_raw(self.dlq_topic, encode_event(envelope), key_bytes, "DeadLetter")

        if not DEAD_LETTERED.send_once(origin, publish):
            self.stats.skipped_dead_lettered += 1  # another reader in this process (another run's) sent it
            return None
        self.stats.dead_lettered += 1
        log.warning("dead-lettered %s:%d@%d: %s", record.topic, record.partition, record.offset, reason)
        return None

    def _dead_letter_publisher(self) -> EventPublisher:
        if self._dlq is None:
            self._dlq = EventPublisher(self.bus_config, bootstrap_servers=",".join(self._servers), create_topics=False)
        return self._dlq

    def _rewind(self, batches: Mapping[TopicPartition, list[Any]]) -> None:
        """Seek each partition back to the first record of ``batches`` so they are delivered again.

        A partition the group took away meanwhile is skipped: its next owner starts
        from the committed offset.  Any other failed seek raises ``RewindError``:
        the consumer would go on after the records it returned nothing for, and they
        would be skipped for good.
        """
        assigned = self._consumer.assignment()
        for tp, records in batches.items():
            if not records or tp not in assigned:
                continue
            try:
                self._consumer.seek(tp, records[0].offset)
            except Exception as exc:
                raise RewindError(
                    f"could not seek {tp.topic}:{tp.partition} back to offset {records[0].offset} ({_describe(exc)}); "
                    "records from there would be skipped: close this consumer and start a new one (it resumes from "
                    "the committed offset)"
                ) from exc

    # -- offsets -----------------------------------------------------------------------------------------------------

    def commit(self, offsets: OffsetsLike | None = None,
               timeout_s: float | None = None) -> dict[TopicPartitionKey, int]:
        """Commit next offsets (default: everything polled so far); returns what was committed.

        The client retries a retriable refusal, and waits for a coordinator it does not know, for up to
        ``timeout_s`` (default the consumer's own timeout, at least 5 s), then raises ``CommitError``
        (transient): a caller that must not block long (one packed run's turn) passes a short one.

        A group member commits only the partitions it owns now: the broker would take a commit for any
        partition, and one a rebalance gave to another member would lose that member's offsets.  The
        events of such a partition are delivered again to its owner.
        """
        to_commit = dict(self._polled) if offsets is None else normalize_offsets(offsets)
        if self.membership:
            owned = set(self.assignment())
            if not_owned := sorted(set(to_commit) - owned):
                log.warning("not committing %s for group %s: another member owns it now (its events are "
                            "delivered again there)", ", ".join(f"{t}:{p}" for t, p in not_owned), self.group_id)
            to_commit = {tp: offset for tp, offset in to_commit.items() if tp in owned}
        if not to_commit:
            return {}
        payload = {TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in to_commit.items()}
        try:
            timeout_ms = self._timeout_ms if timeout_s is None else max(1, int(timeout_s * 1000))
            self._consumer.commit(payload, timeout_ms=timeout_ms)
        except CommitFailedError as exc:
            raise CommitError(
                f"commit to group {self.group_id} failed: this member was dropped from the group (no poll within "
                "max_poll_interval_ms, or a rebalance); call keep_alive() during long work; the uncommitted "
                "events will be delivered again"
            ) from exc
        except KafkaError as exc:
            raise CommitError(f"commit to group {self.group_id} failed: {_describe(exc)}",
                              transient=not isinstance(exc, AuthorizationError)) from exc
        return to_commit

    def seek(self, offsets: OffsetsLike) -> None:
        """Read from the given offsets next; partitions not yet assigned are positioned when they are."""
        assigned = self._consumer.assignment()
        for (topic, partition), offset in normalize_offsets(offsets).items():
            tp = TopicPartition(topic, partition)
            self._polled.pop((topic, partition), None)
            if tp in assigned:
                self._consumer.seek(tp, offset)
            else:
                self._pending_seeks[(topic, partition)] = offset

    def assignment(self) -> list[TopicPartitionKey]:
        """The partitions this member owns now, sorted."""
        return sorted((tp.topic, tp.partition) for tp in self._consumer.assignment())

    def wait_for_assignment(self, timeout_s: float = 30.0) -> list[TopicPartitionKey]:
        """Take part in the group until it assigns partitions (records seen meanwhile are re-delivered)."""
        deadline = time.monotonic() + timeout_s
        while not self._consumer.assignment() and time.monotonic() < deadline:
            self._poll_without_consuming(timeout_ms=100)
        return self.assignment()

    @property
    def rebalancing(self) -> bool:
        """True while this member is rejoining its group (a rebalance it has not finished)."""
        return self.membership and bool(self._consumer._coordinator.rebalance_in_progress())  # kafka-python has no public view of it

    def positions(self) -> dict[TopicPartitionKey, int]:
        """The next offset this member will read, per assigned partition."""
        with self._errors("positions"):
            return {
                (tp.topic, tp.partition): int(self._consumer.position(tp, timeout_ms=self._timeout_ms))
                for tp in self._consumer.assignment()
            }

    def committed(self) -> dict[int, int | None]:
        """The group's committed next offset per partition of the topic (None where nothing is committed)."""
        with self._errors("committed offsets"):
            return {
                tp.partition: self._consumer.committed(tp, timeout_ms=self._timeout_ms) for tp in self._partitions()
            }

    def lag(self) -> dict[int, int]:
        """Per partition: end offset - committed offset (from the start of the log where nothing is committed)."""
        partitions = self._partitions()
        with self._errors("lag"):
            ends = self._consumer.end_offsets(partitions, timeout_ms=self._timeout_ms)
            begins = self._consumer.beginning_offsets(partitions, timeout_ms=self._timeout_ms)
            result = {}
            for tp in partitions:
                committed = self._consumer.committed(tp, timeout_ms=self._timeout_ms)
                start = committed if committed is not None else begins[tp]
                result[tp.partition] = max(0, int(ends[tp]) - int(start))
        return result

    def _partitions_waiting(self) -> list[TopicPartition]:
        """The topic's partitions, waiting (up to the connect timeout) for metadata of a topic just created."""
        deadline = time.monotonic() + self._timeout_ms / 1000
        while not (partitions := self._partitions()) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not partitions:
            raise BusError(f"topic {self.topic} has no partitions on the broker; create it (rlpipe topics create)")
        return partitions

    def _partitions(self) -> list[TopicPartition]:
        with self._errors("topic metadata"):
            partitions = self._consumer.partitions_for_topic(self.topic)
        return [TopicPartition(self.topic, p) for p in sorted(partitions or ())]

    # -- flow control --------------------------------------------------------------------------------------------------

    def pause(self) -> None:
        """Stop fetching from every assigned partition (the member stays in the group while it polls)."""
        self._consumer.pause(*self._consumer.assignment())

    def resume(self) -> None:
        """Fetch again from every assigned partition."""
        self._consumer.resume(*self._consumer.assignment())

    def keep_alive(self) -> None:
        """Poll once with every partition paused: call it during long work so the member is not dropped.

        Only a ``poll`` proves liveness to the group (``max_poll_interval_ms``); a
        paused poll returns no records, and anything a rebalance hands over
        meanwhile is rewound so it is delivered by the next ``poll``.

        It returns at once, except while the member rejoins its group: then it waits up to
        ``KEEP_ALIVE_REJOIN_WAIT_S`` for the rejoin to finish.  kafka-python finishes a rejoin only in a poll that
        is waiting when its SyncGroup answer arrives; one that arrived between polls is dropped and the next poll
        sends a new JoinGroup, so polls that never wait would keep the member rejoining (holding its old
        partitions, its commits refused) for as long as the work lasts.
        """
        already_paused = set(self._consumer.paused())
        self.pause()
        try:
            wait_ms = int(KEEP_ALIVE_REJOIN_WAIT_S * 1000) if self.rebalancing else 0
            self._poll_without_consuming(timeout_ms=wait_ms)
        finally:
            to_resume = set(self._consumer.assignment()) - already_paused
            if to_resume:
                self._consumer.resume(*to_resume)

    def _poll_without_consuming(self, timeout_ms: int) -> None:
        with self._errors("poll"):
            batches = self._consumer.poll(timeout_ms=timeout_ms)
        self._rewind(batches)

    # -- lifecycle ---------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        with _bus_errors(self.bus_config, self._servers, what):
            yield

    def close(self) -> None:
        """Leave the group (without committing) and close the clients; safe to call twice."""
        self._finish_rebalance()
        self._consumer.close(autocommit=False, timeout_ms=self._timeout_ms)
        if self._dlq is not None:
            self._dlq.close()
            self._dlq = None

    def _finish_rebalance(self) -> None:
        """Complete a rejoin still in flight (within the close timeout) so the member leaves a settled group.

        A ``poll`` that returns before its rejoin completes leaves the JoinGroup in flight; a LeaveGroup sent
        beside it lets Tansu, the dev stack's broker, finish that generation with the departed member as its
        leader, whose assignment never comes: the other members then rejoin that generation for ever.  Left
        after its SyncGroup, the member starts an ordinary rebalance (Kafka handles either order).
        """
        if not self.membership or self._consumer._closed or not self.rebalancing:  # no public view of either
            return
        try:
            self._consumer._coordinator.ensure_active_group(timeout_ms=self._timeout_ms)
        except KafkaError as exc:  # leave anyway: the group drops this member at its session timeout at worst
            log.warning("leaving group %s before its rebalance finished: %s", self.group_id, _describe(exc))

    def __enter__(self) -> EventConsumer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


_GROUP_TIMING_KEYS = ("session_timeout_ms", "heartbeat_interval_ms", "max_poll_interval_ms")


def group_timings_from_env() -> dict[str, int]:
    """Consumer-group timings from ``RLPIPE_KAFKA_GROUP_TIMINGS_MS`` (JSON), e.g. ``{"session_timeout_ms": 2000}``.

    Why: with Kafka's defaults (45 s session) the local Tansu broker takes about
    20 s to let a learner join, and about 80 s to let it rejoin after a SIGKILL
    (the dead member must time out first); short timings make both about a
    second, which crash tests and a laptop want.  Unset: Kafka's defaults.
    """
    raw = os.environ.get(GROUP_TIMINGS_ENV, "")
    if not raw:
        return {}
    try:
        timings: Any = json.loads(raw)
    except json.JSONDecodeError:
        timings = None
    if not isinstance(timings, dict) or not all(
        k in _GROUP_TIMING_KEYS and isinstance(v, int) and v > 0 for k, v in timings.items()
    ):
        raise ValueError(f"{GROUP_TIMINGS_ENV}={raw!r} must be a JSON object of positive integers with keys among "
                         f"{', '.join(_GROUP_TIMING_KEYS)}; fix or unset it")
    return timings
