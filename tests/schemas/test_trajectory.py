"""Trajectory and steps tables: validation of rows and tables."""

import pyarrow as pa
import pytest
from pydantic import ValidationError

from schemas.steps import StepsTableError, check_steps_table, steps_to_table
from schemas.trajectory import (
    NO_ADAPTER_SHA,
    SCHEMA_VERSION_KEY,
    TrajectoryRecord,
    TrajectoryTableError,
    check_trajectory_values,
    conform_table,
    records_to_table,
    table_to_records,
)
from schemas.versions import TRAJECTORY_SCHEMA_VERSION, SchemaVersionError


def row(**changes):
    base = dict(
        run_id="r", batch_id="b", episode_id="e", group_id="g", env="cartpole", env_seed=3, producer_id="p",
        policy_version=1, adapter_sha256=NO_ADAPTER_SHA, tokens=[5, 6, 7], loss_mask=[0, 1, 1],
        logprobs=[0.0, -0.5, -1.25], turn_rewards=[1.0], reward=1.0, num_turns=1, success=True,
        terminated=True, truncated=False,
    )
    base.update(changes)
    return base


def test_round_trip_keeps_values():
    records = [TrajectoryRecord(**row()), TrajectoryRecord(**row(episode_id="e2", tokens=[1], loss_mask=[1],
                                                                 logprobs=[-0.25], text="hi"))]
    back = table_to_records(records_to_table(records))
    assert back == records


@pytest.mark.parametrize(
    "change",
    [dict(loss_mask=[0, 1]), dict(logprobs=[0.0]), dict(tokens=[], loss_mask=[], logprobs=[])],
)
def test_length_mismatch_refused(change):
    with pytest.raises(ValidationError, match=r"same length|at least one token"):
        TrajectoryRecord(**row(**change))


@pytest.mark.parametrize("change, column", [
    (dict(reward=float("nan")), "reward"), (dict(return_to_go=float("inf")), "return_to_go"),
    (dict(turn_rewards=[0.0, float("-inf")]), "turn_rewards"), (dict(logprobs=[0.0, float("nan"), -1.0]), "logprobs"),
    (dict(weight=float("nan")), "weight"),
])
def test_numbers_a_learner_trains_on_must_be_finite(change, column):
    good = records_to_table([row(), row(episode_id="e2", weight=None)])
    check_trajectory_values(good)  # a null weight is no weight, not a bad one
    bad = records_to_table([row(), row(episode_id="e2", **change)])
    with pytest.raises(TrajectoryTableError, match=rf"column '{column}' holds a value that is not a finite number "
                                                   r"\(NaN or infinity\) in row 1 of 2"):
        check_trajectory_values(bad)


def test_negative_version_and_bad_mask_refused():
    with pytest.raises(ValidationError, match="policy_version"):
        TrajectoryRecord(**row(policy_version=-1))
    with pytest.raises(ValidationError, match="loss_mask"):
        TrajectoryRecord(**row(loss_mask=[0, 2, 1]))


def test_path_like_ids_refused():
    with pytest.raises(ValidationError, match="batch_id"):
        TrajectoryRecord(**row(batch_id="../../x"))


def test_newer_major_table_refused():
    table = records_to_table([row()])
    newer = table.replace_schema_metadata({SCHEMA_VERSION_KEY: b"2.0"})
    with pytest.raises(SchemaVersionError, match="upgrade rlpipe"):
        table_to_records(newer)


def test_missing_and_mistyped_columns_refused():
    table = records_to_table([row()])
    with pytest.raises(TrajectoryTableError, match="lacks column 'tokens'"):
        conform_table(table.drop_columns(["tokens"]))
    recast = table.set_column(table.schema.get_field_index("reward"), "reward", pa.array([1.0], pa.float64()))
    with pytest.raises(TrajectoryTableError, match="reward"):
        conform_table(recast)


def test_optional_columns_filled():
    table = records_to_table([row()]).drop_columns(["text", "weight"])
    assert conform_table(table).column("text").to_pylist() == [None]


def test_sampling_parameters_are_recorded_per_row():
    back = table_to_records(records_to_table([row(temperature=0.7, top_p=0.9, top_k=20)]))[0]
    assert (back.temperature, back.top_p, back.top_k) == (pytest.approx(0.7), pytest.approx(0.9), 20)
    assert TRAJECTORY_SCHEMA_VERSION == "1.2"
    with pytest.raises(ValidationError, match="top_p"):
        TrajectoryRecord(**row(top_p=0.0))


def test_files_from_before_the_sampling_columns_read_as_temperature_1_without_truncation():
    older = records_to_table([row()]).drop_columns(["temperature", "top_p", "top_k"])
    older = older.replace_schema_metadata({**older.schema.metadata, SCHEMA_VERSION_KEY: b"1.0"})
    back = table_to_records(older)[0]
    assert (back.temperature, back.top_p, back.top_k) == (1.0, 1.0, 0)


def test_steps_table_with_features():
    rows = [
        dict(episode_id="e", step=0, is_first=True, is_last=False, is_terminal=False, observation=[1.0, 2.0],
             action=[0.5], reward=-0.25, discount=1.0, features={"zone@temp": 293.5}),
        dict(episode_id="e", step=1, is_first=False, is_last=True, is_terminal=True, observation=[1.5, 2.0],
             action=[0.0], reward=-0.5, discount=0.0, features={"zone@temp": 294.0}),
    ]
    table = steps_to_table(rows, ["zone@temp"])
    assert check_steps_table(table) == ["zone@temp"]
    assert table.column("zone@temp").to_pylist() == [293.5, 294.0]
    assert table.column("is_last").to_pylist() == [False, True]
    with pytest.raises(StepsTableError, match="clash"):
        steps_to_table(rows, ["reward"])


def test_env_seed_beyond_the_int64_column_is_refused_by_the_record():
    """The record took any integer and the Parquet write then failed with an OverflowError."""
    records_to_table([row(env_seed=2**63 - 1)])
    with pytest.raises(ValidationError, match="env_seed"):
        TrajectoryRecord(**row(env_seed=2**63))
