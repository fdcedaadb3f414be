"""Steps tables built from column arrays: where episodes start in a log, and the vectorised table.

Pure functions (no store): the importers (``producers.offline``) cut a time-sorted
log into episodes with ``episode_starts`` and turn each partition's arrays into a
steps table (``schemas.steps``) with ``steps_table_from_arrays``, which they hand
to ``pipeline.io.datasets.DatasetWriter``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import pyarrow as pa

from pipeline.io.datasets import TIMESTAMP_TYPE, DatasetError

US_PER_SECOND = 1_000_000
US_PER_DAY = 86_400 * US_PER_SECOND
EpisodeSplit = Literal["day", "gap"]


def episode_starts(
    times_us_R: np.ndarray, step_seconds: float, split: EpisodeSplit = "day", utc_offset_hours: float = 0.0
) -> np.ndarray:
    """Row indices where episodes start in a time-sorted log: the first row, after every gap longer
    than 1.5 steps, and (``split="day"``) at every local midnight (UTC + ``utc_offset_hours``).

    Why days: logged building data has no episodes; a local day is the unit an operator
    plans in, the span of the simulator's default episode, and its comfort schedule.
    """
    times_us_R = np.asarray(times_us_R, dtype=np.int64)
    if times_us_R.size == 0:
        return np.zeros(0, dtype=np.int64)
    gaps_R = np.diff(times_us_R)
    if np.any(gaps_R <= 0):
        bad = int(np.flatnonzero(gaps_R <= 0)[0]) + 1
        raise DatasetError(f"timestamps must strictly increase; row {bad} does not follow row {bad - 1}")
    breaks_R = np.zeros(times_us_R.size, dtype=bool)
    breaks_R[0] = True
    breaks_R[1:] |= gaps_R > 1.5 * step_seconds * US_PER_SECOND
    if split == "day":
        local_day_R = (times_us_R + int(utc_offset_hours * 3600 * US_PER_SECOND)) // US_PER_DAY
        breaks_R[1:] |= local_day_R[1:] != local_day_R[:-1]
    elif split != "gap":
        raise DatasetError(f"unknown episode split {split!r}; choose day or gap")
    return np.flatnonzero(breaks_R)


def steps_table_from_arrays(
    episode_ids: Sequence[str],
    starts_E: np.ndarray,
    times_us_R: np.ndarray | None,
    features: dict[str, np.ndarray],
    observation_columns: Sequence[str],
    action_columns: Sequence[str],
    reward_R: np.ndarray,
    terminal_R: np.ndarray | None = None,
) -> pa.Table:
    """One steps table from column arrays (vectorised; no per-row Python).

    Rows are in episode order; episode ``e`` covers rows ``starts_E[e]`` up to the next
    start.  ``features`` are float64 columns (in order); the observation and action
    vectors stack the named features as float32.  ``terminal_R`` marks rows where the
    episode truly ended (discount 0); a log that just stops is not terminal.
    """
    from schemas.steps import steps_schema

    n_rows = int(reward_R.shape[0])
    starts_E = np.asarray(starts_E, dtype=np.int64)
    if len(episode_ids) != starts_E.size:
        raise DatasetError(f"{len(episode_ids)} episode ids for {starts_E.size} episode starts")
    lengths_E = np.diff(np.append(starts_E, n_rows))
    step_R = np.arange(n_rows, dtype=np.int64) - np.repeat(starts_E, lengths_E)
    is_last_R = np.zeros(n_rows, dtype=bool)
    is_last_R[np.append(starts_E[1:], n_rows) - 1] = True
    terminal_R = np.zeros(n_rows, dtype=bool) if terminal_R is None else np.asarray(terminal_R, dtype=bool)
    columns = {
        "episode_id": pa.array(np.repeat(np.asarray(episode_ids, dtype=object), lengths_E), type=pa.string()),
        "step": pa.array(step_R),
        "timestamp": pa.nulls(n_rows, TIMESTAMP_TYPE) if times_us_R is None
        else pa.array(np.asarray(times_us_R, dtype=np.int64), type=pa.int64()).cast(TIMESTAMP_TYPE),
        "is_first": pa.array(step_R == 0),
        "is_last": pa.array(is_last_R),
        "is_terminal": pa.array(terminal_R),
        "observation": _vector_column([features[c] for c in observation_columns], n_rows),
        "action": _vector_column([features[c] for c in action_columns], n_rows),
        "reward": pa.array(np.asarray(reward_R, dtype=np.float32)),
        "discount": pa.array(np.where(terminal_R, 0.0, 1.0).astype(np.float32)),
    }
    for name, values in features.items():
        columns[name] = pa.array(np.asarray(values, dtype=np.float64))
    schema = steps_schema(list(features))
    return pa.Table.from_arrays([columns[f.name] for f in schema], schema=schema)


def _vector_column(columns: list[np.ndarray], n_rows: int) -> pa.Array:
    """Rows of a list<float32> column from per-column arrays (offsets 0, k, 2k, ...)."""
    width = len(columns)
    if n_rows * width >= 2**31:
        raise DatasetError(f"{n_rows} rows x {width} values overflow one list column; import fewer rows per partition")
    offsets = pa.array(np.arange(n_rows + 1, dtype=np.int32) * width)
    values = np.stack(columns, axis=1).astype(np.float32).ravel() if width else np.zeros(0, np.float32)
    return pa.ListArray.from_arrays(offsets, pa.array(values, type=pa.float32()))
