"""Import of a CSV or Parquet log with a column mapping (``TableMapping``, a YAML or JSON file) as a dataset."""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import re
from collections import Counter
from pathlib import Path
from typing import Literal

import numpy as np
import polars as pl
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pipeline.io.datasets import DatasetCard, DatasetField, DatasetWriter
from pipeline.io.steps_arrays import EpisodeSplit, episode_starts
from pipeline.io.store import ObjectStore
from producers.offline.episodes import (
    DatasetImportError,
    day_tables,
    episode_days,
    episode_id_for,
    episode_rule,
    median_step,
)

log = logging.getLogger("rlpipe.datasets")


class TableMapping(BaseModel):
    """Which columns of a CSV or Parquet log are what (a YAML or JSON file); the rest become features."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    episode_id: str | None = Field(None, description="column naming the episode; None: split by day or gap")
    timestamp: str | None = Field(None, description="column with the step time; None: file order, no times")
    timestamp_unit: Literal["s", "ms", "us", "ns"] = Field("s", description="unit of a numeric timestamp column")
    observation: list[str] = Field(default_factory=list, description="columns stacked into the observation vector")
    action: list[str] = Field(default_factory=list, description="columns stacked into the action vector")
    reward: str = Field(description="the reward column")
    terminal: str | None = Field(None, description="column that is true where an episode truly ended")
    units: dict[str, str] = Field(default_factory=dict, description="column -> unit, for the card")
    exclude: list[str] = Field(default_factory=list, description="columns not to keep as features")
    episode_split: EpisodeSplit = Field("day", description="without episode_id: one episode per day, or per gap")
    utc_offset_hours: float = Field(0.0, ge=-12, le=14, description="local time = UTC + this (days, partitions)")
    description: str = Field("", max_length=4096, description="text for the dataset card")

    @field_validator("observation", "action")
    @classmethod
    def _unique(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("a column is listed twice")
        return value


def load_mapping(path: str | Path) -> TableMapping:
    """A column mapping from a YAML or JSON file, with a one-line error naming the bad key."""
    import yaml

    file = Path(path)
    if file.is_dir():
        raise DatasetImportError(f"mapping file {str(file)!r} is a folder; give the path of a YAML or JSON file")
    if not file.is_file():
        raise DatasetImportError(f"mapping file {str(file)!r} does not exist; give the path of a YAML or JSON file")
    try:
        raw = yaml.safe_load(file.read_text())
        return TableMapping.model_validate(raw)
    except UnicodeDecodeError as exc:
        raise DatasetImportError(f"mapping file {str(file)!r} is not text ({exc.reason} at byte {exc.start}); "
                                 "give a YAML or JSON file") from None
    except yaml.YAMLError as exc:
        raise DatasetImportError(f"{file} is not YAML/JSON: {str(exc).splitlines()[0]}") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        raise DatasetImportError(
            f"{file}: {'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
        ) from None


def import_table(
    store: ObjectStore, path: str | Path, name: str, mapping: TableMapping, source: str = "table"
) -> DatasetCard:
    """Import a CSV or Parquet log as dataset ``name`` using ``mapping``; return the card.

    Rows are grouped by episode (episodes ordered by their first time, or first
    appearance without times) and sorted by time within each; a terminal row ends its
    episode.  Numeric columns the
    mapping does not claim become features; other columns are left out (logged).
    """
    file = Path(path)
    frame = _ordered_frame(_read_frame(file), mapping, file.name)
    times_us = frame[_TIME].to_numpy() if mapping.timestamp else None
    if times_us is not None:
        _require_each_time_once(frame, _EPISODE if mapping.episode_id else None, times_us, file.name)
    features, fields = _table_features(frame, mapping, file.name)
    terminal = _terminal_flags(frame, mapping.terminal, file.name) if mapping.terminal else None
    starts, episode_ids = _table_episodes(frame, mapping, times_us, terminal, file.name)
    days = (episode_days(times_us, starts, mapping.utc_offset_hours) if times_us is not None
            else [dt.date(1970, 1, 1)] * len(starts))  # no times: one partition
    renamed = {f.source_id: f.name for f in fields}
    columns = ([renamed[c] for c in mapping.observation], [renamed[c] for c in mapping.action],
               renamed[mapping.reward])
    writer = DatasetWriter(store, name).open()
    for day, table in day_tables(times_us, days, starts, episode_ids, features, columns, terminal):
        writer.write_partition(day, table)
    return writer.commit(
        source=source, description=mapping.description,
        source_files={file.name: hashlib.sha256(file.read_bytes()).hexdigest()}, fields=fields,
        observation_columns=columns[0], action_columns=columns[1], reward_column=columns[2],
        episode_rule=_episode_rule(mapping),
        step_seconds=median_step(times_us) if times_us is not None and times_us.size > 1 else None,
        extras={"layout": "table", "mapping": mapping.model_dump(mode="json")},
    )


_ROW, _TIME, _FIRST = "__rlpipe_row", "__rlpipe_time_us", "__rlpipe_episode_first"
_EPISODE = "__rlpipe_episode"  # the episode column as text, a named episode cut at its gaps (``_split_at_gaps``)


def _read_frame(file: Path) -> pl.DataFrame:
    if not file.is_file():
        what = "is a folder" if file.is_dir() else "does not exist"
        raise DatasetImportError(f"{file} {what}; give the path of a .csv or .parquet file")
    suffix = file.suffix.lower()
    if suffix not in (".csv", ".parquet", ".pq"):
        raise DatasetImportError(f"{file.name}: only .csv and .parquet files can be imported")
    kind = "CSV" if suffix == ".csv" else "Parquet"
    not_text = DatasetImportError(f"{file.name} is not a readable CSV: it is not UTF-8 text (a binary file, or "
                                  "text in another encoding); export the log as a UTF-8 CSV")
    try:
        if kind == "Parquet":
            return pl.read_parquet(file)
        frame = pl.read_csv(file, try_parse_dates=True, infer_schema_length=10_000)
    except pl.exceptions.PolarsError as exc:  # not the format its name says, or a damaged file
        if kind == "CSV" and "utf-8" in str(exc).lower():
            raise not_text from None
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DatasetImportError(
            f"{file.name} cannot be read as {kind} ({reason}); check the file, or give it the suffix of its format"
        ) from None
    if any(_NOT_TEXT.search(column) for column in frame.columns):  # polars reads a header's bad bytes leniently
        raise not_text
    return frame


# what no text header holds: U+FFFD (a byte that is not UTF-8, read leniently) and control characters
_NOT_TEXT = re.compile("[\ufffd\x00-\x08\x0e-\x1f]")


def _ordered_frame(frame: pl.DataFrame, mapping: TableMapping, where: str) -> pl.DataFrame:
    """Check the mapped columns exist; add the time (UTC us) and sort rows by episode, then time."""
    named = [c for c in (mapping.episode_id, mapping.timestamp, mapping.reward, mapping.terminal,
                         *mapping.observation, *mapping.action) if c is not None]
    missing = [c for c in named if c not in frame.columns]
    if missing:
        raise DatasetImportError(f"{where} has no columns {missing}; fix the mapping (it has {frame.columns})")
    frame = frame.with_row_index(_ROW)
    if mapping.timestamp:
        frame = frame.with_columns(pl.Series(_TIME, _times_us(frame[mapping.timestamp], mapping)))
    within = _TIME if mapping.timestamp else _ROW
    if mapping.episode_id is None:
        return frame.sort(within)
    frame = frame.with_columns(pl.col(mapping.episode_id).cast(pl.Utf8).alias(_EPISODE))
    if mapping.timestamp:
        frame = _split_at_gaps(frame.sort([_EPISODE, _TIME]))
    frame = frame.with_columns(pl.col(within).min().over(_EPISODE).alias(_FIRST))
    return frame.sort([_FIRST, _EPISODE, within])


def _split_at_gaps(frame: pl.DataFrame) -> pl.DataFrame:
    """Cut each named episode (rows sorted by episode, then time) after every gap longer than 1.5 steps
    (the median step within episodes): the parts after the first are ``<id>-1``, ``<id>-2``, ..., skipping
    any name another episode of the log already has (``_distinct``).

    Why: no action was logged across the gap, so the row before it is not one step from the row after.
    """
    codes_R, times_R = frame[_EPISODE].to_numpy(), frame[_TIME].to_numpy()
    same_R = codes_R[1:] == codes_R[:-1]
    gaps_R = np.diff(times_R)[same_R]
    if not gaps_R.size:
        return frame
    breaks_R = np.append(False, same_R & (np.diff(times_R) > 1.5 * float(np.median(gaps_R))))
    if not breaks_R.any():
        return frame
    part_R = np.cumsum(np.append(True, ~same_R) | breaks_R) - 1  # index of the part each row is in
    part_start_P = np.flatnonzero(np.diff(part_R, prepend=-1))
    names_P = _distinct([codes_R[s] for s in part_start_P])
    return frame.with_columns(pl.Series(_EPISODE, [names_P[p] for p in part_R], dtype=pl.Utf8))


def _times_us(column: pl.Series, mapping: TableMapping) -> np.ndarray:
    """A time column as UTC epoch microseconds (naive datetimes are taken as UTC)."""
    if column.dtype == pl.Utf8:
        column = column.str.to_datetime(time_zone="UTC", strict=False)
    if isinstance(column.dtype, pl.Datetime):
        if column.dtype.time_zone is not None:
            column = column.dt.convert_time_zone("UTC").dt.replace_time_zone(None)
        values = column.dt.cast_time_unit("us").cast(pl.Int64)
    elif column.dtype.is_numeric():
        scale = {"s": 1e6, "ms": 1e3, "us": 1.0, "ns": 1e-3}[mapping.timestamp_unit]
        values = (column.cast(pl.Float64) * scale).round(0).cast(pl.Int64)
    else:
        raise DatasetImportError(f"column {mapping.timestamp!r} ({column.dtype}) is not a time; map another column")
    if values.null_count():
        raise DatasetImportError(f"column {mapping.timestamp!r} has {values.null_count()} missing or unreadable times")
    return values.to_numpy()


def _require_each_time_once(frame: pl.DataFrame, episode_id: str | None, times_us: np.ndarray, where: str) -> None:
    """Refuse a time logged twice in one episode (in the whole log without an episode column), naming the
    first such time and its first two rows: a step logged twice would train twice, as a step of no duration."""
    same_R = times_us[1:] == times_us[:-1]
    if episode_id is not None:
        codes = frame[episode_id].cast(pl.Utf8).to_numpy()
        same_R &= codes[1:] == codes[:-1]
    if not same_R.any():
        return
    first = int(np.argmax(same_R)) + 1
    twins = times_us == times_us[first]
    if episode_id is not None:
        twins &= codes == codes[first]
    rows = sorted(int(r) + 1 for r in frame[_ROW].to_numpy()[twins])
    moment = dt.datetime(1970, 1, 1) + dt.timedelta(microseconds=int(times_us[first]))
    episode = f" of episode {codes[first]!r}" if episode_id is not None else ""
    raise DatasetImportError(
        f"{where}: rows {rows[0]} and {rows[1]}{episode} both log {moment:%Y-%m-%d %H:%M:%S} UTC; an episode holds "
        "each time once: drop the repeated rows"
    )


def _table_features(
    frame: pl.DataFrame, mapping: TableMapping, where: str
) -> tuple[dict[str, np.ndarray], list[DatasetField]]:
    """Numeric (and boolean) columns -> float64 features with roles, in file order."""
    from schemas.steps import STEPS_BASE_FIELDS

    base = {f.name for f in STEPS_BASE_FIELDS}
    skip = {mapping.episode_id, mapping.timestamp, mapping.terminal, _ROW, _TIME, _FIRST, _EPISODE,
            *mapping.exclude}
    roles = {c: "observation" for c in mapping.observation} | {c: "action" for c in mapping.action}
    roles[mapping.reward] = "reward"
    features, fields = {}, []
    for column in frame.columns:
        if column in skip:
            continue
        dtype = frame[column].dtype
        if not (dtype.is_numeric() or dtype == pl.Boolean):
            if column in roles:
                raise DatasetImportError(f"{where}: column {column!r} ({dtype}) must be numeric")
            log.warning("%s: column %s (%s) is not numeric; left out of the features", where, column, dtype)
            continue
        name = f"col:{column}" if column in base else column
        features[name] = frame[column].cast(pl.Float64).fill_null(float("nan")).to_numpy()
        if roles.get(column) in ("action", "reward"):
            _require_finite(frame, column, roles[column], features[name], where)
        fields.append(DatasetField(name=name, role=roles.get(column, "feature"), source_id=column,
                                   unit=mapping.units.get(column)))
    return features, fields


def _require_finite(frame: pl.DataFrame, column: str, role: str, values: np.ndarray, where: str) -> None:
    """Every step needs its action and reward: a missing or non-finite one is refused, naming the first row."""
    finite = np.isfinite(values)
    if not finite.all():
        first = int(np.argmin(finite))
        raise DatasetImportError(
            f"{where}: column {column!r} ({role}) has a missing or non-finite value at {_row_name(frame, first)}; "
            "fill it in or drop the row"
        )


_FLAGS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def _terminal_flags(frame: pl.DataFrame, column: str, where: str) -> np.ndarray:
    """The terminal column as booleans: true/false, yes/no or 1/0 (text in any case, numbers or booleans);
    a missing cell is false; anything else is refused, naming the first such row."""
    values = frame[column]
    if values.dtype == pl.Boolean:
        return values.fill_null(False).to_numpy()
    if values.dtype.is_numeric():
        numbers = values.cast(pl.Float64)
        flags, readable = numbers == 1.0, numbers.is_in([0.0, 1.0]) | numbers.is_null()
    else:
        words = values.cast(pl.Utf8).str.strip_chars().str.to_lowercase()
        flags = words.replace_strict(_FLAGS, default=None, return_dtype=pl.Boolean)
        readable = flags.is_not_null() | words.is_null() | (words == "")
    if not readable.all():
        first = int(readable.arg_min())
        raise DatasetImportError(
            f"{where}: column {column!r}: {values[first]!r} ({_row_name(frame, first)}) is not a terminal flag; "
            "use true/false, yes/no or 1/0 (any case), or leave the cell empty for false"
        )
    return flags.fill_null(False).to_numpy()


def _row_name(frame: pl.DataFrame, index: int) -> str:
    """Where a row of the sorted frame is in the file: "row N", counting the rows below the header from 1."""
    return f"row {int(frame[_ROW][index]) + 1}"


def _table_episodes(
    frame: pl.DataFrame, mapping: TableMapping, times_us: np.ndarray | None, terminal: np.ndarray | None,
    where: str,
) -> tuple[np.ndarray, list[str]]:
    """Episode start rows and ids: from the episode column, else by day or gap in time (or one episode
    without times) and after every terminal row, since a terminal row is where an episode truly ended."""
    if mapping.episode_id is not None:
        codes = frame[_EPISODE].to_numpy()
        starts = np.flatnonzero(np.append(True, codes[1:] != codes[:-1]))
        _require_terminal_last(frame, starts, terminal, codes, where)
        return starts, [str(codes[s]) for s in starts]
    if times_us is None:
        starts = _after_terminals(np.zeros(1, dtype=np.int64), terminal)
        return starts, [f"episode-{e}" for e in range(starts.size)]
    starts = episode_starts(times_us, median_step(times_us), mapping.episode_split, mapping.utc_offset_hours)
    starts = _after_terminals(starts, terminal)
    return starts, _distinct([episode_id_for(int(times_us[s])) for s in starts])


def _distinct(ids: list[str]) -> list[str]:
    """``ids`` with each repeat suffixed ``-1``, ``-2``, ..., skipping a suffixed name that is itself in
    ``ids`` (a log may name episodes ``b1`` and ``b1-1``) or was already given: every result is distinct."""
    taken, tried = set(ids), Counter[str]()
    distinct, first = [], set()
    for episode_id in ids:
        if episode_id not in first:
            first.add(episode_id)
            distinct.append(episode_id)
            continue
        name = episode_id
        while name in taken:
            tried[episode_id] += 1
            name = f"{episode_id}-{tried[episode_id]}"
        taken.add(name)
        distinct.append(name)
    return distinct


def _episode_rule(mapping: TableMapping) -> str:
    """How the log was cut into episodes, in words, for the dataset card."""
    cut = ("; a gap of more than 1.5 steps cuts one (the rest: <id>-1, <id>-2, ..., names not taken)"
           if mapping.timestamp else "")
    rule = (f"episodes from column {mapping.episode_id!r}{cut}" if mapping.episode_id
            else episode_rule(mapping.episode_split, mapping.utc_offset_hours) if mapping.timestamp
            else "one episode in file order")
    return f"{rule}; a terminal row ({mapping.terminal!r}) ends its episode" if mapping.terminal else rule


def _after_terminals(starts_E: np.ndarray, terminal_R: np.ndarray | None) -> np.ndarray:
    """``starts_E`` and the row after every terminal row (but the last row), sorted and unique."""
    if terminal_R is None:
        return starts_E
    after = np.flatnonzero(terminal_R[:-1]) + 1
    return np.union1d(starts_E, after).astype(np.int64)


def _require_terminal_last(
    frame: pl.DataFrame, starts_E: np.ndarray, terminal_R: np.ndarray | None, codes_R: np.ndarray, where: str
) -> None:
    """With an episode column, a terminal row must be the last of its episode (a truly ended episode has no
    more steps); refuse the first that is not, naming its row."""
    if terminal_R is None:
        return
    last_R = np.zeros(terminal_R.size, dtype=bool)
    last_R[np.append(starts_E[1:], terminal_R.size) - 1] = True
    inside = np.flatnonzero(terminal_R & ~last_R)
    if inside.size:
        row = int(inside[0])
        raise DatasetImportError(
            f"{where}: {_row_name(frame, row)} is terminal but not the last row of its episode {codes_R[row]!r}; "
            "give the rows after it another episode id, or clear its terminal flag"
        )
