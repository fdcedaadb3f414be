"""The RLDS-like steps table: one row per environment step.

Environment or importer -> store -> learner/report.  It serves environments and
logged datasets that are not token streams (building telemetry): numeric
``observation`` and ``action`` vectors, the reward and the episode boundaries,
plus any number of typed feature columns (``device@field`` telemetry, float64).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa

from schemas.trajectory import SCHEMA_VERSION_KEY, TABLE_KIND_KEY
from schemas.versions import STEPS_SCHEMA_VERSION, check_readable

STEPS_BASE_FIELDS: list[pa.Field] = [
    pa.field("episode_id", pa.string(), nullable=False),
    pa.field("step", pa.int64(), nullable=False),
    pa.field("timestamp", pa.timestamp("us", tz="UTC"), nullable=True),
    pa.field("is_first", pa.bool_(), nullable=False),
    pa.field("is_last", pa.bool_(), nullable=False),
    pa.field("is_terminal", pa.bool_(), nullable=False),
    pa.field("observation", pa.list_(pa.float32()), nullable=False),
    pa.field("action", pa.list_(pa.float32()), nullable=False),
    pa.field("reward", pa.float32(), nullable=False),
    pa.field("discount", pa.float32(), nullable=False),
]
_BASE_NAMES = {f.name for f in STEPS_BASE_FIELDS}
# in a value actor's batch: its event's fields (less path and digest) as JSON, for announcing it after a crash
BATCH_SUMMARY_KEY = b"rlpipe.batch_summary"


class StepsTableError(ValueError):
    """A table that is not a valid steps table."""


def steps_schema(feature_names: Sequence[str] = ()) -> pa.Schema:
    """The steps schema with ``feature_names`` as extra float64 columns, in the given order."""
    clash = _BASE_NAMES.intersection(feature_names)
    if clash:
        raise StepsTableError(f"feature names {sorted(clash)} clash with the steps table's own columns; rename them")
    fields = STEPS_BASE_FIELDS + [pa.field(name, pa.float64(), nullable=True) for name in feature_names]
    return pa.schema(fields, metadata={SCHEMA_VERSION_KEY: STEPS_SCHEMA_VERSION.encode(), TABLE_KIND_KEY: b"steps"})


def steps_to_table(records: Iterable[Mapping[str, Any]], feature_names: Sequence[str] = ()) -> pa.Table:
    """Step dicts (base fields plus a ``features`` mapping or flat feature keys) -> Arrow table."""
    schema = steps_schema(feature_names)
    rows = list(records)
    columns: dict[str, list[Any]] = {f.name: [] for f in schema}
    for i, row in enumerate(rows):
        features = row.get("features") or {}
        for f in STEPS_BASE_FIELDS:
            if f.name not in row and not f.nullable:
                raise StepsTableError(f"step row {i} lacks {f.name!r}")
            columns[f.name].append(row.get(f.name))
        for name in feature_names:
            columns[name].append(features.get(name, row.get(name)))
    return pa.Table.from_pydict(columns, schema=schema)


def check_steps_table(table: pa.Table) -> list[str]:
    """Refuse a newer major version or missing base columns; return the feature column names."""
    meta = table.schema.metadata or {}
    version = meta.get(SCHEMA_VERSION_KEY)
    if version is None:
        raise StepsTableError("steps table has no schema_version in its metadata; was it written by rlpipe?")
    check_readable(version.decode(), STEPS_SCHEMA_VERSION, "steps table")
    for f in STEPS_BASE_FIELDS:
        if f.name not in table.schema.names:
            raise StepsTableError(f"steps table lacks column {f.name!r}")
        if table.schema.field(f.name).type != f.type:
            raise StepsTableError(f"steps column {f.name!r} has type {table.schema.field(f.name).type}, expected {f.type}")
    return [name for name in table.schema.names if name not in _BASE_NAMES]
