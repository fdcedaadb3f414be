"""Property: any valid trajectory record survives Arrow and Parquet unchanged.

Floats are drawn float32-representable (the columns are float32), timestamps at
microsecond resolution in UTC (the column is timestamp[us, UTC]).
"""

from __future__ import annotations

import io
from datetime import UTC, datetime

import pyarrow.parquet as pq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.trajectory import TRAJECTORY_SCHEMA, TrajectoryRecord, records_to_table, table_to_records

names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True).filter(lambda s: ".." not in s)
floats32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
sha = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)
moments = st.datetimes(min_value=datetime(1971, 1, 1), max_value=datetime(2200, 1, 1), timezones=st.just(UTC))


@st.composite
def records(draw: st.DrawFn) -> TrajectoryRecord:
    length = draw(st.integers(1, 12))
    return TrajectoryRecord(
        run_id=draw(names),
        batch_id=draw(names),
        episode_id=draw(st.text(max_size=10)),
        group_id=draw(st.text()),
        env=draw(st.text(max_size=10)),
        env_seed=draw(st.integers(-(2**63), 2**63 - 1)),
        producer_id=draw(names),
        policy_version=draw(st.integers(0, 2**31 - 1)),
        adapter_sha256=draw(sha),
        tokens=draw(st.lists(st.integers(0, 2**31 - 1), min_size=length, max_size=length)),
        loss_mask=draw(st.lists(st.integers(0, 1), min_size=length, max_size=length)),
        logprobs=draw(st.lists(floats32, min_size=length, max_size=length)),
        turn_rewards=draw(st.lists(floats32, max_size=5)),
        reward=draw(floats32),
        turn=draw(st.integers(0, 2**31 - 1)),
        return_to_go=draw(floats32),
        num_turns=draw(st.integers(0, 2**31 - 1)),
        success=draw(st.booleans()),
        terminated=draw(st.booleans()),
        truncated=draw(st.booleans()),
        created_at=draw(moments),
        weight=draw(st.none() | floats32),
        text=draw(st.none() | st.text(max_size=30)),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(records(), min_size=1, max_size=4))
def test_records_survive_arrow_and_parquet(rows: list[TrajectoryRecord]) -> None:
    table = records_to_table(rows)
    assert table.schema == TRAJECTORY_SCHEMA
    assert table_to_records(table) == rows
    sink = io.BytesIO()
    pq.write_table(table, sink)
    from_parquet = pq.read_table(io.BytesIO(sink.getvalue()))
    assert from_parquet.schema.metadata == TRAJECTORY_SCHEMA.metadata
    assert table_to_records(from_parquet) == rows
