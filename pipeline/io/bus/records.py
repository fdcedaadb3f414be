"""What the readers hand back: consumed events, their counts, offsets and record decoding.

Shared by the group consumer, the follower and ``tail``.  Offsets are keyed by
``(topic, partition)``; checkpoints and events store them as ``"topic:partition"``
strings, and ``normalize_offsets`` / ``offsets_as_strings`` convert between the two.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from schemas.events import Envelope, EventDecodeError, NewerEventError, NewerEventTypeError, decode_event

TopicPartitionKey = tuple[str, int]  # (topic, partition)
OffsetsLike = Mapping[TopicPartitionKey, int] | Mapping[str, int]  # also "topic:partition" keys, as in checkpoints


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
    skipped_dead_lettered: int = 0  # poison messages another reader in this process dead-lettered (a packed learner)
    skipped_other_runs: int = 0
    skipped_invalid_dead_letters: int = 0  # undecodable messages on the DLQ itself are not re-queued
    skipped_invalid: int = 0  # undecodable or misplaced messages an ``EventFollower`` skipped
    skipped_newer_types: int = 0  # event types a newer minor version added (``NewerEventTypeError``)


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


def decode_record(record: Any, refuse_newer: bool = False) -> tuple[Envelope | None, str | None]:
    """A consumed record's event, or None and why it is not one (null value, bad JSON, unknown version).

    ``refuse_newer``: an event from a newer rlpipe raises ``NewerEventError`` instead.  An event type that a
    newer minor version added raises ``NewerEventTypeError`` whatever ``refuse_newer``: readers skip it, counted.
    """
    if record.value is None:
        return None, "empty message (null value)"
    try:
        return decode_event(record.value), None
    except EventDecodeError as exc:
        if isinstance(exc, NewerEventTypeError) or (refuse_newer and isinstance(exc, NewerEventError)):
            raise
        return None, str(exc)
