"""Topic names under a namespace: ``<ns>.trajectories``, ``.adapters``, ``.control``, ``.dlq`` (and the API's ``.requests``, ``.results``)."""

from __future__ import annotations

from typing import Literal

from schemas.names import validate_name

TopicKind = Literal["trajectories", "adapters", "control", "dlq", "requests", "results"]
# The topics of every run; the API's two (``requests``, ``results``) are made by ``rlpipe serve``.
TOPIC_KINDS: tuple[TopicKind, ...] = ("trajectories", "adapters", "control", "dlq")
API_TOPIC_KINDS: tuple[TopicKind, ...] = ("requests", "results")
# Kafka's limit on a topic name; also used for consumer group ids, which rlpipe builds from a run id and a prefix.
# Both are longer than the names they are built from (64 characters: schemas.names).
MAX_TOPIC_NAME_LENGTH = 249


def topic_name(namespace: str, kind: TopicKind) -> str:
    """The full topic name of ``kind`` under ``namespace`` (both validated)."""
    if kind not in TOPIC_KINDS + API_TOPIC_KINDS:
        known = ", ".join(TOPIC_KINDS + API_TOPIC_KINDS)
        raise ValueError(f"unknown topic kind {kind!r}; choose one of {known}")
    return f"{validate_name(namespace, 'namespace')}.{kind}"


def all_topics(namespace: str) -> list[str]:
    """Every topic of a namespace."""
    return [topic_name(namespace, kind) for kind in TOPIC_KINDS]


def topic_kind(namespace: str, topic: str) -> TopicKind | None:
    """The kind of ``topic`` under ``namespace`` (``<namespace>.<kind>`` exactly), or None for any other topic.

    Names may hold dots, so a prefix is not enough: ``rl.eval.control`` belongs to namespace ``rl.eval``, not to
    ``rl``.
    """
    for kind in TOPIC_KINDS + API_TOPIC_KINDS:
        if topic == f"{namespace}.{kind}":
            return kind
    return None
