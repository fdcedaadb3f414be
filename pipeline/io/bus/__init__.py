"""The event log: publish and consume rlpipe events on Kafka (kafka-python 3.x).

Everything that crosses between producers and the learner is an ``Envelope``
(``schemas.events``) on one of four topics under a namespace (``pipeline.topics``).
This package is the only place that talks to Kafka, so the rest of rlpipe never
sees a Kafka client, and every network call here has a bound:

* ``kafka_client_settings``: connection and security settings from ``BusConfig``
  (the password only ever lives in the client's settings; it prints as ``***``).
* ``EventPublisher``: the idempotent producer (``acks=all``, kafka-python 3.x
  defaults), one event per call, waiting for the broker's acknowledgement so a
  failure (an oversized message, a missing topic) surfaces as ``PublishError``
  instead of vanishing inside a future.  Retriable errors are retried a bounded
  number of times; ``event_id`` makes a duplicate harmless.
* ``EventConsumer``: a consumer-group member that commits offsets only when told
  (after the work they stand for is durable).  Messages it cannot decode or that
  do not belong on the topic go to ``<ns>.dlq`` as ``DeadLetter`` events and are
  skipped, so one poison message never blocks a topic.
* ``EventFollower``: a reader outside any group (assign + seek, no commits), for
  events every process must see without waiting for a group join (a producer
  following ``<ns>.adapters``, or its run's batches on ``<ns>.trajectories``).
* Admin helpers for the command line: topics, end offsets, group lag (and
  ``adopt_group_offsets``, for a renamed group), and a
  ``tail`` reader that does not join a group; ``run_log``, what the log still
  holds of one run (its partition only), and since when.

An unreachable broker (or one that refuses our credentials) raises
``BusUnavailableError`` with one line naming the fix within about
``bus.connect_timeout_s``, instead of hanging.

Modules, one concern each: ``errors``; ``connection`` (client settings, TLS/SASL,
probing and the bounded connect); ``admin`` (topic names and kinds, creating topics,
offsets and group lag); ``records`` (consumed events, offsets, record decoding);
``publisher``; ``consumer`` (the group member); ``follower``; ``tail``.  The names
other modules use are re-exported here: import them from ``pipeline.io.bus``.
"""

from pipeline.io.bus.admin import (
    TOPIC_EVENT_TYPES,
    PartitionInfo,
    PartitionLag,
    TopicInfo,
    admin_client,
    adopt_group_offsets,
    describe_topic,
    ensure_topics,
    group_lag,
    list_groups,
    list_topics,
    resolve_topic,
)
from pipeline.io.bus.connection import kafka_client_settings, parse_bootstrap_servers, redacted
from pipeline.io.bus.consumer import DEAD_LETTER_RAW_BYTES, GROUP_TIMINGS_ENV, EventConsumer, group_timings_from_env
from pipeline.io.bus.errors import (
    BusConfigError,
    BusError,
    BusUnavailableError,
    CommitError,
    PublishError,
    RewindError,
    UnknownTopicError,
    WrongEventTypeError,
)
from pipeline.io.bus.follower import EventFollower
from pipeline.io.bus.publisher import EventPublisher
from pipeline.io.bus.records import (
    ConsumedEvent,
    ConsumerStats,
    OffsetsLike,
    TopicPartitionKey,
    decode_record,
    next_offsets,
    normalize_offsets,
    offsets_as_strings,
)
from pipeline.io.bus.tail import RunLog, TailRecord, run_log, tail

__all__ = [
    "DEAD_LETTER_RAW_BYTES",
    "GROUP_TIMINGS_ENV",
    "TOPIC_EVENT_TYPES",
    "BusConfigError",
    "BusError",
    "BusUnavailableError",
    "CommitError",
    "ConsumedEvent",
    "ConsumerStats",
    "EventConsumer",
    "EventFollower",
    "EventPublisher",
    "OffsetsLike",
    "PartitionInfo",
    "PartitionLag",
    "PublishError",
    "RewindError",
    "RunLog",
    "TailRecord",
    "TopicInfo",
    "TopicPartitionKey",
    "UnknownTopicError",
    "WrongEventTypeError",
    "admin_client",
    "adopt_group_offsets",
    "decode_record",
    "describe_topic",
    "ensure_topics",
    "group_lag",
    "group_timings_from_env",
    "kafka_client_settings",
    "list_groups",
    "list_topics",
    "next_offsets",
    "normalize_offsets",
    "offsets_as_strings",
    "parse_bootstrap_servers",
    "redacted",
    "resolve_topic",
    "run_log",
    "tail",
    "topic_kind",
]
