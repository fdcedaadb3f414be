"""Events on the Kafka topics: one envelope, a typed payload per event type.

Every event travels as JSON in the same envelope (``type``, ``schema_version``,
``event_id``, ``run_id``, ``time``, ``payload``) so that ``rlpipe topics tail``
can show any of them, and a reader can refuse what it cannot understand before
acting on it: a newer major version is refused, a newer minor one is read without
the optional fields it added, and an unknown field in an event of this rlpipe's
own version is refused.  Direction of each event is noted on its class.

Bulk data never rides here: a ``TrajectoryBatchCommitted`` is a claim check for
a Parquet file already durable in the store.
"""

from __future__ import annotations

import hashlib
import json
import typing
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, field_validator

from schemas.names import validate_name
from schemas.versions import (
    EVENT_SCHEMA_VERSION,
    NewerSchemaError,
    SchemaVersionError,
    check_readable,
    parse_version,
)

Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="hex sha256 digest")]
NonNegInt = Annotated[int, Field(ge=0)]
Version = Annotated[int, Field(ge=0, description="adapter version; 0 is the base model")]


class EventDecodeError(ValueError):
    """Bytes from a topic that are not a valid event (they go to the dead-letter topic)."""


class NewerEventError(EventDecodeError, NewerSchemaError):
    """An event from a newer rlpipe (dead-lettered, unless its reader must not skip it: ``refuse_newer``);
    ``run_id``: the envelope's, as written (None if it has none)."""

    def __init__(self, message: str, run_id: object = None) -> None:
        super().__init__(message)
        self.run_id = run_id


class NewerEventTypeError(EventDecodeError):
    """An event type that a newer minor version of this major added: readers skip it (counted), since a minor
    version adds only what older readers may ignore (``schemas.versions``); never dead-lettered."""

    def __init__(self, message: str, event_type: str) -> None:
        super().__init__(message)
        self.event_type = event_type


class Payload(BaseModel):
    """Base of every event payload."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    event_type: ClassVar[str]


class TrajectoryBatchCommitted(Payload):
    """producer -> learner, on ``<ns>.trajectories``: a Parquet batch is durable in the store."""

    event_type: ClassVar[str] = "TrajectoryBatchCommitted"
    batch_id: str = Field(description="unique id of the batch; also the file name and the idempotency key")
    path: str = Field(description="object key relative to the store root")
    sha256: Sha256
    num_rows: NonNegInt
    num_tokens: NonNegInt
    num_generated_tokens: NonNegInt
    num_groups: NonNegInt = 0
    env: str
    producer_id: str
    policy_version_min: Version
    policy_version_max: Version
    reward_mean: float
    reward_min: float
    reward_max: float
    success_rate: float = Field(ge=0.0, le=1.0)
    created_at: datetime

    @field_validator("batch_id", "producer_id")
    @classmethod
    def _safe(cls, value: str) -> str:
        return validate_name(value, "id")

    @field_validator("policy_version_max")
    @classmethod
    def _ordered(cls, value: int, info: Any) -> int:
        low = info.data.get("policy_version_min")
        if low is not None and value < low:
            raise ValueError(f"policy_version_max {value} < policy_version_min {low}")
        return value


class AdapterPublished(Payload):
    """learner -> producers, on ``<ns>.adapters``: a new adapter version's manifest is committed."""

    event_type: ClassVar[str] = "AdapterPublished"
    version: int = Field(ge=1)
    path: str = Field(description="folder key of the version, relative to the store root")
    manifest_sha256: Sha256
    base_model: str
    parent_version: Version
    learner_step: NonNegInt
    files: dict[str, Sha256]


class RunStarted(Payload):
    """launcher -> everyone, on ``<ns>.control``: a run exists; its config is in ``run.json``."""

    event_type: ClassVar[str] = "RunStarted"
    config_path: str
    config_sha256: Sha256
    env: str
    base_model: str


class ConfigFieldChange(BaseModel):
    """One field of a run's configuration, before and after a restart changed it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    field: str = Field(description="dotted path, e.g. learner.learning_rate")
    before: Any = None
    after: Any = None


class RunConfigChanged(Payload):
    """launcher/learner -> everyone, on ``<ns>.control``: a restart changed fields that are safe to change.

    The full new configuration is recorded create-only at ``config_path``
    (``runs/<run>/config-changes/<n>.json``); ``run.json`` stays the run's definition.
    """

    event_type: ClassVar[str] = "RunConfigChanged"
    config_path: str
    config_sha256: Sha256
    changes: list[ConfigFieldChange] = Field(min_length=1)


class ProducerHeartbeat(Payload):
    """producer -> monitors, on ``<ns>.control``: liveness and rates since the last beat."""

    event_type: ClassVar[str] = "ProducerHeartbeat"
    producer_id: str
    adapter_version: Version
    samples_total: NonNegInt
    batches_total: NonNegInt
    tokens_total: NonNegInt
    env_steps_total: NonNegInt
    samples_per_s: float = Field(ge=0.0)
    tokens_per_s: float = Field(ge=0.0)
    env_steps_per_s: float = Field(ge=0.0)
    busy_fraction: float = Field(ge=0.0, le=1.0, description="share of the interval spent generating")
    interval_s: float = Field(ge=0.0)


class LearnerCheckpointed(Payload):
    """learner -> monitors, on ``<ns>.control``: a checkpoint is durable (offsets committed after)."""

    event_type: ClassVar[str] = "LearnerCheckpointed"
    step: NonNegInt
    version: Version
    path: str
    offsets: dict[str, NonNegInt] = Field(description="'topic:partition' -> next offset to consume")
    metrics: dict[str, float] = Field(default_factory=dict)


class LearnerProgress(Payload):
    """learner -> producers, on ``<ns>.control``: how far the learner has read its run's batches.

    Sent after every step, and every few seconds while the learner waits for rows.
    Producers measure their backlog (``producer.max_backlog_steps``) from these
    positions: the learner commits offsets only after a checkpoint, so rows it has
    already taken would otherwise count as waiting until the next checkpoint.
    """

    event_type: ClassVar[str] = "LearnerProgress"
    step: NonNegInt
    version: Version
    positions: dict[str, NonNegInt] = Field(
        description="'topic:partition' -> next offset the learner reads (ingested; committed at the next checkpoint)"
    )


class LearnerLeft(Payload):
    """learner -> monitors, on ``<ns>.control``: a learner let the run go after training the rows it had waiting
    (a packed one on a ``RunStopped`` or its budget reached, a single-run one on its run's ``RunStopped``); its final
    checkpoint is durable.

    A run stopped while its learner still trains gets this learner's last events after its ``RunStopped``;
    this event says that they were its wind-down, not a restart (``rlpipe runs show``).
    """

    event_type: ClassVar[str] = "LearnerLeft"
    step: NonNegInt
    version: Version


class RunStopped(Payload):
    """launcher -> everyone, on ``<ns>.control``: the run ended."""

    event_type: ClassVar[str] = "RunStopped"
    reason: str
    final_version: Version = 0
    final_step: NonNegInt = 0


class DeadLetter(Payload):
    """any consumer -> operators, on ``<ns>.dlq``: a message that could not be used, and why."""

    event_type: ClassVar[str] = "DeadLetter"
    reason: str
    origin_topic: str
    origin_partition: NonNegInt
    origin_offset: NonNegInt
    key: str | None = None
    raw: str = Field(description="the original bytes decoded as UTF-8 with replacement, truncated")
    raw_truncated: bool = False
    # Schema 1.1.  A letter about a broker record carries them (``EventConsumer``): its ``key`` and ``raw`` keep
    # only a start of the record, undecodable bytes replaced, so they alone cannot tell two records apart.
    origin_timestamp_ms: int | None = Field(
        default=None, ge=0, description="the record's broker timestamp, ms since the epoch; None: it had none")
    record_sha256: Sha256 | None = Field(
        default=None, description="sha256 of the record's whole key and value (``framed_sha256``); None in letters "
                                  "that name no broker record (a learner's quarantined batch) or older ones")


PAYLOAD_TYPES: dict[str, type[Payload]] = {
    cls.event_type: cls
    for cls in (
        TrajectoryBatchCommitted,
        AdapterPublished,
        RunStarted,
        RunConfigChanged,
        ProducerHeartbeat,
        LearnerCheckpointed,
        LearnerProgress,
        LearnerLeft,
        RunStopped,
        DeadLetter,
    )
}


class Envelope(BaseModel):
    """The one wire format of every event (JSON)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: str
    schema_version: str = EVENT_SCHEMA_VERSION
    event_id: uuid.UUID = Field(default_factory=uuid.uuid4)
    run_id: str
    time: datetime = Field(default_factory=lambda: datetime.now(UTC))
    payload: SerializeAsAny[Payload]

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, value: str) -> str:
        return validate_name(value, "run_id")


# uuid5 namespace of the event ids of versions, checkpoints and dead letters (``announcement_id``); never change it:
# ids already on a topic would no longer match the ids of the same announcements sent again
ANNOUNCEMENT_NAMESPACE = uuid.UUID("a9c5363e-b150-4178-87c7-9427d0283afe")


def announcement_id(run_id: str, payload: Payload) -> uuid.UUID | None:
    """The ``event_id`` every sending of a version's or checkpoint's announcement, or of a record's dead letter,
    carries; None for other events.

    A version (``AdapterPublished``: its number and manifest digest) and a checkpoint (``LearnerCheckpointed``: its
    folder, unique to one write) are durable before their event is sent, so a learner starting after one that was
    killed or stopped in between announces them again (``consumers.reannounce``): with the id derived from what the
    event names, a reader that dedupes by ``event_id`` counts each once, whether or not it was sent before.

    A dead letter (``DeadLetter``) is sent before its reader commits past the record it names, so a reader stopped
    or killed in between reads the record again on its next start and sends its letter again: its id is derived
    from the record (``dead_letter_name``), never from the reason, whose wording may differ between sendings.
    """
    if isinstance(payload, AdapterPublished):
        name = f"{run_id}/AdapterPublished/{payload.version}/{payload.manifest_sha256}"
    elif isinstance(payload, LearnerCheckpointed):
        name = f"{run_id}/LearnerCheckpointed/{payload.path}"
    elif isinstance(payload, DeadLetter):
        name = f"{run_id}/DeadLetter/{dead_letter_name(payload)}"
    else:
        return None
    return uuid.uuid5(ANNOUNCEMENT_NAMESPACE, name)


def dead_letter_name(letter: DeadLetter) -> str:
    """What names the record a dead letter is about: its origin (topic, partition, offset) and what tells records at
    one origin apart.

    The origin alone does not always name one record: a topic deleted and created again numbers from 0 again, and
    a batch a learner read from no broker position has a stand-in origin (``consumers.sources.origin_of``).  A
    letter about a broker record carries the record's timestamp and a digest of its whole bytes, as the reader that
    sent it told the record from others (``pipeline.io.bus.dead_letters.poison_origin``); other letters (a learner's
    quarantined batch, whose short JSON ``raw`` is never cut) and older ones fall back to a digest of their ``key``
    and ``raw``.  Either is the same at every reading of one record.
    """
    origin = f"{letter.origin_topic}/{letter.origin_partition}/{letter.origin_offset}"
    if letter.record_sha256 is not None:
        timestamp = "-" if letter.origin_timestamp_ms is None else letter.origin_timestamp_ms
        return f"{origin}@{timestamp}/{letter.record_sha256}"
    kept = (None if part is None else part.encode("utf-8", errors="surrogatepass") for part in (letter.key, letter.raw))
    return f"{origin}/{framed_sha256(kept)}"


def framed_sha256(parts: Iterable[bytes | None]) -> str:
    """Hex sha256 of ``parts``, each length-prefixed and None marked apart from empty bytes: no two sequences of
    parts (a key and a value: ``(b"ab", b"c")`` and ``(b"a", b"bc")``) frame to the same bytes."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(b"-" if part is None else b"+%d:" % len(part) + part)
    return digest.hexdigest()


def make_event(run_id: str, payload: Payload) -> Envelope:
    """Wrap ``payload`` in an envelope for ``run_id``: ``announcement_id`` where it has one (a version, a checkpoint,
    a dead letter), else a fresh ``event_id``."""
    event_id = announcement_id(run_id, payload)
    if event_id is None:
        return Envelope(type=payload.event_type, run_id=run_id, payload=payload)
    return Envelope(type=payload.event_type, run_id=run_id, payload=payload, event_id=event_id)


def encode_event(event: Envelope) -> bytes:
    """Envelope -> UTF-8 JSON bytes."""
    return event.model_dump_json().encode()


def decode_event(data: bytes | str, expected_type: str | None = None) -> Envelope:
    """Bytes -> validated envelope with a typed payload; ``EventDecodeError`` says what is wrong."""
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as exc:
        # ValueError: bad UTF-8 or syntax, and an integer of more digits than ``int()`` takes; RecursionError:
        # nesting deeper than the parser recurses.  Each must be a decode error, or a reader stops at it for good.
        raise EventDecodeError(f"not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise EventDecodeError("event is not a JSON object")
    event_type = raw.get("type")
    payload_cls = PAYLOAD_TYPES.get(event_type) if isinstance(event_type, str) else None
    if payload_cls is None:
        version = str(raw.get("schema_version", ""))
        try:  # a newer major is unreadable whatever its type; a newer minor may add types (skipped)
            check_readable(version, EVENT_SCHEMA_VERSION, f"{event_type!r} event")
            newer_minor = parse_version(version) > parse_version(EVENT_SCHEMA_VERSION)
        except NewerSchemaError as exc:
            raise NewerEventError(str(exc), raw.get("run_id")) from None
        except SchemaVersionError:
            newer_minor = False
        if newer_minor and isinstance(event_type, str):
            raise NewerEventTypeError(f"event type {event_type!r} of schema version {version} is newer than this "
                                      f"rlpipe ({EVENT_SCHEMA_VERSION}); skipped", event_type)
        raise EventDecodeError(f"unknown event type {event_type!r}; known: {', '.join(sorted(PAYLOAD_TYPES))}")
    if expected_type is not None and event_type != expected_type:
        raise EventDecodeError(f"expected a {expected_type} event, got {event_type}")
    try:
        check_readable(str(raw.get("schema_version", "")), EVENT_SCHEMA_VERSION, f"{event_type} event")
    except NewerSchemaError as exc:
        raise NewerEventError(str(exc), raw.get("run_id")) from None
    except SchemaVersionError as exc:
        raise EventDecodeError(str(exc)) from None
    if parse_version(str(raw["schema_version"])) > parse_version(EVENT_SCHEMA_VERSION):
        # a newer minor of our major: the fields it added are optional, so they are left out (versions.py)
        raw = {**_known_fields(Envelope, raw), "payload": _known_fields(payload_cls, raw.get("payload"))}
    try:
        payload = payload_cls.model_validate(raw.get("payload"))
        event = Envelope.model_validate({**raw, "payload": payload})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise EventDecodeError(f"invalid {event_type}: {where}: {first['msg']}") from None
    try:  # every event read can be written again (shown, forwarded, stored), as every event written can be read
        encode_event(event)
    except ValueError as exc:  # a string with a lone surrogate; a free JSON value nested too deep
        raise EventDecodeError(f"invalid {event_type}: cannot be encoded again: {exc}") from None
    return event


def _known_fields(model: type[BaseModel], data: Any) -> Any:
    """``data`` less the keys ``model`` (and the records nested in it) does not know; anything else as given."""
    if not isinstance(data, dict):
        return data
    known = {}
    for key, value in data.items():
        field = model.model_fields.get(key)
        if field is not None:
            known[key] = _known_nested(field.annotation, value)
    return known


def _known_nested(annotation: Any, value: Any) -> Any:
    """``value`` of a field typed ``annotation``, its nested records (alone, in a list or a dict) pruned."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel) and annotation is not Payload:
        return _known_fields(annotation, value)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list and args and isinstance(value, list):
        return [_known_nested(args[0], item) for item in value]
    if origin is dict and len(args) == 2 and isinstance(value, dict):
        return {key: _known_nested(args[1], item) for key, item in value.items()}
    return value


# The API's events live in ``schemas.api``, which builds on this module and adds them to
# ``PAYLOAD_TYPES``; importing it here makes every reader of the log know them.
import schemas.api  # noqa: E402, F401  (registers ApiRequestAccepted and ApiResultReady)
