"""Publishing events: ``EventPublisher``, the idempotent producer that waits for each acknowledgement.

One event per call (``acks=all``, kafka-python 3.x defaults), waiting for the
broker's answer so a failure (an oversized message, a missing topic) surfaces as
``PublishError`` instead of vanishing inside a future.  Retriable errors are retried
a bounded number of times; ``event_id`` makes a duplicate harmless.  A producer that
has failed for good is replaced by a new one: after a sequence error a broker that
cannot bump its epoch, or a send that expired after it was sent (kafka-python 3.0
then drops the producer's id and never asks for another, so it sends nothing again,
however long the broker has been back).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

from kafka import KafkaProducer
from kafka.errors import (
    AuthorizationError,
    InvalidProducerEpochError,
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    OutOfOrderSequenceNumberError,
    UnknownProducerIdError,
)
from kafka.producer.transaction_manager import TransactionState
from tenacity import Retrying, retry_if_exception, stop_after_attempt, stop_after_delay, wait_exponential

from pipeline.io.bus.admin import _check_event_belongs, ensure_topics, resolve_topic
from pipeline.io.bus.connection import _CLIENT_ID, _connect, _describe, kafka_client_settings
from pipeline.io.bus.errors import BusUnavailableError, PublishError, WrongEventTypeError
from pipeline.topics import topic_kind
from schemas.config import BusConfig
from schemas.events import Envelope, encode_event

log = logging.getLogger(__name__)
# The errors of an idempotent producer whose sequence numbers or epoch the broker no longer accepts.
SEQUENCE_ERRORS = (OutOfOrderSequenceNumberError, UnknownProducerIdError, InvalidProducerEpochError)


def _failed_for_good(producer: KafkaProducer) -> str | None:
    """Why ``producer`` will never send again, or None while it can.

    Two ways, read off kafka-python's transaction manager (it has no public check): a failed epoch bump leaves it
    in an error state; a send that expires after it was sent (unacknowledged past the delivery timeout) makes it
    drop its producer id, still ``READY``, so its sender never asks for another id and holds every later send
    unsent and unexpired, whether or not the broker is back (kafka-python 3.0.12).
    """
    manager = getattr(producer, "_transaction_manager", None)
    if manager is None:
        return None
    with manager._lock:  # its sender sets the id, then READY, under this lock: read both as one moment
        if manager.has_error():
            return str(manager.last_error)
        if not manager.has_producer_id() and manager._current_state is TransactionState.READY:
            return "it dropped its producer id after a send expired and never asks for a new one"
    return None


def _stop(producer: KafkaProducer, timeout_s: float) -> bool:
    """Flush and close ``producer``, stopping its sender thread and connections in any case; whether everything
    buffered was sent.  kafka-python's ``close`` raises from its flush before it stops anything: then its sender is
    stopped without sending (which fails what is still buffered) and it is closed again, with nothing to wait for."""
    try:
        producer.close(timeout=timeout_s)
        return True
    except KafkaTimeoutError:
        sender = getattr(producer, "_sender", None)
        if sender is not None:
            sender.force_close()
            sender.join(max(timeout_s, 1.0))
        with contextlib.suppress(KafkaError):
            producer.close(timeout=0)
        return False


class _ProducerReplaced(Exception):
    """The send failed because its producer had failed for good; a new producer sends it again."""


def _is_retriable(exc: BaseException) -> bool:
    return isinstance(exc, _ProducerReplaced) or (isinstance(exc, KafkaError) and bool(exc.retriable))


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
            # one produce request at a time: events sent meanwhile wait in the next batch, and no broker can
            # apply two of one producer's batches out of order (which fails an idempotent producer)
            "max_in_flight_requests_per_connection": 1,
        }
        self._settings = settings
        self._producer: KafkaProducer = _connect(KafkaProducer, bus_config, settings)
        self._replacing = threading.Lock()

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
                    producer = self._working_producer()
                    try:
                        metadata = producer.send(topic, value=value, key=key_bytes).get(timeout=self.send_timeout_s + 5)
                    except KafkaError as exc:
                        if self._replace_if_failed_for_good(producer, in_doubt=isinstance(exc, SEQUENCE_ERRORS)):
                            raise _ProducerReplaced() from None
                        raise
        except MessageSizeTooLargeError as exc:
            raise PublishError(
                f"publishing a {what} of {len(value or b'')} bytes to {topic} failed: it exceeds the message size limit "
                "(1 MiB by default); keep bulk data in the store and publish a claim check", transient=False
            ) from exc
        except KafkaTimeoutError as exc:  # the broker may still write it: reported as failed, never as sent
            raise PublishError(
                f"publishing a {what} to {topic} failed: no acknowledgement within {self.send_timeout_s:g}s "
                f"({_describe(exc)}); it may still arrive (its event id makes a resend harmless); check that the "
                "broker is up and the topic exists (`rlpipe topics list`)"
            ) from exc
        except KafkaError as exc:
            raise PublishError(f"publishing a {what} to {topic} failed: {_describe(exc)}",
                               transient=not isinstance(exc, AuthorizationError)) from exc
        except BusUnavailableError as exc:  # a producer that failed for good, its replacement refused a connection
            raise PublishError(f"publishing a {what} to {topic} failed: its producer failed for good and a new one "
                               f"could not connect ({exc})") from exc
        except _ProducerReplaced as exc:
            raise PublishError(f"publishing a {what} to {topic} failed: its producer failed for good and was "
                               f"replaced, with no try left within {self.retry_attempts} tries or "
                               f"{self.send_timeout_s:g}s (the next publish uses the new one); see the broker's "
                               "log") from exc
        return int(metadata.partition), int(metadata.offset)

    def _working_producer(self) -> KafkaProducer:
        """The producer to send with: a new one first if the current one has failed for good."""
        producer = self._producer
        self._replace_if_failed_for_good(producer)
        return self._producer

    def _replace_if_failed_for_good(self, producer: KafkaProducer, in_doubt: bool = False) -> bool:
        """Start a new producer (a new producer id) when ``producer`` refuses every send from now on.

        An idempotent producer that hits a sequence error asks the broker for a new epoch
        of its producer id; a broker that cannot give one (Tansu 0.6) leaves it failed for
        good, as does a send that expired after it was sent (``_failed_for_good``).  The send
        that hit the sequence error learns of it before that bump has been answered, so
        ``in_doubt`` (the send failed with a sequence error) replaces the producer without
        waiting to find out: events carry ids, so sending one again is harmless.
        """
        why = _failed_for_good(producer) or ("a sequence error" if in_doubt else None)
        if why is None:
            return False
        with self._replacing:
            if self._producer is producer:
                log.warning("the Kafka producer failed for good (%s); starting a new one", why)
                self._producer = _connect(KafkaProducer, self.bus_config, self._settings)
                _stop(producer, 0)  # a send it still holds fails (its publish reports it or tries again)
        return True

    def flush(self, timeout_s: float | None = None) -> None:
        """Send everything buffered and wait for it (``publish`` already waits for its own event)."""
        self._producer.flush(timeout=timeout_s if timeout_s is not None else self.send_timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Flush and close the producer; safe to call twice.

        Events still unacknowledged after ``timeout_s`` are dropped and reported as ``PublishError`` (one line:
        how many, to which topics), with the producer closed all the same.
        """
        producer = self._producer
        # what is still buffered, named in the error below; kafka-python has no public view of it
        accumulator = getattr(producer, "_accumulator", None)
        pending = accumulator._incomplete.all() if accumulator is not None else []
        if not _stop(producer, timeout_s):
            raise PublishError(self._undelivered(pending, timeout_s))

    @staticmethod
    def _undelivered(batches: list[Any], timeout_s: float) -> str:
        """The one-line error for events dropped when closing: how many, to which topics, and what to do."""
        count = sum(int(getattr(batch, "record_count", 0)) for batch in batches)
        topics = sorted({batch.topic_partition.topic for batch in batches if hasattr(batch, "topic_partition")})
        what = (f"{count} event{'s' if count != 1 else ''} to {', '.join(topics)} {'was' if count == 1 else 'were'}"
                if topics else "the events buffered were")
        return (f"closing the event publisher: {what} not acknowledged within {timeout_s:g}s and are dropped; "
                "check that the broker is up (`rlpipe topics list`) and publish them again (their event ids make a "
                "resend harmless)")

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
