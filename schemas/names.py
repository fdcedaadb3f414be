"""Validation of names that become store paths or Kafka topic names.

Run ids, producer ids, dataset names and topic namespaces end up inside object
keys and topic names, so they are restricted to a safe alphabet: a path
separator or ``..`` could escape the run's folder, and Kafka only accepts
``[A-Za-z0-9._-]`` in topic names anyway.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

MAX_NAME_LENGTH = 64
MAX_ECHOED = 100  # characters of a client's input an error message repeats
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# a Tinker model id (``<session>:train:<n>``, schemas.api): never a name, but named with its run when given as one
MODEL_ID_RE = re.compile(r"(?P<session>[A-Za-z0-9][A-Za-z0-9_-]*):(?P<kind>train|sample):(?P<seq>[0-9]+)")


def echoed(value: object) -> str:
    """``repr(value)`` for an error message, cut to ``MAX_ECHOED`` characters and "…": the input is the client's,
    of any length, and the message goes into answers and logs."""
    text = repr(value)
    return text if len(text) <= MAX_ECHOED else text[:MAX_ECHOED] + "…"


class InvalidNameError(ValueError):
    """A name that would become a path or topic is not safe."""


def validate_name(value: str, kind: str = "name", max_length: int = MAX_NAME_LENGTH) -> str:
    """Return ``value`` if it is a safe name, else raise ``InvalidNameError`` naming the fix.

    ``max_length``: names built from others (a full topic name, a consumer group id) may be longer.
    """
    if not isinstance(value, str) or not value:
        raise InvalidNameError(f"{kind} must be a non-empty string")
    if len(value) > max_length:
        raise InvalidNameError(f"{kind} {value[:20]!r}... is {len(value)} characters; use at most {max_length}")
    tinker = MODEL_ID_RE.fullmatch(value)
    if tinker is not None:
        raise InvalidNameError(f"{kind} {value!r} is a Tinker model id: its run is "
                               f"'{tinker['session']}.{tinker['kind']}.{tinker['seq']}'")
    if ".." in value or not _NAME_RE.fullmatch(value):
        raise InvalidNameError(
            f"{kind} {value!r} is not allowed: use letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, without '..' or '/'"
        )
    return value


def case_twin_of(name: str, names: Iterable[str]) -> str | None:
    """The one of ``names`` differing from ``name`` only in case, when ``name`` itself is not among them; else
    None.  On a case-insensitive filesystem (macOS, Windows) the twin's folder is also ``name``'s, so only the
    listed names tell the two apart."""
    listed = list(names)
    if name in listed:
        return None
    return next((other for other in listed if other.lower() == name.lower()), None)
