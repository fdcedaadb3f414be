"""Schema versions of every record rlpipe writes, and the compatibility rule.

Versions are ``MAJOR.MINOR``.  A reader accepts any minor version of its own
major (new optional fields are ignored) and refuses a newer major: the record
may mean something it cannot know.  Older majors are accepted when the reader
still understands them (today there is only major 1).  A newer minor may also
add event types: readers skip those, counted in their stats, and never
dead-letter them (``schemas.events.NewerEventTypeError``).
"""

from __future__ import annotations

EVENT_SCHEMA_VERSION = "1.1"  # 1.1: DeadLetter origin_timestamp_ms, record_sha256
TRAJECTORY_SCHEMA_VERSION = "1.2"  # 1.1: temperature, top_p, top_k of each row; 1.2: state
STEPS_SCHEMA_VERSION = "1.0"
MANIFEST_SCHEMA_VERSION = "1.2"  # 1.1: kind (lora or value-network); 1.2: ends_with_session


class SchemaVersionError(ValueError):
    """A record's schema version cannot be read by this version of rlpipe."""


class NewerSchemaError(SchemaVersionError):
    """A record written by a newer rlpipe: readable after an upgrade, so a reader that must not skip it stops."""


def parse_version(version: str) -> tuple[int, int]:
    """``"1.2"`` -> ``(1, 2)``; a clear error for anything else."""
    try:
        major_text, minor_text = str(version).split(".")
        major, minor = int(major_text), int(minor_text)
    except ValueError:
        raise SchemaVersionError(f"schema version {version!r} is not of the form MAJOR.MINOR") from None
    if major < 0 or minor < 0:
        raise SchemaVersionError(f"schema version {version!r} has a negative part")
    return major, minor


def check_readable(version: str, supported: str, what: str) -> None:
    """Refuse a record whose major version is newer than ``supported``."""
    major, _ = parse_version(version)
    supported_major, _ = parse_version(supported)
    if major > supported_major:
        raise NewerSchemaError(
            f"{what} has schema version {version}, newer than this rlpipe reads ({supported}); upgrade rlpipe"
        )
