"""The trajectory table: one row per token sequence, token-in / token-out.

Producer -> store -> learner.  The learner trains on exactly the tokens the
sampler saw and produced, so a row carries the token ids, a loss mask (1 on
tokens the policy generated) and the sampler's logprob of each generated token.
Short multi-turn episodes are one row; long-horizon environments write one row
per turn with ``turn`` and ``return_to_go`` so per-turn advantages can be formed.

Those logprobs are of the distribution each token was drawn from, so a row also
records how that distribution was shaped from the model's logits: ``temperature``
(0 = greedy, whose logprobs are the temperature-1 ones), ``top_p`` and ``top_k``
(0 = no top-k).  Together with the adapter they are the behaviour policy the
learner's importance ratios divide by.  Files written before these columns
(schema 1.0) read as 1.0 / 1.0 / 0: what every sampler then used.

A per-turn row of an environment with a numeric state (CartPole's cart and pole,
a board's cells) also carries ``state``: those numbers as the turn's prompt showed
them, for advantages against a baseline of the state (``advantage: gae``).  Null on
whole-episode rows, for environments without one, and in files before schema 1.2.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Annotated, Any

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas.names import validate_name
from schemas.versions import TRAJECTORY_SCHEMA_VERSION, check_readable

SCHEMA_VERSION_KEY = b"rlpipe.schema_version"
TABLE_KIND_KEY = b"rlpipe.table"

TRAJECTORY_FIELDS: list[pa.Field] = [
    pa.field("run_id", pa.string(), nullable=False),
    pa.field("batch_id", pa.string(), nullable=False),
    pa.field("episode_id", pa.string(), nullable=False),
    pa.field("group_id", pa.string(), nullable=False),
    pa.field("env", pa.string(), nullable=False),
    pa.field("env_seed", pa.int64(), nullable=False),
    pa.field("producer_id", pa.string(), nullable=False),
    pa.field("policy_version", pa.int32(), nullable=False),
    pa.field("adapter_sha256", pa.string(), nullable=False),
    pa.field("tokens", pa.list_(pa.int32()), nullable=False),
    pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
    pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
    pa.field("temperature", pa.float32(), nullable=False),
    pa.field("top_p", pa.float32(), nullable=False),
    pa.field("top_k", pa.int32(), nullable=False),
    pa.field("turn_rewards", pa.list_(pa.float32()), nullable=False),
    pa.field("reward", pa.float32(), nullable=False),
    pa.field("turn", pa.int32(), nullable=False),
    pa.field("return_to_go", pa.float32(), nullable=False),
    pa.field("num_turns", pa.int32(), nullable=False),
    pa.field("success", pa.bool_(), nullable=False),
    pa.field("terminated", pa.bool_(), nullable=False),
    pa.field("truncated", pa.bool_(), nullable=False),
    pa.field("created_at", pa.timestamp("us", tz="UTC"), nullable=False),
    pa.field("weight", pa.float32(), nullable=True),  # optional per-sample weight (offline data)
    pa.field("text", pa.string(), nullable=True),  # optional decoded transcript, for people
    pa.field("state", pa.list_(pa.float32()), nullable=True),  # per-turn rows: the numbers the prompt showed
]

TRAJECTORY_SCHEMA = pa.schema(
    TRAJECTORY_FIELDS,
    metadata={SCHEMA_VERSION_KEY: TRAJECTORY_SCHEMA_VERSION.encode(), TABLE_KIND_KEY: b"trajectories"},
)

# Columns added after 1.0, and the value they have in files written before them.
ADDED_COLUMN_DEFAULTS: dict[str, float | int] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}

NO_ADAPTER_SHA = "0" * 64  # the base model (version 0) has no adapter


class TrajectoryRecord(BaseModel):
    """One trajectory row, validated: lengths agree, mask is 0/1, versions are non-negative."""

    model_config = ConfigDict(extra="forbid")

    run_id: str
    batch_id: str
    episode_id: str
    group_id: str
    env: str
    env_seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]  # the int64 column
    producer_id: str
    policy_version: Annotated[int, Field(ge=0, le=2**31 - 1)]
    adapter_sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    tokens: list[Annotated[int, Field(ge=0, le=2**31 - 1)]]
    loss_mask: list[Annotated[int, Field(ge=0, le=1)]]
    logprobs: list[float]
    temperature: Annotated[float, Field(ge=0.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    turn_rewards: list[float]
    reward: float
    turn: Annotated[int, Field(ge=0)] = 0
    return_to_go: float = 0.0
    num_turns: Annotated[int, Field(ge=0)]
    success: bool
    terminated: bool
    truncated: bool
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    weight: float | None = None
    text: str | None = None
    state: list[float] | None = None

    @field_validator("run_id", "batch_id", "producer_id")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        return validate_name(value, "id")

    @model_validator(mode="after")
    def _lengths_agree(self) -> TrajectoryRecord:
        n = len(self.tokens)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(
                f"tokens ({n}), loss_mask ({len(self.loss_mask)}) and logprobs ({len(self.logprobs)}) "
                "must have the same length"
            )
        if n == 0:
            raise ValueError("a trajectory row needs at least one token")
        if self.created_at.tzinfo is None:
            self.created_at = self.created_at.replace(tzinfo=UTC)
        return self


class TrajectoryTableError(ValueError):
    """A table that is not a valid trajectory table."""


def discounted_returns(rewards: Sequence[float], discount: float) -> list[float]:
    """The ``return_to_go`` of each step: G_t = r_t + discount * G_{t+1}, with G = 0 after the last step."""
    out = [0.0] * len(rewards)
    running = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = float(rewards[t]) + discount * running
        out[t] = running
    return out


def records_to_table(records: Iterable[TrajectoryRecord | dict]) -> pa.Table:
    """Validated records -> Arrow table with the trajectory schema (and its version)."""
    rows = [r if isinstance(r, TrajectoryRecord) else TrajectoryRecord.model_validate(r) for r in records]
    columns = {f.name: [getattr(r, f.name) for r in rows] for f in TRAJECTORY_FIELDS}
    return pa.Table.from_pydict(columns, schema=TRAJECTORY_SCHEMA)


def check_trajectory_table(table: pa.Table) -> None:
    """Refuse a table with a newer major version or missing/mistyped columns."""
    meta = table.schema.metadata or {}
    version = meta.get(SCHEMA_VERSION_KEY)
    if version is None:
        raise TrajectoryTableError("trajectory table has no schema_version in its metadata; was it written by rlpipe?")
    check_readable(version.decode(), TRAJECTORY_SCHEMA_VERSION, "trajectory table")
    for f in TRAJECTORY_FIELDS:
        if f.name not in table.schema.names:
            if f.nullable or f.name in ADDED_COLUMN_DEFAULTS:
                continue
            raise TrajectoryTableError(f"trajectory table lacks column {f.name!r}")
        actual = table.schema.field(f.name).type
        if actual != f.type:
            raise TrajectoryTableError(f"column {f.name!r} has type {actual}, expected {f.type}")


FINITE_COLUMNS = ("reward", "return_to_go", "turn_rewards", "logprobs", "weight")  # numbers a learner trains on


def non_finite_column(rows: Iterable[Mapping[str, Any]]) -> str | None:
    """The first of ``FINITE_COLUMNS`` holding NaN or an infinity in any of ``rows`` (dicts), or None."""
    for row in rows:
        for name in FINITE_COLUMNS:
            value = row.get(name)
            values = value if isinstance(value, list) else [] if value is None else [value]
            if not all(map(math.isfinite, values)):
                return name
    return None


def check_trajectory_values(table: pa.Table) -> None:
    """Refuse a table whose rewards, returns, logprobs or weights hold NaN or an infinity (nulls pass)."""
    for name in FINITE_COLUMNS:
        if name not in table.schema.names:
            continue
        column = table.column(name)
        flat = pc.list_flatten(column) if pa.types.is_list(column.type) else column
        if pc.all(pc.is_finite(flat)).as_py() is False:
            rows = [i for i, value in enumerate(column.to_pylist())
                    if value is not None and not all(map(math.isfinite, value if isinstance(value, list) else [value]))]
            raise TrajectoryTableError(
                f"column {name!r} holds a value that is not a finite number (NaN or infinity) in row {rows[0]} of "
                f"{table.num_rows}; the producer wrote it: fix what computes {name} (the environment's reward?)")


def conform_table(table: pa.Table) -> pa.Table:
    """Check a trajectory table and return it with exactly the current columns (missing ones at their defaults)."""
    check_trajectory_table(table)
    arrays = [
        table.column(f.name) if f.name in table.schema.names else _missing_column(f, table.num_rows)
        for f in TRAJECTORY_FIELDS
    ]
    return pa.Table.from_arrays(arrays, schema=TRAJECTORY_SCHEMA)


def _missing_column(field: pa.Field, num_rows: int) -> pa.Array:
    """An older file's column: its default where it has one, else nulls (optional columns)."""
    if field.name in ADDED_COLUMN_DEFAULTS:
        return pa.array([ADDED_COLUMN_DEFAULTS[field.name]] * num_rows, type=field.type)
    return pa.nulls(num_rows, field.type)


MIN_SAMPLING_TEMPERATURE = 0.01  # the lowest temperature vLLM samples at (it raises one below it to this)


def behaviour_policy_problem(temperature: float, top_p: float, top_k: int) -> str | None:
    """Why importance ratios against rows sampled this way would be wrong, or None when they are right.

    The learner reproduces the sampler's temperature exactly (logits / T) but not
    a nucleus or top-k cut, and a greedy sampler (temperature 0) has no
    distribution to correct for: every member of a group gives the same answer.
    """
    if temperature == 0.0:
        return "greedy sampling (temperature 0) has no sampling distribution to correct for"
    if temperature < MIN_SAMPLING_TEMPERATURE:
        return (f"temperature {temperature:g} is below {MIN_SAMPLING_TEMPERATURE:g}, where vLLM samples at "
                f"{MIN_SAMPLING_TEMPERATURE:g} instead: the row's temperature is not the one sampled with")
    if top_p < 1.0:
        return f"top_p {top_p:g} truncates the sampling distribution in a way the learner does not reproduce"
    if top_k > 0:
        return f"top_k {top_k} truncates the sampling distribution in a way the learner does not reproduce"
    return None


def table_to_records(table: pa.Table) -> list[TrajectoryRecord]:
    """Arrow table -> validated records (every row is checked)."""
    table = conform_table(table)
    return [TrajectoryRecord.model_validate(row) for row in table.to_pylist()]


def tokens_in(rows: Sequence[TrajectoryRecord]) -> tuple[int, int]:
    """(all tokens, generated tokens) over ``rows``."""
    return sum(len(r.tokens) for r in rows), sum(sum(r.loss_mask) for r in rows)
