"""The event log: publish and consume rlpipe events on Kafka (kafka-python 3.x).

Everything that crosses between producers and the learner is an ``Envelope``
(``schemas.events``) on one of four topics under a namespace (``pipeline.topics``).
This module is the only place that talks to Kafka, so the rest of rlpipe never
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
* Admin helpers for the command line: topics, end offsets, group lag, and a
  ``tail`` reader that does not join a group.

An unreachable broker (or one that refuses our credentials) raises
``BusUnavailableError`` with one line naming the fix within about
``bus.connect_timeout_s``, instead of hanging.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import socket
import ssl
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import OffsetSpec
from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.errors import (
    CommitFailedError,
    KafkaConnectionError,
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    NodeNotReadyError,
)
from kafka.structs import OffsetAndMetadata
from tenacity import Retrying, retry_if_exception, stop_after_attempt, stop_after_delay, wait_exponential

from pipeline.topics import TOPIC_KINDS, TopicKind, topic_name
from schemas.config import BusConfig
from schemas.events import DeadLetter, Envelope, EventDecodeError, decode_event, encode_event, make_event
from schemas.names import InvalidNameError, validate_name

GROUP_TIMINGS_ENV = "RLPIPE_KAFKA_GROUP_TIMINGS_MS"  # consumer-group timings, JSON (consumers.sources)

log = logging.getLogger(__name__)

# Which event types belong on which topic; None = any known type (control is open-ended).
TOPIC_EVENT_TYPES: dict[TopicKind, frozenset[str] | None] = {
    "trajectories": frozenset({"TrajectoryBatchCommitted"}),
    "adapters": frozenset({"AdapterPublished"}),
    "control": None,
    "dlq": frozenset({"DeadLetter"}),
}
DEAD_LETTER_RAW_BYTES = 4096  # the start of a poison message kept in its DeadLetter
_UNKNOWN_RUN = "unknown"
_CLIENT_ID = "rlpipe"

TopicPartitionKey = tuple[str, int]  # (topic, partition)
OffsetsLike = Mapping[TopicPartitionKey, int] | Mapping[str, int]  # also "topic:partition" keys, as in checkpoints


class BusError(RuntimeError):
    """Talking to the event log failed; the message says why and what to do."""


class BusUnavailableError(BusError):
    """The broker cannot be reached (or refuses the connection) within the connect timeout."""


class PublishError(BusError):
    """The broker did not accept an event."""


class RewindError(BusError):
    """Records a consumer fetched could not be put back: going on would skip them."""


class CommitError(BusError):
    """Consumer offsets could not be committed (the events will be delivered again)."""


class BusConfigError(ValueError):
    """A bus setting that cannot work (bad address, missing password file)."""


class UnknownTopicError(ValueError):
    """A topic that does not exist, or a name that is neither a topic kind nor a topic."""


class WrongEventTypeError(ValueError):
    """An event published to a topic it does not belong on."""


# ---------------------------------------------------------------------------------------------------------------------
# Settings and connecting


class _Redacted(str):
    """A string that prints as ``***``: kafka-python logs its whole configuration at debug level."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "'***'"


def parse_bootstrap_servers(servers: str) -> list[str]:
    """``"a:9092, b:9092"`` -> ``["a:9092", "b:9092"]``; a clear error for anything that is not host:port."""
    parsed = [item.strip() for item in servers.split(",") if item.strip()]
    if not parsed:
        raise BusConfigError("bus.bootstrap_servers is empty; set it to host:port or start a broker with `rlpipe up`")
    for item in parsed:
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise BusConfigError(f"bus.bootstrap_servers entry {item!r} is not host:port (e.g. localhost:9092)")
    return parsed


def _sasl_password(bus_config: BusConfig) -> str:
    if bus_config.sasl_password is not None and bus_config.sasl_password_file:
        raise BusConfigError("set only one of bus.sasl_password and bus.sasl_password_file")
    if bus_config.sasl_password is not None:
        return bus_config.sasl_password.get_secret_value()
    if not bus_config.sasl_password_file:
        raise BusConfigError(
            f"bus.sasl_mechanism {bus_config.sasl_mechanism} needs a password: set bus.sasl_password "
            "or bus.sasl_password_file"
        )
    path = Path(bus_config.sasl_password_file).expanduser()
    try:
        return path.read_text().strip("\r\n")
    except OSError as exc:
        raise BusConfigError(f"cannot read bus.sasl_password_file {str(path)!r}: {exc.strerror}") from None


def kafka_client_settings(bus_config: BusConfig, bootstrap_servers: str | None = None) -> dict[str, Any]:
    """Connection settings shared by every kafka-python client, from ``bus_config``.

    ``bootstrap_servers`` overrides the config; when both are empty the embedded
    stack's broker (``rlpipe up``) is used.  The SASL password comes from
    ``sasl_password`` or ``sasl_password_file`` and prints as ``***``.
    """
    if bootstrap_servers is None:
        from pipeline.stack import resolve_bootstrap_servers  # the stack imports nothing from here

        bootstrap_servers = resolve_bootstrap_servers(bus_config)
    settings: dict[str, Any] = {
        "bootstrap_servers": parse_bootstrap_servers(bootstrap_servers),
        "security_protocol": bus_config.security_protocol,
        "bootstrap_timeout_ms": int(bus_config.connect_timeout_s * 1000),
        "reconnect_backoff_max_ms": 5000,  # kafka-python's 30 s would keep a restarted broker waiting
    }
    if bus_config.security_protocol.startswith("SASL"):
        settings["sasl_mechanism"] = bus_config.sasl_mechanism
        settings["sasl_plain_username"] = bus_config.sasl_username
        settings["sasl_plain_password"] = _Redacted(_sasl_password(bus_config))
    if bus_config.ssl_cafile:
        cafile = Path(bus_config.ssl_cafile).expanduser()
        if not cafile.is_file():
            raise BusConfigError(f"bus.ssl_cafile {str(cafile)!r} does not exist")
        settings["ssl_cafile"] = str(cafile)
    return settings


def redacted(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` safe to log or print: the password replaced by ``***``."""
    return {k: ("***" if "password" in k and v is not None else v) for k, v in settings.items()}


def _unavailable(servers: Iterable[str], timeout_s: float, reason: str) -> BusUnavailableError:
    where = ",".join(servers)
    reason = reason.splitlines()[0] if reason else "no answer"
    if re.search(r"sasl|authenticat|authoriz", reason, re.IGNORECASE):
        hint = "check bus.security_protocol, bus.sasl_mechanism, bus.sasl_username and the password"
    else:
        hint = "start one with `rlpipe up` or set bus.bootstrap_servers"
    return BusUnavailableError(f"cannot reach Kafka at {where} within {timeout_s:g}s: {reason}; {hint}")


def _describe(exc: BaseException) -> str:
    """``Name: message`` on one line (kafka-python's errors already start with their name)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    name = type(exc).__name__
    return text if text.startswith(name) else f"{name}: {text}".rstrip(": ")


def _probe(server: str, protocol: str, cafile: str | None, timeout_s: float) -> str | None:
    """Open a TCP (and TLS) connection to ``server``; None if it works, else the reason.

    kafka-python's own TLS handshake has no deadline: a TLS client talking to a
    plaintext listener waits forever.  Probing first with our own deadline turns
    that, and a refused or silent port, into a prompt and specific reason.
    """
    host, _, port = server.rpartition(":")
    host = host.strip("[]")
    try:
        sock = socket.create_connection((host, int(port)), timeout=max(timeout_s, 0.05))
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__
    with sock:
        if protocol not in ("SSL", "SASL_SSL"):
            return None
        context = ssl.create_default_context(cafile=cafile)
        try:
            with context.wrap_socket(sock, server_hostname=host):
                return None
        except (OSError, ssl.SSLError) as exc:
            return f"TLS handshake failed: {exc}"


def _first_unreachable_reason(servers: list[str], protocol: str, cafile: str | None, deadline: float) -> str | None:
    """None as soon as one server accepts a connection, else why the last one did not (all within ``deadline``)."""
    reason = "no answer"
    for server in servers:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        reason = _probe(server, protocol, cafile, remaining) or ""
        if not reason:
            return None
    return reason


class _KafkaReasons(logging.Handler):
    """Collects why kafka-python's bootstrap failed; it logs the reason and raises a bare timeout."""

    _FAILED = re.compile(r"(?:failed|Connection lost):\s*(.+?)(?:\s+\(backoff [^)]*\))?$")

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.last: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            match = self._FAILED.search(record.getMessage())
            if match and "Unable to bootstrap" not in match.group(1):  # the bare timeout that follows the reasons
                self.last = match.group(1)


ClientT = TypeVar("ClientT")


def _connect(factory: Callable[..., ClientT], bus_config: BusConfig, settings: dict[str, Any]) -> ClientT:
    """Build a kafka-python client, or raise ``BusUnavailableError`` within about ``connect_timeout_s``."""
    servers: list[str] = settings["bootstrap_servers"]
    timeout_s = bus_config.connect_timeout_s
    deadline = time.monotonic() + timeout_s
    reason = _first_unreachable_reason(servers, settings["security_protocol"], settings.get("ssl_cafile"), deadline)
    if reason is not None:
        raise _unavailable(servers, timeout_s, reason)
    remaining_ms = max(500, int((deadline - time.monotonic()) * 1000))
    handler = _KafkaReasons()
    kafka_logger = logging.getLogger("kafka")
    kafka_logger.addHandler(handler)
    try:
        return factory(**{**settings, "bootstrap_timeout_ms": remaining_ms})
    except KafkaError as exc:
        if not exc.retriable:
            raise
        raise _unavailable(servers, timeout_s, handler.last or _describe(exc)) from None
    finally:
        kafka_logger.removeHandler(handler)


@contextlib.contextmanager
def _bus_errors(bus_config: BusConfig, servers: Iterable[str], what: str) -> Iterator[None]:
    """Turn a timeout or lost connection during ``what`` into one ``BusUnavailableError`` line."""
    try:
        yield
    except (KafkaTimeoutError, KafkaConnectionError, NodeNotReadyError) as exc:
        raise _unavailable(servers, bus_config.connect_timeout_s, f"{what}: {type(exc).__name__}") from exc
    except KafkaError as exc:
        raise BusError(f"{what} failed: {_describe(exc)}") from exc


# ---------------------------------------------------------------------------------------------------------------------
# Topics


def resolve_topic(namespace: str, kind_or_topic: str) -> str:
    """A topic kind (``control``) becomes ``<namespace>.control``; a full topic name is kept."""
    if kind_or_topic in TOPIC_KINDS:
        return topic_name(namespace, kind_or_topic)  # type: ignore[arg-type]  # checked just above
    try:
        validate_name(kind_or_topic, "topic")
    except InvalidNameError as exc:
        raise UnknownTopicError(str(exc)) from None
    if "." not in kind_or_topic:
        raise UnknownTopicError(
            f"{kind_or_topic!r} is neither a topic kind ({', '.join(TOPIC_KINDS)}) "
            f"nor a full topic name such as {namespace}.control"
        )
    return kind_or_topic


def topic_kind(namespace: str, topic: str) -> TopicKind | None:
    """The kind of ``topic`` under ``namespace``, or None for any other topic."""
    for kind in TOPIC_KINDS:
        if topic == f"{namespace}.{kind}":
            return kind
    return None


def _check_event_belongs(kind: TopicKind | None, topic: str, event_type: str) -> str | None:
    """None if ``event_type`` may travel on ``topic``, else the reason."""
    allowed = TOPIC_EVENT_TYPES.get(kind) if kind is not None else None
    if allowed is None or event_type in allowed:
        return None
    return f"a {event_type} event does not belong on {topic} (expected {', '.join(sorted(allowed))})"


def _admin_settings(bus_config: BusConfig, bootstrap_servers: str | None) -> dict[str, Any]:
    settings = kafka_client_settings(bus_config, bootstrap_servers)
    settings["request_timeout_ms"] = int(max(bus_config.connect_timeout_s, 5.0) * 1000)
    settings["client_id"] = f"{_CLIENT_ID}-admin"
    return settings


@contextlib.contextmanager
def admin_client(bus_config: BusConfig, bootstrap_servers: str | None = None) -> Iterator[KafkaAdminClient]:
    """A connected ``KafkaAdminClient`` with bounded timeouts, closed on exit."""
    settings = _admin_settings(bus_config, bootstrap_servers)
    admin = _connect(KafkaAdminClient, bus_config, settings)
    try:
        with _bus_errors(bus_config, settings["bootstrap_servers"], "admin request"):
            yield admin
    finally:
        admin.close()


def ensure_topics(
    bus_config: BusConfig,
    kinds: Iterable[TopicKind] = TOPIC_KINDS,
    bootstrap_servers: str | None = None,
) -> list[str]:
    """Create the missing topics of ``kinds`` under the namespace; returns the ones created.

    Idempotent: existing topics are left as they are (also when another process
    creates one at the same moment).  Partitions and replicas come from
    ``bus.topic_partitions`` and ``bus.replication_factor``.
    """
    wanted = [topic_name(bus_config.namespace, kind) for kind in kinds]
    with admin_client(bus_config, bootstrap_servers) as admin:
        missing = [topic for topic in wanted if topic not in set(admin.list_topics())]
        if not missing:
            return []
        spec = {"num_partitions": bus_config.topic_partitions, "replication_factor": bus_config.replication_factor}
        response = admin.create_topics({topic: dict(spec) for topic in missing}, raise_errors=False)
        created = []
        for result in response["topics"]:
            if result["error_code"] == 0:
                created.append(result["name"])
            elif result["error_code"] != 36:  # 36 TOPIC_ALREADY_EXISTS: someone else was faster
                why = result["error_message"] or result["error_code"]
                raise BusError(f"cannot create topic {result['name']}: {why}")
        admin.wait_for_topics(created, timeout_ms=int(bus_config.connect_timeout_s * 1000))
        log.info("created topics %s", ", ".join(created))
        return created


# ---------------------------------------------------------------------------------------------------------------------
# Publishing


def _is_retriable(exc: BaseException) -> bool:
    return isinstance(exc, KafkaError) and bool(exc.retriable)


class EventPublisher:
    """Publishes events to the topics of ``bus_config.namespace`` and waits for each acknowledgement.

    ``publish`` returns ``(partition, offset)`` once the broker has the event
    (``acks=all``, idempotent: kafka-python 3.x defaults).  The key defaults to the
    event's ``run_id`` so one run's events stay in order on one partition.
    ``create_topics=True`` creates the namespace's topics first if they are missing.
    Thread-safe (``KafkaProducer`` is).
    """

    def __init__(
        self,
        bus_config: BusConfig,
        bootstrap_servers: str | None = None,
        create_topics: bool = True,
        send_timeout_s: float = 30.0,
        retry_attempts: int = 3,
    ) -> None:
        if send_timeout_s <= 0:
            raise ValueError(f"send_timeout_s must be positive, got {send_timeout_s}")
        if retry_attempts < 1:
            raise ValueError(f"retry_attempts must be at least 1, got {retry_attempts}")
        self.bus_config = bus_config
        self.send_timeout_s = send_timeout_s
        self.retry_attempts = retry_attempts
        settings = kafka_client_settings(bus_config, bootstrap_servers)
        self._servers: list[str] = settings["bootstrap_servers"]
        if create_topics:
            ensure_topics(bus_config, bootstrap_servers=",".join(self._servers))
        delivery_ms = int(send_timeout_s * 1000)
        settings |= {
            "client_id": f"{_CLIENT_ID}-publisher",
            "delivery_timeout_ms": delivery_ms,
            "request_timeout_ms": max(1000, delivery_ms // 2),
            "max_block_ms": int(bus_config.connect_timeout_s * 1000),
        }
        self._producer: KafkaProducer = _connect(KafkaProducer, bus_config, settings)

    def publish(self, kind_or_topic: str, event: Envelope, key: str | None = None) -> tuple[int, int]:
        """Publish ``event`` to a topic kind (``control``) or full topic name; returns (partition, offset)."""
        topic = resolve_topic(self.bus_config.namespace, kind_or_topic)
        wrong = _check_event_belongs(topic_kind(self.bus_config.namespace, topic), topic, event.type)
        if wrong:
            raise WrongEventTypeError(wrong)
        return self.publish_raw(topic, encode_event(event), key if key is not None else event.run_id, event.type)

    def publish_raw(
        self, topic: str, value: bytes | None, key: str | bytes | None, what: str = "message"
    ) -> tuple[int, int]:
        """Publish bytes exactly as given (dead letters, replays, tests); returns (partition, offset)."""
        key_bytes = key.encode() if isinstance(key, str) else key
        retrying = Retrying(
            retry=retry_if_exception(_is_retriable),
            stop=stop_after_attempt(self.retry_attempts) | stop_after_delay(self.send_timeout_s),
            wait=wait_exponential(multiplier=0.2, max=2.0),
            reraise=True,
        )
        try:
            for attempt in retrying:
                with attempt:
                    future = self._producer.send(topic, value=value, key=key_bytes)
                    metadata = future.get(timeout=self.send_timeout_s + 5)
        except MessageSizeTooLargeError as exc:
            raise PublishError(
                f"publishing a {what} of {len(value or b'')} bytes to {topic} failed: it exceeds the message size limit "
                "(1 MiB by default); keep bulk data in the store and publish a claim check"
            ) from exc
        except KafkaError as exc:
            raise PublishError(f"publishing a {what} to {topic} failed: {_describe(exc)}") from exc
        return int(metadata.partition), int(metadata.offset)

    def flush(self, timeout_s: float | None = None) -> None:
        """Send everything buffered and wait for it (``publish`` already waits for its own event)."""
        self._producer.flush(timeout=timeout_s if timeout_s is not None else self.send_timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Flush and close the producer; safe to call twice."""
        self._producer.close(timeout=timeout_s)

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------------------------------
# Consuming


@dataclass(frozen=True, slots=True)
class ConsumedEvent:
    """One decoded event and where it came from (its ``offset + 1`` is what to commit)."""

    topic: str
    partition: int
    offset: int
    key: str | None
    event: Envelope


@dataclass(slots=True)
class ConsumerStats:
    """What a consumer did with the messages it saw (skipped ones are counted, never silent)."""

    delivered: int = 0
    dead_lettered: int = 0
    skipped_other_runs: int = 0
    skipped_invalid_dead_letters: int = 0  # undecodable messages on the DLQ itself are not re-queued
    skipped_invalid: int = 0  # undecodable or misplaced messages an ``EventFollower`` skipped


def _tp_key(key: TopicPartitionKey | str) -> TopicPartitionKey:
    if isinstance(key, str):
        topic, sep, partition = key.rpartition(":")
        if not sep or not partition.isdigit():
            raise ValueError(f"offset key {key!r} is not 'topic:partition'")
        return topic, int(partition)
    topic, partition = key
    return str(topic), int(partition)


def normalize_offsets(offsets: OffsetsLike) -> dict[TopicPartitionKey, int]:
    """Offsets keyed by ``(topic, partition)`` or ``"topic:partition"`` -> ``{(topic, partition): offset}``."""
    result: dict[TopicPartitionKey, int] = {}
    for key, offset in offsets.items():
        if not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offset for {key!r} must be a non-negative integer, got {offset!r}")
        result[_tp_key(key)] = offset
    return result


def offsets_as_strings(offsets: Mapping[TopicPartitionKey, int]) -> dict[str, int]:
    """``{(topic, partition): offset}`` -> ``{"topic:partition": offset}`` (the form checkpoints and events store)."""
    return {f"{topic}:{partition}": offset for (topic, partition), offset in offsets.items()}


def next_offsets(events: Iterable[ConsumedEvent]) -> dict[TopicPartitionKey, int]:
    """The offsets to commit after ``events``: one past the highest offset per partition."""
    result: dict[TopicPartitionKey, int] = {}
    for item in events:
        key = (item.topic, item.partition)
        result[key] = max(result.get(key, 0), item.offset + 1)
    return result


def _key_text(key: bytes | None) -> str | None:
    return None if key is None else key.decode("utf-8", errors="replace")


def _dead_letter_run_id(key: str | None, raw: bytes | None) -> str:
    """The run a poison message probably belongs to: its key (run_id by convention), else ``unknown``."""
    with contextlib.suppress(InvalidNameError):
        return validate_name(key or "", "run_id")
    match = re.search(rb'"run_id"\s*:\s*"([A-Za-z0-9._-]{1,64})"', raw or b"")
    with contextlib.suppress(InvalidNameError):
        return validate_name(match.group(1).decode(), "run_id") if match else _UNKNOWN_RUN
    return _UNKNOWN_RUN


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
      published to ``<ns>.dlq`` as ``DeadLetter`` (reason and origin) and skipped;
      events of other runs are skipped when ``run_id`` is given.  Both are counted
      in ``stats`` and covered by the next ``commit()``.
    * ``commit()`` commits everything polled so far; ``commit(offsets)`` commits the
      given next offsets (e.g. ``next_offsets(events)`` or a checkpoint's offsets).
    * ``seek`` positions partitions (applied on assignment if not yet assigned).
    * ``keep_alive`` polls with the partitions paused, so long work does not get
      the member dropped after ``max_poll_interval_ms``.

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
    ) -> None:
        if auto_offset_reset not in ("earliest", "latest"):
            raise ValueError(f"auto_offset_reset must be 'earliest' or 'latest', got {auto_offset_reset!r}")
        if not 0 < heartbeat_interval_ms < session_timeout_ms:
            raise ValueError("heartbeat_interval_ms must be positive and below session_timeout_ms")
        self.bus_config = bus_config
        self.topic = resolve_topic(bus_config.namespace, kind)
        self.kind = topic_kind(bus_config.namespace, self.topic)
        self.group_id = validate_name(group_id, "group_id")
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
            "request_timeout_ms": max(30_000, session_timeout_ms + 5_000),
            "allow_auto_create_topics": False,
        }
        self._timeout_ms = int(max(bus_config.connect_timeout_s, 5.0) * 1000)
        self._consumer: KafkaConsumer = _connect(KafkaConsumer, bus_config, settings)
        self._consumer.subscribe([self.topic], listener=_ApplyPendingSeeks(self))

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
        event, error = decode_record(record)
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
        key = _key_text(record.key)
        if self.kind == "dlq":
            self.stats.skipped_invalid_dead_letters += 1
            log.warning("skipped invalid %s:%d@%d: %s", record.topic, record.partition, record.offset, reason)
            return None
        raw: bytes = record.value or b""
        letter = DeadLetter(
            reason=reason[:2000],
            origin_topic=record.topic,
            origin_partition=record.partition,
            origin_offset=record.offset,
            key=key,
            raw=raw[:DEAD_LETTER_RAW_BYTES].decode("utf-8", errors="replace"),
            raw_truncated=len(raw) > DEAD_LETTER_RAW_BYTES,
        )
        envelope = make_event(_dead_letter_run_id(key, raw), letter)
        self._dead_letter_publisher().publish_raw(self.dlq_topic, encode_event(envelope), record.key, "DeadLetter")
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

    def commit(self, offsets: OffsetsLike | None = None) -> dict[TopicPartitionKey, int]:
        """Commit next offsets (default: everything polled so far); returns what was committed."""
        to_commit = dict(self._polled) if offsets is None else normalize_offsets(offsets)
        if not to_commit:
            return {}
        payload = {TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in to_commit.items()}
        try:
            self._consumer.commit(payload, timeout_ms=self._timeout_ms)
        except CommitFailedError as exc:
            raise CommitError(
                f"commit to group {self.group_id} failed: this member was dropped from the group (no poll within "
                "max_poll_interval_ms, or a rebalance); call keep_alive() during long work; the uncommitted "
                "events will be delivered again"
            ) from exc
        except KafkaError as exc:
            raise CommitError(f"commit to group {self.group_id} failed: {_describe(exc)}") from exc
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
        """
        already_paused = set(self._consumer.paused())
        self.pause()
        try:
            self._poll_without_consuming(timeout_ms=0)
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
        self._consumer.close(autocommit=False, timeout_ms=self._timeout_ms)
        if self._dlq is not None:
            self._dlq.close()
            self._dlq = None

    def __enter__(self) -> EventConsumer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class EventFollower:
    """Reads one topic kind (or topic) without joining a consumer group, and never commits.

    For reads where every process must see every event and no position needs to
    outlive the process: a producer following ``<ns>.adapters`` (on start it reads
    the registry itself), or counting its run's unconsumed batches on
    ``<ns>.trajectories``.  It is assigned every partition and positioned before
    the constructor returns (``start``: ``"latest"`` or ``"earliest"``; ``offsets``
    overrides that per partition), so every event published after construction is
    delivered.  Without a group there is no join: on the local broker a join takes
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
    ) -> None:
        if start not in ("earliest", "latest"):
            raise ValueError(f"start must be 'earliest' or 'latest', got {start!r}")
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
        }
        self._timeout_ms = int(max(bus_config.connect_timeout_s, 5.0) * 1000)
        self._consumer: KafkaConsumer = _connect(KafkaConsumer, bus_config, settings)
        try:
            with self._errors("assign"):
                self._assign(start, offsets or {})
        except BaseException:
            self._consumer.close(autocommit=False, timeout_ms=2000)
            raise

    def _assign(self, start: str, offsets: Mapping[int, int]) -> None:
        partitions = self._consumer.partitions_for_topic(self.topic)
        if not partitions:
            raise UnknownTopicError(f"topic {self.topic} does not exist; see `rlpipe topics list`")
        tps = [TopicPartition(self.topic, p) for p in sorted(partitions)]
        self._consumer.assign(tps)
        for tp in tps:
            if tp.partition in offsets:
                self._consumer.seek(tp, int(offsets[tp.partition]))
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
        event, reason = decode_record(record)
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


# ---------------------------------------------------------------------------------------------------------------------
# Admin helpers for the command line


@dataclass(frozen=True, slots=True)
class PartitionInfo:
    """One partition of a topic: its leader and the range of offsets it holds."""

    partition: int
    leader: int
    replicas: tuple[int, ...]
    begin_offset: int
    end_offset: int

    @property
    def messages(self) -> int:
        """Messages currently held (end - begin)."""
        return self.end_offset - self.begin_offset


@dataclass(frozen=True, slots=True)
class TopicInfo:
    """A topic and its partitions.

    ``topic_id`` is the id the broker gave the topic when it created it (None where
    the broker reports none): a log deleted or lost and created again under the
    same name has another id, so offsets recorded against the old one mean nothing.
    """

    name: str
    partitions: tuple[PartitionInfo, ...]
    topic_id: str | None = None

    @property
    def messages(self) -> int:
        """Messages held over all partitions."""
        return sum(p.messages for p in self.partitions)


@dataclass(frozen=True, slots=True)
class PartitionLag:
    """How far a consumer group is behind on one partition."""

    group_id: str
    topic: str
    partition: int
    committed: int
    end_offset: int

    @property
    def lag(self) -> int:
        """end offset - committed offset."""
        return max(0, self.end_offset - self.committed)


def list_topics(bus_config: BusConfig, all_namespaces: bool = False, bootstrap_servers: str | None = None) -> list[str]:
    """Topic names under the namespace (every non-internal topic with ``all_namespaces``), sorted."""
    with admin_client(bus_config, bootstrap_servers) as admin:
        names = admin.list_topics()
    prefix = f"{bus_config.namespace}."
    return sorted(n for n in names if not n.startswith("__") and (all_namespaces or n.startswith(prefix)))


def _offsets(admin: KafkaAdminClient, tps: list[TopicPartition], spec: Any) -> dict[TopicPartition, int]:
    if not tps:
        return {}
    answer = admin.list_partition_offsets(dict.fromkeys(tps, spec))
    return {tp: int(answer[tp].offset) for tp in tps}


def describe_topic(bus_config: BusConfig, kind_or_topic: str, bootstrap_servers: str | None = None) -> TopicInfo:
    """Partitions, leaders and offset ranges of one topic (a kind or a full name)."""
    topic = resolve_topic(bus_config.namespace, kind_or_topic)
    with admin_client(bus_config, bootstrap_servers) as admin:
        if topic not in admin.list_topics():
            raise UnknownTopicError(f"topic {topic} does not exist; see `rlpipe topics list`")
        (meta,) = admin.describe_topics([topic])
        tps = [TopicPartition(topic, p["partition_index"]) for p in meta["partitions"]]
        begins = _offsets(admin, tps, OffsetSpec.EARLIEST)
        ends = _offsets(admin, tps, OffsetSpec.LATEST)
    partitions = tuple(
        PartitionInfo(
            partition=p["partition_index"],
            leader=p["leader_id"],
            replicas=tuple(p["replica_nodes"]),
            begin_offset=begins[TopicPartition(topic, p["partition_index"])],
            end_offset=ends[TopicPartition(topic, p["partition_index"])],
        )
        for p in sorted(meta["partitions"], key=lambda p: p["partition_index"])
    )
    return TopicInfo(name=topic, partitions=partitions, topic_id=_known_topic_id(meta.get("topic_id")))


def _known_topic_id(value: Any) -> str | None:
    """The topic id as text; None for a missing or all-zero id (a broker that does not track them)."""
    text = str(value) if value is not None else ""
    return text if text.strip("0-A=") else None


def list_groups(bus_config: BusConfig, bootstrap_servers: str | None = None) -> list[str]:
    """Consumer group ids known to the cluster, sorted."""
    with admin_client(bus_config, bootstrap_servers) as admin:
        return sorted(group["group_id"] for group in admin.list_groups())


def group_lag(
    bus_config: BusConfig,
    group_id: str,
    all_namespaces: bool = False,
    bootstrap_servers: str | None = None,
) -> list[PartitionLag]:
    """Committed offset, end offset and lag of ``group_id`` per partition it has committed (namespace topics)."""
    prefix = f"{bus_config.namespace}."
    with admin_client(bus_config, bootstrap_servers) as admin:
        committed = admin.list_group_offsets(group_id).get(group_id, {})
        tps = sorted(
            (tp for tp in committed if all_namespaces or tp.topic.startswith(prefix)),
            key=lambda tp: (tp.topic, tp.partition),
        )
        ends = _offsets(admin, tps, OffsetSpec.LATEST)
    return [
        PartitionLag(group_id, tp.topic, tp.partition, int(committed[tp].offset), ends[tp])
        for tp in tps
        if committed[tp].offset >= 0
    ]


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


def decode_record(record: Any) -> tuple[Envelope | None, str | None]:
    """A consumed record's event, or None and why it is not one (null value, bad JSON, unknown version)."""
    if record.value is None:
        return None, "empty message (null value)"
    try:
        return decode_event(record.value), None
    except EventDecodeError as exc:
        return None, str(exc)


def _tail_record(record: Any) -> TailRecord:
    event, error = decode_record(record)
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
    settings = kafka_client_settings(bus_config, bootstrap_servers)
    settings |= {"client_id": f"{_CLIENT_ID}-tail", "group_id": None, "enable_auto_commit": False}
    settings |= {"allow_auto_create_topics": False, "request_timeout_ms": 30_000}
    consumer: KafkaConsumer = _connect(KafkaConsumer, bus_config, settings)
    try:
        with _bus_errors(bus_config, settings["bootstrap_servers"], "tail"):
            ends = _assign_last(consumer, topic, n)
            backlog, newer = _read_until(consumer, ends, idle_timeout_s=read_timeout_s)
            yield from (item for item in backlog if _matches_run(item, run_id))
            if follow:
                yield from (item for item in newer if _matches_run(item, run_id))
            stop_at = None if follow_for_s is None else time.monotonic() + follow_for_s
            while follow and (stop_at is None or time.monotonic() < stop_at):
                wait_ms = 500 if stop_at is None else max(0, min(500, int((stop_at - time.monotonic()) * 1000)))
                for records in consumer.poll(timeout_ms=wait_ms).values():
                    yield from (item for item in map(_tail_record, records) if _matches_run(item, run_id))
    finally:
        consumer.close(autocommit=False, timeout_ms=2000)


def _assign_last(consumer: KafkaConsumer, topic: str, n: int) -> dict[TopicPartition, int]:
    """Assign every partition of ``topic`` positioned ``n`` before its end; returns the end offsets."""
    partitions = consumer.partitions_for_topic(topic)
    if not partitions:
        raise UnknownTopicError(f"topic {topic} does not exist; see `rlpipe topics list`")
    tps = [TopicPartition(topic, p) for p in sorted(partitions)]
    consumer.assign(tps)
    ends = consumer.end_offsets(tps)
    begins = consumer.beginning_offsets(tps)
    for tp in tps:
        consumer.seek(tp, max(int(begins[tp]), int(ends[tp]) - n))
    return {tp: int(ends[tp]) for tp in tps}


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
        batches = consumer.poll(timeout_ms=200)
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
