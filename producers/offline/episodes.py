"""A time-sorted log cut into episodes and per-day steps tables, shared by both importers,
and the error every offline step raises for input it cannot use.

Episodes are local days or stretches without gaps (``pipeline.io.steps_arrays.episode_starts``);
each local date on which episodes start becomes one partition of the dataset.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.io.steps_arrays import US_PER_SECOND, EpisodeSplit, steps_table_from_arrays

DEFAULT_STEP_SECONDS = 300.0


class DatasetImportError(ValueError):
    """Source files that cannot be imported as asked; the message names the fix."""


def episode_id_for(start_us: int) -> str:
    """An episode's id: its first step's UTC time, e.g. ``20230105T080000Z`` (unique in a time-sorted log)."""
    return dt.datetime.fromtimestamp(start_us / US_PER_SECOND, tz=dt.UTC).strftime("%Y%m%dT%H%M%SZ")


def local_date(times_us: np.ndarray | int, utc_offset_hours: float) -> Any:
    """Local calendar date(s) of UTC epoch microseconds."""
    shifted = np.asarray(times_us, dtype=np.int64) + int(utc_offset_hours * 3600 * US_PER_SECOND)
    return shifted.astype("datetime64[us]").astype("datetime64[D]")


def day_tables(
    times_us_R: np.ndarray | None,
    days_E: Sequence[dt.date],
    starts_E: np.ndarray,
    episode_ids: Sequence[str],
    features: dict[str, np.ndarray],
    columns: tuple[Sequence[str], Sequence[str], str],
    terminal_R: np.ndarray | None = None,
) -> Iterator[tuple[dt.date, pa.Table]]:
    """Steps tables, one per date on which episodes start (``days_E``: the partition of each episode).

    ``columns`` = (observation columns, action columns, reward column).  Episodes of one
    date must be contiguous (true of a time-sorted log).
    """
    observation, action, reward = columns
    n_rows = int(features[reward].shape[0])
    bounds_E = np.append(starts_E, n_rows)
    first = 0
    while first < len(starts_E):
        last = first
        while last + 1 < len(starts_E) and days_E[last + 1] == days_E[first]:
            last += 1
        lo, hi = int(bounds_E[first]), int(bounds_E[last + 1])
        table = steps_table_from_arrays(
            episode_ids[first:last + 1], starts_E[first:last + 1] - lo,
            None if times_us_R is None else times_us_R[lo:hi],
            {name: values[lo:hi] for name, values in features.items()}, observation, action,
            features[reward][lo:hi], None if terminal_R is None else terminal_R[lo:hi],
        )
        yield days_E[first], table
        first = last + 1


def episode_days(times_us_R: np.ndarray, starts_E: np.ndarray, utc_offset_hours: float) -> list[dt.date]:
    """The local date each episode starts on: its partition."""
    return [d.astype(dt.date) for d in local_date(times_us_R[starts_E], utc_offset_hours)]


def median_step(times_us_R: np.ndarray) -> float:
    """The log's step in seconds: the median gap between rows (``DEFAULT_STEP_SECONDS`` for one row)."""
    gaps = np.diff(times_us_R)
    return float(np.median(gaps)) / US_PER_SECOND if gaps.size else DEFAULT_STEP_SECONDS


def episode_rule(split: EpisodeSplit, offset: float) -> str:
    """How the log was cut into episodes, in words, for the dataset card."""
    gap = "a gap of more than 1.5 steps ends an episode"
    return f"one episode per local day (UTC{offset:+g} h); {gap}" if split == "day" else f"{gap}; no other splits"
