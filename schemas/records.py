"""JSON records in the store (manifests, evaluation results): one way to write them, one way to read them.

Writing is canonical (sorted keys, fixed indentation) so the same record always
has the same bytes and digest.  Reading refuses, each with one line naming the
problem: bytes that are not JSON, JSON that is not an object, a newer major
schema version, and the first field that does not validate.
"""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from schemas.versions import check_readable

RecordT = TypeVar("RecordT", bound=BaseModel)


def record_to_bytes(record: BaseModel) -> bytes:
    """Canonical JSON bytes of ``record``."""
    return (json.dumps(record.model_dump(mode="json"), sort_keys=True, indent=2) + "\n").encode()


def record_from_bytes(
    data: bytes,
    model: type[RecordT],
    supported_version: str,
    error: type[ValueError],
    where: str,
    what: str,
) -> RecordT:
    """Bytes -> validated ``model``; ``error`` (or ``SchemaVersionError`` for a newer major) says what is wrong."""
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{where} is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise error(f"{where} is not a JSON object")
    check_readable(str(raw.get("schema_version", supported_version)), supported_version, where)
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        place = ".".join(str(part) for part in first["loc"]) or what
        raise error(f"{where} is not a valid {what}: {place}: {first['msg']}") from None
