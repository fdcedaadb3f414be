"""Topics and the admin side of the event log: which events go where, creating topics, offsets and lag.

``resolve_topic`` maps topic kinds to names under a namespace (``pipeline.topics.topic_kind``
maps them back); ``TOPIC_EVENT_TYPES`` says which event types belong on which topic.
``ensure_topics`` creates a namespace's missing topics (idempotent), and the helpers
for the command line (``list_topics``, ``describe_topic``, ``list_groups``,
``group_lag``) read topics, offset ranges and consumer-group lag through a
``KafkaAdminClient`` with bounded timeouts; ``adopt_group_offsets`` lets a renamed
group start where its former name had got to.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from kafka import KafkaAdminClient, TopicPartition
from kafka.admin import OffsetSpec
from kafka.errors import NoError
from kafka.structs import OffsetAndMetadata

from pipeline.io.bus.connection import _CLIENT_ID, _bus_errors, _connect, kafka_client_settings
from pipeline.io.bus.errors import BusError, UnknownTopicError
from pipeline.io.bus.records import TopicPartitionKey
from pipeline.topics import (
    API_TOPIC_KINDS,
    MAX_TOPIC_NAME_LENGTH,
    TOPIC_KINDS,
    TopicKind,
    topic_kind,
    topic_name,
)
from schemas.config import BusConfig
from schemas.names import InvalidNameError, validate_name

log = logging.getLogger(__name__)

# Which event types belong on which topic; None = any known type no other topic claims (control is open-ended).
TOPIC_EVENT_TYPES: dict[TopicKind, frozenset[str] | None] = {
    "trajectories": frozenset({"TrajectoryBatchCommitted"}),
    "adapters": frozenset({"AdapterPublished"}),
    "control": None,
    "dlq": frozenset({"DeadLetter"}),
    "requests": frozenset({"ApiRequestAccepted"}),
    "results": frozenset({"ApiResultReady"}),
}


def resolve_topic(namespace: str, kind_or_topic: str) -> str:
    """A topic kind (``control``) becomes ``<namespace>.control``; a full topic name is kept."""
    if kind_or_topic in TOPIC_KINDS + API_TOPIC_KINDS:
        return topic_name(namespace, kind_or_topic)  # type: ignore[arg-type]  # checked just above
    try:
        validate_name(kind_or_topic, "topic", max_length=MAX_TOPIC_NAME_LENGTH)
    except InvalidNameError as exc:
        raise UnknownTopicError(str(exc)) from None
    if "." not in kind_or_topic:
        raise UnknownTopicError(
            f"{kind_or_topic!r} is neither a topic kind ({', '.join(TOPIC_KINDS)}) "
            f"nor a full topic name such as {namespace}.control"
        )
    return kind_or_topic


def _check_event_belongs(kind: TopicKind | None, topic: str, event_type: str) -> str | None:
    """None if ``event_type`` may travel on ``topic``, else the reason."""
    if kind is None:
        return None
    allowed = TOPIC_EVENT_TYPES.get(kind)
    if allowed is None:  # open-ended, but an event another topic claims would be ignored by every reader here
        home = next((other for other, types in TOPIC_EVENT_TYPES.items() if types and event_type in types), None)
        return None if home is None else f"a {event_type} event does not belong on {topic} (it travels on {home})"
    if event_type in allowed:
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
        if created:  # none when other processes created them all first
            admin.wait_for_topics(created, timeout_ms=int(bus_config.connect_timeout_s * 1000))
            log.info("created topics %s", ", ".join(created))
        return created


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
    namespace = bus_config.namespace
    return sorted(n for n in names if not n.startswith("__") and (all_namespaces or topic_kind(namespace, n) is not None))


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
    with admin_client(bus_config, bootstrap_servers) as admin:
        committed = admin.list_group_offsets(group_id).get(group_id, {})
        tps = sorted(
            (tp for tp in committed if all_namespaces or topic_kind(bus_config.namespace, tp.topic) is not None),
            key=lambda tp: (tp.topic, tp.partition),
        )
        ends = _offsets(admin, tps, OffsetSpec.LATEST)
    return [
        PartitionLag(group_id, tp.topic, tp.partition, int(committed[tp].offset), ends[tp])
        for tp in tps
        if committed[tp].offset >= 0
    ]


def adopt_group_offsets(
    bus_config: BusConfig,
    kind_or_topic: str,
    group_id: str,
    former_group_id: str,
    bootstrap_servers: str | None = None,
) -> dict[TopicPartitionKey, int]:
    """Commit for ``group_id`` the offsets ``former_group_id`` committed on one topic, if ``group_id`` has none
    on that topic at all; returns those adopted.

    For a group that was renamed: its members start where the former name had got to, not at the start of the
    log.  Call it before joining ``group_id``.  Any offset of its own on the topic means ``group_id`` has read
    it under the new name, so a partition without one is where it has read nothing yet: nothing is adopted.
    The group's offsets are read again just before writing, and the broker takes the commits only while it
    has no members, so a member that joined (and committed) first keeps its own.
    """
    topic = resolve_topic(bus_config.namespace, kind_or_topic)
    with admin_client(bus_config, bootstrap_servers) as admin:
        if _committed_on(admin, group_id, topic):
            return {}
        wanted = _committed_on(admin, former_group_id, topic)
        if not wanted or _committed_on(admin, group_id, topic):
            return {}
        answer = admin.alter_group_offsets(group_id, {tp: OffsetAndMetadata(offset, "", None)
                                                      for tp, offset in wanted.items()})
    adopted = {(tp.topic, tp.partition): wanted[tp] for tp, error in answer.items() if error is NoError}
    if refused := sorted(f"{tp.topic}:{tp.partition} ({error.__name__})"
                         for tp, error in answer.items() if error is not NoError):
        log.info("group %s adopted no offsets of %s on %s: the broker refused them", group_id, former_group_id,
                 ", ".join(refused))
    return adopted


def _committed_on(admin: KafkaAdminClient, group_id: str, topic: str) -> dict[TopicPartition, int]:
    """``group_id``'s committed next offsets on ``topic`` (partitions without one left out)."""
    committed = admin.list_group_offsets(group_id).get(group_id, {})
    return {tp: int(oam.offset) for tp, oam in committed.items() if tp.topic == topic and oam.offset >= 0}
