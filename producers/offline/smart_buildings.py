"""Offline datasets on the producer side: importers, the building log generator, steps -> token
trajectories in the online prompt format, and evaluation of offline-trained adapters online.

Why here, next to the environments: a logged building step must become exactly the
prompt the online ``building-hvac`` environment shows for that state, so the
renderer is the environment itself (``BuildingHVAC.load_state_from_telemetry``),
and the answer is written in the format the environment parses.

Flow::

    npz + metadata (Smart Buildings layout) --import_smart_buildings--\\
    simulator days --generate_building_dataset (same layout) ---------> datasets/<name>/ (steps + card)
    CSV / Parquet + column mapping --import_table--------------------/
    datasets/<name>/ --dataset_to_trajectories--> runs/<run>/trajectories/... --`rlpipe replay --train`--> adapter
    adapter --evaluate_building--> runs/<run>/eval/*.json (vs the logged and the random policy)

The Smart Buildings layout (``google/sbsim`` dataset partitions): ``data.npy.npz`` holds
``observation_value_matrix``, ``action_value_matrix``, ``reward_value_matrix`` and
``reward_info_value_matrix`` (one row per 5-minute step); the metadata maps column ids
(``device@field``) to column indices and lists the timestamps.  Upstream the metadata
is a pickle: it is refused unless the caller passes ``trust_pickle`` (the CLI's
``--trust-pickle``), and then read by ``TrustedMetadataUnpickler``, which loads only
builtins containers, datetimes and plain numpy arrays and maps pandas timestamps to
``datetime`` without importing pandas.  The same content as JSON is always accepted.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import json
import logging
import math
import pickle
import random
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import polars as pl
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pipeline.datasets import (
    US_PER_SECOND,
    DatasetCard,
    DatasetField,
    DatasetWriter,
    EpisodeSplit,
    episode_starts,
    iter_partitions,
    read_card,
    steps_table_from_arrays,
)
from pipeline.store import ObjectStore
from producers.envs.building import (
    COOL,
    HEAT,
    OFF,
    PASSIVE,
    BuildingConfig,
    BuildingHVAC,
    parse_setpoint_values,
    thermostat_modes,
    to_kelvin,
    to_normalized,
    zone_names,
)
from producers.envs.parsing import format_answer, parse_answer
from schemas.trajectory import discounted_returns

log = logging.getLogger("rlpipe.datasets")

NPZ_NAME = "data.npy.npz"
METADATA_JSON = "metadata.json"
METADATA_PICKLE = "metadata.pickle"
MATRICES = ("observation_value_matrix", "action_value_matrix", "reward_value_matrix", "reward_info_value_matrix")
# The reward matrix's columns: smart_control's RewardResponse fields, in the dataset's order.
REWARD_VALUE_IDS = (
    "agent_reward_value", "productivity_reward", "electricity_energy_cost", "natural_gas_energy_cost",
    "carbon_emitted", "carbon_cost", "productivity_weight", "energy_cost_weight", "carbon_emission_weight",
    "person_productivity", "total_occupancy", "reward_scale", "reward_shift", "productivity_regret",
    "normalized_productivity_regret", "normalized_energy_cost", "normalized_carbon_emission",
)  # fmt: skip
# Feature names of the non-observation matrices carry a prefix, because the same device@field id
# may appear as an observation and as an action (a setpoint is both read and written).
ROLE_PREFIX = {"observation": "", "action": "action:", "reward": "reward:", "reward_info": "reward_info:"}
MATRIX_ROLE = dict(zip(MATRICES, ("observation", "action", "reward", "reward_info"), strict=True))
DEFAULT_STEP_SECONDS = 300.0


class DatasetImportError(ValueError):
    """Source files that cannot be imported as asked; the message names the fix."""


class PickleRefusedError(DatasetImportError):
    """A pickle metadata file without ``--trust-pickle``."""


# ==== Smart Buildings layout: metadata ===========================================================


class _Opaque:
    """Stands in for objects the importer never uses (protobuf device infos, time zones, pandas offsets)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


_NPY_UNIT_SECONDS = {7: 1.0, 8: 1e-3, 9: 1e-6, 10: 1e-9}  # numpy's datetime unit codes: s, ms, us, ns


def _pandas_timestamp(value: int, freq: Any = None, tz: Any = None, reso: int = 10) -> dt.datetime:
    """What ``pandas._libs.tslibs.timestamps._unpickle_timestamp`` would build, as a UTC datetime.

    The value counts ``reso`` units since the epoch in UTC whatever the time zone, so the
    zone (an opaque stand-in here) is not needed.
    """
    if reso not in _NPY_UNIT_SECONDS:
        raise pickle.UnpicklingError(f"pandas timestamp with resolution code {reso} is not supported")
    micros = int(value) * _NPY_UNIT_SECONDS[reso] * US_PER_SECOND
    return dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(microseconds=round(micros))


class TrustedMetadataUnpickler(pickle.Unpickler):
    """Loads a Smart Buildings ``metadata.pickle`` that the user has said is trusted, and nothing else.

    Allowed: builtins containers and scalars, ``collections.OrderedDict``, ``datetime``
    types, and plain numpy arrays, dtypes and scalars.  Mapped to stand-ins without
    importing their libraries: pandas ``Timestamp`` -> ``datetime`` (UTC); time zones
    (pytz, dateutil, zoneinfo), pandas offsets and ``smart_control`` protobufs (device and
    zone infos, which the importer does not use) -> an inert ``_Opaque``.  Every other
    global (``os.system``, ``builtins.eval``, any class) raises ``UnpicklingError``, so a
    crafted file cannot run code even behind ``--trust-pickle``.
    """

    _ALLOWED: frozenset[tuple[str, str]] = frozenset({
        *(("builtins", n) for n in ("dict", "list", "tuple", "set", "frozenset", "str", "bytes", "bytearray",
                                    "int", "float", "bool", "complex")),
        ("collections", "OrderedDict"), ("copyreg", "_reconstructor"),
        *(("datetime", n) for n in ("datetime", "date", "time", "timedelta", "timezone")),
        ("numpy", "ndarray"), ("numpy", "dtype"),
        *((m, n) for m in ("numpy.core.multiarray", "numpy._core.multiarray") for n in ("_reconstruct", "scalar")),
        *((m, "_frombuffer") for m in ("numpy.core.numeric", "numpy._core.numeric")),
    })  # fmt: skip
    _OPAQUE_MODULES = ("pytz", "dateutil.tz", "zoneinfo", "pandas._libs.tslibs.offsets", "smart_control.")

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "pandas._libs.tslibs.timestamps" and name in ("_unpickle_timestamp", "Timestamp"):
            return _pandas_timestamp
        if any(module == m.rstrip(".") or module.startswith(m if m.endswith(".") else m + ".")
               for m in self._OPAQUE_MODULES):
            return _Opaque
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def load_trusted_pickle(data: bytes) -> Any:
    """Unpickle ``data`` with ``TrustedMetadataUnpickler`` (only call after the user trusted the file)."""
    return TrustedMetadataUnpickler(io.BytesIO(data)).load()


@dataclass(frozen=True)
class SbdMetadata:
    """A partition's metadata: column ids of each matrix in column order, row timestamps, units, extras."""

    ids: dict[str, list[str]]  # matrix name -> ids in column order
    times_us_R: np.ndarray  # UTC epoch microseconds of each row (the observation timestamps)
    units: dict[str, str]  # source id -> unit (optional in the metadata)
    rlpipe: dict[str, Any]  # rlpipe's own extension block (simulator settings), {} for real data
    aligned: bool  # the action / reward timestamps equal the observation timestamps


def read_metadata(path: Path, trust_pickle: bool) -> SbdMetadata:
    """The metadata file at ``path`` (JSON, or a pickle when ``trust_pickle``); nothing is written."""
    data = path.read_bytes()
    if path.suffix.lower() in (".pickle", ".pkl"):
        if not trust_pickle:
            raise PickleRefusedError(
                f"{path.name} is a Python pickle, which can run code when loaded; pass --trust-pickle if you trust "
                f"its source, or convert it to {METADATA_JSON}"
            )
        try:
            raw = load_trusted_pickle(data)
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
            raise DatasetImportError(f"{path.name}: {exc}; convert the metadata to JSON instead") from None
    else:
        try:
            raw = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DatasetImportError(f"{path.name} is not JSON: {exc}") from None
    return metadata_from_mapping(raw, path.name)


def metadata_from_mapping(raw: Any, where: str = "metadata") -> SbdMetadata:
    """Validate the upstream keys.  Quirk kept from upstream: ``reward_ids`` maps the columns of the
    *reward info* matrix (``reward_info_ids`` is accepted too); the reward matrix's columns are
    ``REWARD_VALUE_IDS`` unless ``reward_value_ids`` says otherwise."""
    if not isinstance(raw, Mapping):
        raise DatasetImportError(f"{where} must hold a mapping of the Smart Buildings metadata keys")
    info_key = "reward_info_ids" if "reward_info_ids" in raw else "reward_ids"
    ids = {
        "observation_value_matrix": _ordered_ids(raw, "observation_ids", where),
        "action_value_matrix": _ordered_ids(raw, "action_ids", where),
        "reward_info_value_matrix": _ordered_ids(raw, info_key, where),
        "reward_value_matrix": [str(i) for i in raw.get("reward_value_ids", REWARD_VALUE_IDS)],
    }
    times = _timestamps_us(raw.get("observation_timestamps"), "observation_timestamps", where)
    aligned = all(
        key not in raw or np.array_equal(_timestamps_us(raw[key], key, where), times)
        for key in ("action_timestamps", "reward_timestamps", "reward_info_timestamps")
    )
    units = {str(k): str(v) for k, v in (raw.get("units") or {}).items()}
    extension = raw.get("rlpipe") or {}
    if not isinstance(extension, Mapping):
        raise DatasetImportError(f"{where}: 'rlpipe' must be a mapping")
    return SbdMetadata(ids=ids, times_us_R=times, units=units, rlpipe=dict(extension), aligned=aligned)


def _ordered_ids(raw: Mapping[str, Any], key: str, where: str) -> list[str]:
    """``{id: column}`` -> ids in column order; the columns must be exactly 0..n-1."""
    mapping = raw.get(key)
    if not isinstance(mapping, Mapping):
        raise DatasetImportError(f"{where} lacks {key!r} (a mapping of device@field id -> column index)")
    by_column = sorted((int(col), str(name)) for name, col in mapping.items())
    if [col for col, _ in by_column] != list(range(len(by_column))):
        raise DatasetImportError(f"{where}: the columns of {key!r} must be exactly 0..{len(by_column) - 1}")
    return [name for _, name in by_column]


def _timestamps_us(values: Any, key: str, where: str) -> np.ndarray:
    """Timestamps (datetimes, ISO 8601 strings or epoch seconds) -> UTC epoch microseconds."""
    if values is None:
        raise DatasetImportError(f"{where} lacks {key!r} (one timestamp per row)")
    out = np.empty(len(values), dtype=np.int64)
    for i, value in enumerate(values):
        out[i] = _to_epoch_us(value, f"{where}: {key}[{i}]")
    return out


def _to_epoch_us(value: Any, where: str) -> int:
    if isinstance(value, np.datetime64):
        return int(value.astype("datetime64[us]").astype(np.int64))
    if isinstance(value, str):
        try:
            value = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise DatasetImportError(f"{where} is not an ISO 8601 time: {value!r}") from None
    if isinstance(value, dt.datetime):
        moment = value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value
        return (moment - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)) // dt.timedelta(microseconds=1)
    if isinstance(value, int | float | np.integer | np.floating) and math.isfinite(float(value)):
        return round(float(value) * US_PER_SECOND)
    raise DatasetImportError(f"{where} is not a timestamp (datetime, ISO 8601 text or epoch seconds): {value!r}")


# ==== Smart Buildings layout: partitions ==========================================================


@dataclass
class SbdPartition:
    """One partition folder, loaded and checked: the four matrices and their metadata."""

    folder: Path
    matrices: dict[str, np.ndarray]
    metadata: SbdMetadata
    source_files: dict[str, str]  # relative file name -> sha256

    @property
    def rows(self) -> int:
        return int(self.metadata.times_us_R.size)


def partition_folders(path: Path) -> list[Path]:
    """``path`` itself if it holds ``data.npy.npz``, else its sub-folders that do (sorted)."""
    if not path.exists():
        raise FileNotFoundError(f"no such file or folder: {path}")
    if (path / NPZ_NAME).is_file():
        return [path]
    folders = sorted(p for p in path.iterdir() if (p / NPZ_NAME).is_file()) if path.is_dir() else []
    if not folders:
        raise DatasetImportError(f"{path} holds no {NPZ_NAME} (nor do its sub-folders); point at a partition folder")
    return folders


def metadata_path(folder: Path) -> Path:
    """The partition's metadata file: ``metadata.json`` preferred over ``metadata.pickle``."""
    for name in (METADATA_JSON, METADATA_PICKLE):
        if (folder / name).is_file():
            return folder / name
    raise DatasetImportError(f"{folder} has no {METADATA_JSON} or {METADATA_PICKLE}")


def load_partition(folder: Path, trust_pickle: bool, root: Path | None = None) -> SbdPartition:
    """Read and check one partition (npz without pickles, metadata as JSON or trusted pickle)."""
    meta_file = metadata_path(folder)
    metadata = read_metadata(meta_file, trust_pickle)
    npz_file = folder / NPZ_NAME
    try:
        with np.load(npz_file, allow_pickle=False) as npz:
            missing = [m for m in MATRICES if m not in npz.files]
            if missing:
                raise DatasetImportError(f"{npz_file} lacks {', '.join(missing)}")
            matrices = {m: np.asarray(npz[m]) for m in MATRICES}
    except ValueError as exc:  # an object array (which would need pickle) or a corrupt file
        raise DatasetImportError(f"{npz_file} cannot be read without pickle: {str(exc).splitlines()[0]}") from None
    _check_shapes(matrices, metadata, npz_file)
    base = root or folder
    source_files = {
        str(p.relative_to(base)) if p.is_relative_to(base) else p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in (npz_file, meta_file)
    }
    return SbdPartition(folder, matrices, metadata, source_files)


def _check_shapes(matrices: dict[str, np.ndarray], metadata: SbdMetadata, where: Path) -> None:
    rows = metadata.times_us_R.size
    for name in MATRICES:
        matrix = matrices[name]
        if matrix.ndim != 2 or not np.issubdtype(matrix.dtype, np.number):
            raise DatasetImportError(f"{where}: {name} must be a 2-D numeric matrix, got {matrix.dtype} {matrix.shape}")
        expected = (rows, len(metadata.ids[name]))
        if matrix.shape != expected:
            raise DatasetImportError(
                f"{where}: {name} has shape {matrix.shape} but the metadata names {expected[0]} timestamps "
                f"and {expected[1]} columns"
            )


# ==== Smart Buildings layout: import ==============================================================


def sbd_fields(metadata: SbdMetadata) -> list[DatasetField]:
    """One steps-table feature per column of the four matrices, in matrix then column order."""
    fields = []
    for matrix in MATRICES:
        role = MATRIX_ROLE[matrix]
        for source_id in metadata.ids[matrix]:
            fields.append(DatasetField(name=ROLE_PREFIX[role] + source_id, role=role, source_id=source_id,
                                       unit=metadata.units.get(source_id)))
    return fields


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


def _median_step(times_us_R: np.ndarray) -> float:
    gaps = np.diff(times_us_R)
    return float(np.median(gaps)) / US_PER_SECOND if gaps.size else DEFAULT_STEP_SECONDS


def import_smart_buildings(
    store: ObjectStore,
    path: str | Path,
    name: str,
    *,
    trust_pickle: bool = False,
    utc_offset_hours: float | None = None,
    split: EpisodeSplit = "day",
    reward_id: str = "agent_reward_value",
    source: str = "smart-buildings",
    description: str = "",
) -> DatasetCard:
    """Import Smart Buildings partitions at ``path`` as dataset ``name``; return its card.

    Every metadata file is read and checked before anything is written, so a refused
    pickle (no ``trust_pickle``) or a malformed file leaves the store untouched.
    Episodes are local days (``split="day"``, UTC + ``utc_offset_hours``, default the
    metadata's own or 0) or stretches without gaps (``"gap"``); every gap ends one.
    """
    path = Path(path)
    folders = partition_folders(path)
    metadatas = [read_metadata(metadata_path(folder), trust_pickle) for folder in folders]
    for folder, metadata in zip(folders[1:], metadatas[1:], strict=True):
        if metadata.ids != metadatas[0].ids:
            raise DatasetImportError(f"{folder} has other columns than {folders[0]}; import them as separate datasets")
    if reward_id not in metadatas[0].ids["reward_value_matrix"]:
        raise DatasetImportError(f"the reward matrix has no column {reward_id!r}; pass one of its reward_value_ids")
    extension = metadatas[0].rlpipe
    offset = float(utc_offset_hours if utc_offset_hours is not None else extension.get("utc_offset_hours", 0.0))
    fields = sbd_fields(metadatas[0])
    writer = DatasetWriter(store, name).open()
    source_files: dict[str, str] = {}
    step_seconds = float(extension.get("step_seconds") or 0.0)
    aligned = True
    for folder in folders:
        partition = load_partition(folder, trust_pickle, root=path)
        source_files |= partition.source_files
        aligned &= partition.metadata.aligned
        step_seconds = step_seconds or _median_step(partition.metadata.times_us_R)
        for day, table in _partition_days(partition, fields, reward_id, step_seconds, split, offset):
            writer.write_partition(day, table)
    return writer.commit(
        source=source, description=description, source_files=source_files, fields=fields,
        observation_columns=[f.name for f in fields if f.role == "observation"],
        action_columns=[f.name for f in fields if f.role == "action"],
        reward_column=ROLE_PREFIX["reward"] + reward_id,
        episode_rule=_episode_rule(split, offset), step_seconds=step_seconds,
        extras={**extension, "layout": "smart-buildings", "utc_offset_hours": offset, "timestamps_aligned": aligned,
                "partitions": [str(f.relative_to(path)) if f != path else "." for f in folders]},
    )


def _episode_rule(split: EpisodeSplit, offset: float) -> str:
    gap = "a gap of more than 1.5 steps ends an episode"
    return f"one episode per local day (UTC{offset:+g} h); {gap}" if split == "day" else f"{gap}; no other splits"


def _partition_days(
    partition: SbdPartition, fields: list[DatasetField], reward_id: str, step_seconds: float,
    split: EpisodeSplit, offset: float,
) -> Iterator[tuple[dt.date, pa.Table]]:
    """One partition's matrices -> per-day steps tables (every column a float64 feature)."""
    times = partition.metadata.times_us_R
    features: dict[str, np.ndarray] = {}
    index = 0
    for matrix in MATRICES:
        values = partition.matrices[matrix]
        for column in range(values.shape[1]):
            features[fields[index].name] = values[:, column].astype(np.float64)
            index += 1
    starts = episode_starts(times, step_seconds, split, offset)
    columns = ([f.name for f in fields if f.role == "observation"], [f.name for f in fields if f.role == "action"],
               ROLE_PREFIX["reward"] + reward_id)
    ids = [episode_id_for(int(times[s])) for s in starts]
    yield from day_tables(times, episode_days(times, starts, offset), starts, ids, features, columns)


# ==== CSV / Parquet with a column mapping ==========================================================


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
    try:
        raw = yaml.safe_load(file.read_text())
        return TableMapping.model_validate(raw)
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
    appearance without times) and sorted by time within each.  Numeric columns the
    mapping does not claim become features; other columns are left out (logged).
    """
    file = Path(path)
    frame = _ordered_frame(_read_frame(file), mapping, file.name)
    times_us = frame[_TIME].to_numpy() if mapping.timestamp else None
    features, fields = _table_features(frame, mapping, file.name)
    starts, episode_ids = _table_episodes(frame, mapping, times_us)
    days = (episode_days(times_us, starts, mapping.utc_offset_hours) if times_us is not None
            else [dt.date(1970, 1, 1)] * len(starts))  # no times: one partition
    renamed = {f.source_id: f.name for f in fields}
    columns = ([renamed[c] for c in mapping.observation], [renamed[c] for c in mapping.action],
               renamed[mapping.reward])
    terminal = frame[mapping.terminal].cast(pl.Boolean).fill_null(False).to_numpy() if mapping.terminal else None
    writer = DatasetWriter(store, name).open()
    for day, table in day_tables(times_us, days, starts, episode_ids, features, columns, terminal):
        writer.write_partition(day, table)
    return writer.commit(
        source=source, description=mapping.description,
        source_files={file.name: hashlib.sha256(file.read_bytes()).hexdigest()}, fields=fields,
        observation_columns=columns[0], action_columns=columns[1], reward_column=columns[2],
        episode_rule=f"episodes from column {mapping.episode_id!r}" if mapping.episode_id
        else _episode_rule(mapping.episode_split, mapping.utc_offset_hours),
        step_seconds=_median_step(times_us) if times_us is not None and times_us.size > 1 else None,
        extras={"layout": "table", "mapping": mapping.model_dump(mode="json")},
    )


_ROW, _TIME, _FIRST = "__rlpipe_row", "__rlpipe_time_us", "__rlpipe_episode_first"


def _read_frame(file: Path) -> pl.DataFrame:
    if not file.is_file():
        raise FileNotFoundError(f"no such file: {file}")
    suffix = file.suffix.lower()
    if suffix == ".csv":
        return pl.read_csv(file, try_parse_dates=True, infer_schema_length=10_000)
    if suffix in (".parquet", ".pq"):
        return pl.read_parquet(file)
    raise DatasetImportError(f"{file.name}: only .csv and .parquet files can be imported")


def _ordered_frame(frame: pl.DataFrame, mapping: TableMapping, where: str) -> pl.DataFrame:
    """Check the mapped columns exist; add the time (UTC us) and sort rows by episode, then time."""
    named = [c for c in (mapping.episode_id, mapping.timestamp, mapping.reward, mapping.terminal,
                         *mapping.observation, *mapping.action) if c is not None]
    missing = [c for c in named if c not in frame.columns]
    if missing:
        raise DatasetImportError(f"{where} has no columns {missing}; fix the mapping (it has {frame.columns[:8]})")
    frame = frame.with_row_index(_ROW)
    if mapping.timestamp:
        frame = frame.with_columns(pl.Series(_TIME, _times_us(frame[mapping.timestamp], mapping)))
    within = _TIME if mapping.timestamp else _ROW
    if mapping.episode_id is None:
        return frame.sort(within)
    frame = frame.with_columns(pl.col(within).min().over(mapping.episode_id).alias(_FIRST))
    return frame.sort([_FIRST, mapping.episode_id, within])


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


def _table_features(
    frame: pl.DataFrame, mapping: TableMapping, where: str
) -> tuple[dict[str, np.ndarray], list[DatasetField]]:
    """Numeric (and boolean) columns -> float64 features with roles, in file order."""
    from schemas.steps import STEPS_BASE_FIELDS

    base = {f.name for f in STEPS_BASE_FIELDS}
    skip = {mapping.episode_id, mapping.timestamp, mapping.terminal, _ROW, _TIME, _FIRST, *mapping.exclude}
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
        fields.append(DatasetField(name=name, role=roles.get(column, "feature"), source_id=column,
                                   unit=mapping.units.get(column)))
    return features, fields


def _table_episodes(
    frame: pl.DataFrame, mapping: TableMapping, times_us: np.ndarray | None
) -> tuple[np.ndarray, list[str]]:
    """Episode start rows and ids: from the episode column, by day or gap in time, or one episode."""
    if mapping.episode_id is not None:
        codes = frame[mapping.episode_id].cast(pl.Utf8).to_numpy()
        starts = np.flatnonzero(np.append(True, codes[1:] != codes[:-1]))
        return starts, [str(codes[s]) for s in starts]
    if times_us is None:
        return np.zeros(1, dtype=np.int64), ["episode-0"]
    starts = episode_starts(times_us, _median_step(times_us), mapping.episode_split, mapping.utc_offset_hours)
    return starts, [episode_id_for(int(times_us[s])) for s in starts]


# ==== the building simulator's logs, in the Smart Buildings layout ================================

GenerationPolicy = Literal["heuristic", "random", "mixed"]
# The simulator's actions as the dataset names them: device setpoints, as in the real dataset.
SIM_ACTIONS = {
    "boiler_0@supply_water_setpoint": "action@supply_water_setpoint",
    "ahu_0@supply_air_heating_temperature_setpoint": "action@supply_air_heating_temperature_setpoint",
}
# RewardResponse fields the simulator's telemetry provides (the rest are constants of the configuration).
SIM_REWARDS = {
    "agent_reward_value": "reward@reward", "productivity_reward": "reward@productivity",
    "electricity_energy_cost": "reward@electricity_cost", "natural_gas_energy_cost": "reward@natural_gas_cost",
    "carbon_emitted": "reward@carbon_emitted", "total_occupancy": "reward@total_occupancy",
    "normalized_productivity_regret": "reward@comfort", "normalized_energy_cost": "reward@energy_cost",
    "normalized_carbon_emission": "reward@carbon",
}  # fmt: skip
REWARD_UNITS = {
    "agent_reward_value": "1", "productivity_reward": "USD", "electricity_energy_cost": "USD",
    "natural_gas_energy_cost": "USD", "carbon_emitted": "kg", "carbon_cost": "USD", "productivity_weight": "1",
    "energy_cost_weight": "1", "carbon_emission_weight": "1", "person_productivity": "USD/(person h)",
    "total_occupancy": "people", "reward_scale": "1", "reward_shift": "1", "productivity_regret": "USD",
    "normalized_productivity_regret": "1", "normalized_energy_cost": "1", "normalized_carbon_emission": "1",
}  # fmt: skip
# RewardInfo entries per zone and per device (smart_control's names) -> the telemetry they come from.
SIM_ZONE_INFO = {"heating_setpoint_temperature": ("zone_air_heating_temperature_setpoint", "K"),
                 "cooling_setpoint_temperature": ("zone_air_cooling_temperature_setpoint", "K"),
                 "zone_air_temperature": ("zone_air_temperature_sensor", "K"),
                 "average_occupancy": ("zone_occupancy", "people")}
SIM_DEVICE_INFO = {"ahu_0@air_conditioning_electrical_energy_rate": (("ahu_0@air_conditioning_electrical_power",), "W"),
                   "ahu_0@blower_electrical_energy_rate": (("ahu_0@supply_fan_electrical_power",
                                                           "ahu_0@exhaust_fan_electrical_power"), "W"),
                   "boiler_0@natural_gas_heating_energy_rate": (("boiler_0@natural_gas_flow_rate",), "W"),
                   "boiler_0@pump_electrical_energy_rate": (("boiler_0@pump_electrical_power",), "W")}


class GenerationSpec(BaseModel):
    """Which simulated days to log and under which controller."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    days: int = Field(ge=1, le=3650, description="days to simulate (one episode each)")
    policy: GenerationPolicy = Field("mixed", description="heuristic, random, or a mix chosen per day")
    random_fraction: float = Field(0.5, ge=0.0, le=1.0, description="share of random days when policy is mixed")
    seed: int = Field(0, ge=0, description="seeds the controllers' choices (random actions, which days are random)")
    first_day: int = Field(0, ge=0, le=100_000, description="index of the first day: its date and simulator seed")
    env_overrides: dict[str, Any] = Field(default_factory=dict, description="building-hvac settings to change")

    @field_validator("env_overrides")
    @classmethod
    def _whole_days(cls, value: dict[str, Any]) -> dict[str, Any]:
        config = BuildingHVAC.Config.model_validate(value)
        if config.episode_days != 1.0 or config.start_hour != 0.0:
            raise ValueError("the generator logs whole local days: leave episode_days at 1 and start_hour at 0")
        return value


def day_env(day: int, overrides: Mapping[str, Any] | None = None) -> BuildingHVAC:
    """The simulator of day index ``day``: the configured start date plus ``day`` days (reset it with seed ``day``).

    One index names one simulated day (its date, weather offset, start temperatures and
    occupants) everywhere: the generator, the behaviour policy and the evaluation.
    """
    settings = dict(overrides or {})
    base = BuildingHVAC.Config.model_validate(settings)
    settings["start_date"] = base.start_date + dt.timedelta(days=day)
    return BuildingHVAC(**settings)


def day_policy(spec: GenerationSpec, day: int) -> str:
    """The controller of ``day`` under ``spec`` (a mixed log draws it per day, reproducibly)."""
    if spec.policy != "mixed":
        return spec.policy
    return "random" if random.Random(f"rlpipe-mixed:{spec.seed}:{day}").random() < spec.random_fraction else "heuristic"


def policy_answer(env: BuildingHVAC, policy: str, rng: random.Random) -> str:
    """One scripted answer: the environment's heuristic or its uniformly random answer."""
    return env.heuristic_answer() if policy == "heuristic" else env.random_answer(rng)


@dataclass
class DayLog:
    """One simulated day: telemetry before the first step and after each, and what the controller saw."""

    day: int
    policy: str
    telemetry: list[dict[str, float]]
    answers: list[str] = field(default_factory=list)  # the controller's answer at each step
    observations: list[str] = field(default_factory=list)  # the prompt text before each step (keep_text)


def simulate_day(
    day: int, policy: str, seed: int = 0, overrides: Mapping[str, Any] | None = None, keep_text: bool = False
) -> DayLog:
    """Run day ``day`` under a scripted ``policy`` and log its telemetry (288 steps by default)."""
    env = day_env(day, overrides)
    env.reset(day)
    rng = random.Random(f"rlpipe-generate:{seed}:{day}")
    log_ = DayLog(day, policy, [env.telemetry()])
    while not env.done:
        if keep_text:
            log_.observations.append(env.observation())
        log_.answers.append(policy_answer(env, policy, rng))
        env.step(log_.answers[-1])
        log_.telemetry.append(env.telemetry())
    return log_


def sbd_layout(logs: Sequence[DayLog], config: BuildingConfig) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Day logs -> the four matrices and their metadata (JSON-ready), one row per step.

    Row k of a day: the observation at the step's start (telemetry row k), the action
    taken then and the reward and reward info of the step (from telemetry row k + 1).
    """
    fields = BuildingHVAC.telemetry_fields(config)
    observation_ids = [n for n, _ in fields if not n.startswith(("reward@", "time@"))]
    zones = zone_names(config.grid_rows, config.grid_cols)
    info_ids = [f"{z}@{name}" for z in zones for name in SIM_ZONE_INFO] + list(SIM_DEVICE_INFO)
    rows_now = [row for day in logs for row in day.telemetry[:-1]]
    rows_next = [row for day in logs for row in day.telemetry[1:]]
    matrices = {
        "observation_value_matrix": _matrix(rows_now, observation_ids),
        "action_value_matrix": _matrix(rows_next, list(SIM_ACTIONS.values())),
        "reward_value_matrix": np.stack([_reward_column(rows_next, rid, config) for rid in REWARD_VALUE_IDS], axis=1),
        "reward_info_value_matrix": np.stack([_info_column(rows_next, iid) for iid in info_ids], axis=1),
    }
    times = [dt.datetime.fromtimestamp(row["time@timestamp"], tz=dt.UTC).isoformat() for row in rows_now]
    units = dict(fields) | {a: "K" for a in SIM_ACTIONS} | REWARD_UNITS
    units |= {f"{z}@{name}": unit for z in zones for name, (_, unit) in SIM_ZONE_INFO.items()}
    units |= {iid: unit for iid, (_, unit) in SIM_DEVICE_INFO.items()}
    metadata = {
        "observation_ids": {name: i for i, name in enumerate(observation_ids)},
        "action_ids": {name: i for i, name in enumerate(SIM_ACTIONS)},
        "reward_ids": {name: i for i, name in enumerate(info_ids)},  # upstream's name for the reward *info* columns
        "observation_timestamps": times, "action_timestamps": times,
        "reward_timestamps": times, "reward_info_timestamps": times,
        "device_infos": [], "zone_infos": [],
        "units": {k: v for k, v in units.items() if not k.startswith(("reward@", "time@"))},
    }  # fmt: skip
    return matrices, metadata


def _matrix(rows: Sequence[Mapping[str, float]], names: Sequence[str]) -> np.ndarray:
    return np.array([[row[n] for n in names] for row in rows], dtype=np.float64).reshape(len(rows), len(names))


def _reward_column(rows: Sequence[Mapping[str, float]], reward_id: str, cfg: BuildingConfig) -> np.ndarray:
    """One RewardResponse field per step: from the telemetry, or a constant of the configuration."""
    if reward_id in SIM_REWARDS:
        return np.array([row[SIM_REWARDS[reward_id]] for row in rows], dtype=np.float64)
    step_hours = cfg.step_seconds / 3600.0
    constants = {
        "carbon_cost": 0.0, "productivity_weight": cfg.productivity_weight,
        "energy_cost_weight": cfg.energy_cost_weight, "carbon_emission_weight": cfg.carbon_weight,
        "person_productivity": cfg.max_productivity_usd, "reward_scale": 1.0, "reward_shift": 0.0,
    }  # fmt: skip
    if reward_id in constants:
        return np.full(len(rows), constants[reward_id], dtype=np.float64)
    if reward_id == "productivity_regret":  # what full productivity would have earned, minus what was earned
        return np.array([cfg.max_productivity_usd * row["reward@total_occupancy"] * step_hours
                         - row["reward@productivity"] for row in rows], dtype=np.float64)
    raise DatasetImportError(f"the simulator cannot provide reward field {reward_id!r}")


def _info_column(rows: Sequence[Mapping[str, float]], info_id: str) -> np.ndarray:
    device, _, name = info_id.partition("@")
    if name in SIM_ZONE_INFO:
        sources: tuple[str, ...] = (f"{device}@{SIM_ZONE_INFO[name][0]}",)
    else:
        sources = SIM_DEVICE_INFO[info_id][0]
    return np.array([sum(row[s] for s in sources) for row in rows], dtype=np.float64)


def write_sbd_partition(folder: Path, matrices: Mapping[str, np.ndarray], metadata: Mapping[str, Any]) -> Path:
    """Write ``data.npy.npz`` (no pickles) and ``metadata.json`` into ``folder``; return the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(folder / NPZ_NAME, **{name: np.asarray(matrices[name]) for name in MATRICES})
    (folder / METADATA_JSON).write_text(json.dumps(metadata, indent=1, default=str))
    return folder


def generate_building_dataset(
    store: ObjectStore,
    name: str,
    spec: GenerationSpec,
    raw_dir: str | Path | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> DatasetCard:
    """Simulate ``spec.days`` days, write them in the Smart Buildings layout (into ``raw_dir``, or a
    temporary folder), then import that layout with the same importer as real data."""
    logs = []
    for index, day in enumerate(range(spec.first_day, spec.first_day + spec.days)):
        logs.append(simulate_day(day, day_policy(spec, day), spec.seed, spec.env_overrides))
        if progress is not None:
            progress(index + 1, spec.days)
    env = day_env(spec.first_day, spec.env_overrides)
    matrices, metadata = sbd_layout(logs, env.config)
    overrides = BuildingHVAC.Config.model_validate(spec.env_overrides).model_dump(mode="json")
    metadata["rlpipe"] = {
        "generator": "rlpipe building-hvac simulator", "env": BuildingHVAC.name,
        "env_overrides": {k: overrides[k] for k in spec.env_overrides},
        "utc_offset_hours": env.config.utc_offset_hours, "step_seconds": float(env.config.step_seconds),
        "generation": spec.model_dump(mode="json"),
        "episodes": _episode_list(logs, metadata["observation_timestamps"]),
    }  # fmt: skip
    description = (f"{spec.days} simulated days of building-hvac under the {spec.policy} controller "
                   f"(days {spec.first_day}..{spec.first_day + spec.days - 1}, seed {spec.seed})")
    with tempfile.TemporaryDirectory(prefix="rlpipe-sbd-") as scratch:
        folder = write_sbd_partition(Path(raw_dir) if raw_dir else Path(scratch), matrices, metadata)
        return import_smart_buildings(store, folder, name, source="building-hvac-simulator", description=description)


def _episode_list(logs: Sequence[DayLog], times: Sequence[str]) -> list[dict[str, Any]]:
    """Which day index and controller each logged episode had, keyed by its first timestamp."""
    out, row = [], 0
    for day_log in logs:
        out.append({"day": day_log.day, "policy": day_log.policy, "start": times[row]})
        row += len(day_log.telemetry) - 1
    return out


# ==== logged building steps -> the online prompt, and token trajectories ==========================

# The previous step's reward line of the prompt comes from these dataset columns.
TELEMETRY_REWARD_COLUMNS = {telemetry: ROLE_PREFIX["reward"] + rid for rid, telemetry in SIM_REWARDS.items()}
WATER_ACTION, AIR_ACTION = (ROLE_PREFIX["action"] + name for name in SIM_ACTIONS)


def building_env_for(card: DatasetCard, overrides: Mapping[str, Any] | None = None) -> BuildingHVAC:
    """The building environment a dataset was logged with (its recorded settings, then ``overrides``)."""
    return BuildingHVAC(**(dict(card.extras.get("env_overrides") or {}) | dict(overrides or {})))


def required_building_columns(env: BuildingHVAC) -> list[str]:
    """Dataset columns the prompt of a logged state needs (the telemetry names, the actions, the rewards)."""
    names = [n for n, _ in BuildingHVAC.telemetry_fields(env.config) if not n.startswith(("reward@", "time@"))]
    return [*names, WATER_ACTION, AIR_ACTION, *TELEMETRY_REWARD_COLUMNS.values()]


def check_building_dataset(card: DatasetCard, env: BuildingHVAC) -> None:
    """Refuse, in one line, a dataset whose columns cannot be shown as building-hvac prompts."""
    present = {f.name for f in card.fields}
    missing = [c for c in required_building_columns(env) if c not in present]
    if missing:
        raise DatasetImportError(
            f"dataset {card.name} lacks {len(missing)} columns the building-hvac prompt needs (e.g. {missing[0]!r}); "
            "use a dataset from `rlpipe datasets generate building-hvac` or name its columns like the simulator's"
        )


@dataclass(frozen=True)
class RenderedStep:
    """One logged step as the model would have seen and answered it online."""

    observation: str
    answer: str
    reward: float
    timestamp: float  # UTC epoch seconds


def is_comfort_time(config: BuildingConfig, local: dt.datetime) -> bool:
    """Comfort hours (the thermostat's comfort band applies), as the environment decides them."""
    return local.weekday() < 5 and config.comfort_start_hour <= local.hour < config.comfort_end_hour


def _next_modes(
    env: BuildingHVAC, temp_Z: np.ndarray, modes_Z: np.ndarray, timestamp: float, comfort_before: bool | None
) -> tuple[np.ndarray, bool]:
    """The thermostat modes a step starting at ``timestamp`` uses (as ``BuildingHVAC`` sets them)."""
    comfort = is_comfort_time(env.config, env.local_time(timestamp))
    band = env.config.comfort_band_k if comfort else env.config.eco_band_k
    return thermostat_modes(temp_Z, modes_Z, band, comfort, comfort_before), comfort


def _evidence_modes(row: Mapping[str, float], zones: Sequence[str], replayed: np.ndarray | None) -> np.ndarray:
    """Modes the boxes show (valve open: heating; damper open: cooling); an idle box keeps a replayed
    night drift, which the boxes cannot show."""
    valve = np.array([row[f"{z}@reheat_valve_percentage_command"] for z in zones]) >= 50.0
    damper = np.array([row[f"{z}@supply_air_damper_percentage_command"] for z in zones]) >= 50.0
    idle = np.full(len(zones), OFF) if replayed is None else np.where(replayed == PASSIVE, PASSIVE, OFF)
    return np.where(valve, HEAT, np.where(damper, COOL, idle))


AnswerFormat = Literal["kelvin", "normalized"]
DEFAULT_ANSWER_DECIMALS: dict[str, int] = {"kelvin": 0, "normalized": 1}


def setpoint_answer(
    config: BuildingConfig, water_k: float, air_k: float, answer_format: AnswerFormat = "kelvin",
    decimals: int | None = None,
) -> str:
    """The answer text that sets ``water_k`` and ``air_k`` in the environment's own format.

    ``kelvin``: ``<answer>330K, 292K</answer>``.  ``normalized``: each setpoint as the value in
    [-1, 1] the environment's parser maps onto its range (``to_kelvin`` inverted: -1 = lowest),
    e.g. ``<answer>0.3, -0.9</answer>``.  Rounded to ``decimals`` (default 0 for kelvin, 1 for
    normalized), so the environment applies the setpoint within half a rounding step: 0.5 K,
    or ``0.025 x`` the range with one decimal (1.1 K of the water's 45 K, 0.4 K of the air's 15 K).
    Why normalized: every value has the same short shape (``[-]d.d``) with one digit (and the
    sign) that matters, where a kelvin value needs three digits right and a dropped digit
    (``33K``) is a different setpoint; a small model writes the short shape more reliably.
    """
    places = DEFAULT_ANSWER_DECIMALS[answer_format] if decimals is None else decimals
    if answer_format == "kelvin":
        return format_answer([f"{water_k:.{places}f}K, {air_k:.{places}f}K"])
    units = [min(max(to_normalized(kelvin, bounds), -1.0), 1.0) for kelvin, bounds in
             ((water_k, config.supply_water_range_k), (air_k, config.supply_air_heating_range_k))]
    # + 0.0 turns a rounded -0.0 into 0.0 (one spelling per value)
    return format_answer([", ".join(f"{round(u, places) + 0.0:.{places}f}" for u in units)])


def render_building_episode(
    env: BuildingHVAC, episode: pa.Table, answer_decimals: int | None = None, answer_format: AnswerFormat = "kelvin",
) -> list[RenderedStep]:
    """Each logged step of one episode as the online prompt text and the logged action as the answer.

    The thermostat modes are not logged; they are replayed with the environment's own
    rule along the episode (from the reset state when it starts at the episode's first
    step), and the boxes' damper and valve settings overrule the replay where they show
    heating or cooling.  The answer is the logged setpoints (``setpoint_answer``): in kelvin,
    whole by default (``<answer>330K, 292K</answer>``: short answers are easier to learn, and
    half a kelvin is below what the plant resolves), or normalised to [-1, 1] with one decimal.
    """
    cols = episode.to_pydict()
    obs_names = [n for n, _ in BuildingHVAC.telemetry_fields(env.config) if not n.startswith(("reward@", "time@"))]
    zones = env.zone_names
    steps: list[RenderedStep] = []
    modes: np.ndarray | None = None
    comfort_before: bool | None = None
    for i in range(episode.num_rows):
        row = {name: float(cols[name][i]) for name in obs_names}
        timestamp = cols["timestamp"][i].timestamp()
        row["time@timestamp"] = timestamp
        for telemetry, column in TELEMETRY_REWARD_COLUMNS.items():
            row[telemetry] = float(cols[column][i - 1]) if i > 0 else 0.0
        if i == 0:
            step_index = env.steps_since_start_hour(timestamp)
            modes = np.full(len(zones), OFF) if step_index == 0 else _evidence_modes(row, zones, None)
        else:
            previous = np.array([cols[f"{z}@zone_air_temperature_sensor"][i - 1] for z in zones], dtype=np.float64)
            replayed, comfort_before = _next_modes(env, previous, modes, timestamp - env.config.step_seconds,
                                                   comfort_before)
            modes = _evidence_modes(row, zones, replayed)
        observation = env.load_state_from_telemetry(row, modes=modes)
        water, air = cols[WATER_ACTION][i], cols[AIR_ACTION][i]
        answer = setpoint_answer(env.config, water, air, answer_format, answer_decimals)
        steps.append(RenderedStep(observation, answer, float(cols["reward"][i]), timestamp))
    return steps


class TrajectoryOptions(BaseModel):
    """How logged episodes become trajectory batches (one batch = one learner step when it holds
    at least ``learner.batch_rows`` rows)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    episodes_per_batch: int = Field(8, ge=1, le=100_000, description="episodes (days) whose turns share a batch")
    turns_per_batch: int = Field(24, ge=1, le=100_000, description="turns of each episode per batch, spread over it")
    epochs: int = Field(1, ge=1, le=1_000, description="passes over the data (each a new batch order)")
    discount: float = Field(1.0, ge=0.0, le=1.0, description="gamma of the return-to-go")
    history_turns: int | None = Field(None, ge=0, le=64, description="earlier turns in each prompt; None: the env's")
    max_episodes: int | None = Field(None, ge=1, description="use only the first N episodes (smoke tests)")
    seed: int = Field(0, ge=0, description="seeds the batch order")
    answer_format: AnswerFormat = Field("kelvin", description="answers in kelvin (330K) or normalised to [-1, 1]")
    answer_decimals: int | None = Field(None, ge=0, le=6,
                                        description="decimals of each answer value; None: 0 (kelvin), 1 (normalized)")
    with_text: bool = Field(False, description="also store each row's decoded text (larger files)")


@dataclass
class RenderedEpisode:
    """One logged episode, rendered: its steps and their discounted returns-to-go."""

    episode_id: str
    env_seed: int
    steps: list[RenderedStep]
    returns_to_go: np.ndarray
    terminated: bool


@dataclass(frozen=True)
class ConversionReport:
    """What ``dataset_to_trajectories`` wrote."""

    run_id: str
    dataset: str
    episodes: int
    batches: int
    rows: int
    tokens: int
    generated_tokens: int
    summary_key: str


def turn_messages(system: str, steps: Sequence[RenderedStep], turn: int, history_turns: int) -> list[dict[str, str]]:
    """The conversation the producer builds for ``turn`` (``producers.episode.Episode.next_prompt``):
    the system prompt, up to ``history_turns`` earlier (observation, answer) pairs, the observation."""
    messages = [{"role": "system", "content": system}]
    for past in steps[max(0, turn - history_turns):turn] if history_turns else []:
        messages += [{"role": "user", "content": past.observation}, {"role": "assistant", "content": past.answer}]
    messages.append({"role": "user", "content": steps[turn].observation})
    return messages


def plan_batches(
    turns_E: Sequence[int], episodes_per_batch: int, turns_per_batch: int, epochs: int, seed: int
) -> list[list[tuple[int, int]]]:
    """(episode, turn) pairs per batch: shuffled groups of episodes, each batch holding every
    k-th turn of each, so all the rows a return-to-go baseline compares (same turn, other
    episodes) train in the same step.  Each (episode, turn) appears once per epoch."""
    rng = np.random.default_rng(seed)
    plan: list[list[tuple[int, int]]] = []
    for _ in range(epochs):
        epoch: list[list[tuple[int, int]]] = []
        order = rng.permutation(len(turns_E))
        for lo in range(0, len(order), episodes_per_batch):
            chunk = [int(e) for e in order[lo:lo + episodes_per_batch]]
            stride = max(1, math.ceil(max(turns_E[e] for e in chunk) / turns_per_batch))
            for phase in range(stride):
                items = [(e, t) for e in chunk for t in range(phase, turns_E[e], stride)]
                if items:
                    epoch.append(items)
        plan += [epoch[i] for i in rng.permutation(len(epoch))]
    return plan


def load_rendered_episodes(
    store: ObjectStore, card: DatasetCard, env: BuildingHVAC, discount: float, max_episodes: int | None = None,
    answer_decimals: int | None = None,
    answer_format: AnswerFormat = "kelvin",
) -> list[RenderedEpisode]:
    """Every episode of the dataset rendered as online prompts (partition files digest-checked)."""
    days = {item["start"]: int(item["day"]) for item in card.extras.get("episodes", [])}
    episodes: list[RenderedEpisode] = []
    for _, table in iter_partitions(store, card, verify=True):
        firsts = np.flatnonzero(table["is_first"].to_numpy(zero_copy_only=False))
        for lo, hi in zip(firsts, [*firsts[1:], table.num_rows], strict=True):
            if max_episodes is not None and len(episodes) >= max_episodes:
                return episodes
            episode = table.slice(int(lo), int(hi - lo))
            steps = render_building_episode(env, episode, answer_decimals, answer_format)
            start = episode["timestamp"][0].as_py()
            episodes.append(RenderedEpisode(
                episode_id=f"{card.name}/{episode['episode_id'][0].as_py()}",
                env_seed=days.get(start.isoformat(), start.date().toordinal()),
                steps=steps, returns_to_go=np.asarray(discounted_returns([s.reward for s in steps], discount)),
                terminated=bool(episode["is_terminal"][-1].as_py()),
            ))
    return episodes


def time_of_day_group(prefix: str, local: dt.datetime) -> str:
    """The group of a logged step: kind of day and local time, e.g. ``hvac@workday@14:05``.

    Why: the learner's return-to-go baseline averages the rows of one (group, turn).
    Logged days share no environment seed, so the meaningful comparison is the same
    time on days of the same kind (occupied workdays, empty weekends): a step is good
    if what followed it beat what followed the same hour on similar days.
    """
    return f"{prefix}@{'workday' if local.weekday() < 5 else 'weekend'}@{local:%H:%M}"


def trajectory_table(
    items: Sequence[tuple[int, int]],
    episodes: Sequence[RenderedEpisode],
    tokenizer: Any,
    env: BuildingHVAC,
    ids: Mapping[str, str],
    created_at: dt.datetime,
    with_text: bool = False,
) -> pa.Table:
    """The trajectory rows of one batch: prompt tokens (mask 0) + answer tokens and end-of-turn (mask 1).

    ``ids``: run_id, batch_id, producer_id, group_prefix.  Logged data has no sampler:
    logprobs are 0, ``policy_version`` 0 and ``adapter_sha256`` the base model's.  The
    group is ``time_of_day_group``.
    """
    from producers.episode import prompt_ids
    from schemas.trajectory import NO_ADAPTER_SHA, TRAJECTORY_SCHEMA

    system, history = env.system_prompt(), env.config.history_turns
    columns: dict[str, list[Any]] = {f.name: [] for f in TRAJECTORY_SCHEMA}
    for e, t in items:
        episode = episodes[e]
        step = episode.steps[t]
        prompt = prompt_ids(tokenizer, turn_messages(system, episode.steps, t, history))
        answer = [*tokenizer.encode(step.answer, add_special_tokens=False), int(tokenizer.eos_token_id)]
        tokens = [*prompt, *answer]
        row = {
            "run_id": ids["run_id"], "batch_id": ids["batch_id"], "episode_id": episode.episode_id,
            "group_id": time_of_day_group(ids["group_prefix"], env.local_time(step.timestamp)), "env": env.name,
            "env_seed": episode.env_seed, "producer_id": ids["producer_id"], "policy_version": 0,
            "adapter_sha256": NO_ADAPTER_SHA, "tokens": tokens, "loss_mask": [0] * len(prompt) + [1] * len(answer),
            "logprobs": [0.0] * len(tokens), "temperature": 1.0, "top_p": 1.0, "top_k": 0, "turn_rewards": [step.reward],
            "reward": float(sum(s.reward for s in episode.steps)), "turn": t,
            "return_to_go": float(episode.returns_to_go[t]), "num_turns": len(episode.steps), "success": False,
            "terminated": episode.terminated, "truncated": not episode.terminated, "created_at": created_at,
            "weight": None, "text": tokenizer.decode(tokens, skip_special_tokens=False) if with_text else None,
        }  # fmt: skip
        for name, value in row.items():
            columns[name].append(value)
    return pa.Table.from_pydict(columns, schema=TRAJECTORY_SCHEMA)


def dataset_to_trajectories(
    store: ObjectStore,
    name: str,
    run_id: str,
    tokenizer: Any,
    options: TrajectoryOptions | None = None,
    model: str = "",
    progress: Callable[[int, int], None] | None = None,
) -> ConversionReport:
    """Write dataset ``name`` as trajectory batches of run ``run_id`` (for ``rlpipe replay --train``).

    Batch ids are ``<dataset>-<index>`` in a date folder fixed by the dataset's card, so a
    second conversion into the same run fails on its first batch instead of mixing data.
    A summary (``runs/<run>/offline/<dataset>.json``) is written last.
    """
    from pipeline.archive import TrajectoryArchive
    from schemas.names import validate_name

    options = options or TrajectoryOptions()
    validate_name(run_id, "run_id")
    card = read_card(store, name)
    overrides = {} if options.history_turns is None else {"history_turns": options.history_turns}
    env = building_env_for(card, overrides)
    check_building_dataset(card, env)
    episodes = load_rendered_episodes(store, card, env, options.discount, options.max_episodes,
                                      options.answer_decimals, options.answer_format)
    plan = plan_batches([len(e.steps) for e in episodes], options.episodes_per_batch, options.turns_per_batch,
                        options.epochs, options.seed)
    archive = TrajectoryArchive(store)
    producer_id = validate_name(f"dataset-{name}"[:64].rstrip("-."), "producer_id")
    rows = tokens = generated = 0
    for index, items in enumerate(plan):
        batch_id = validate_name(f"{name[:48]}-{index:06d}", "batch_id")
        ids = {"run_id": run_id, "batch_id": batch_id, "producer_id": producer_id, "group_prefix": name}
        table = trajectory_table(items, episodes, tokenizer, env, ids, card.created_at, options.with_text)
        try:
            info = archive.write_batch(run_id, table, batch_id=batch_id, created=card.created_at)
        except FileExistsError:
            raise FileExistsError(
                f"run {run_id} already holds batches of dataset {name}; convert into a new --run"
            ) from None
        rows, tokens, generated = rows + info.num_rows, tokens + info.num_tokens, generated + info.num_generated_tokens
        if progress is not None:
            progress(index + 1, len(plan))
    summary_key = f"runs/{run_id}/offline/{name}.json"
    summary = {
        "dataset": name, "dataset_created_at": card.created_at.isoformat(), "model": model,
        "options": options.model_dump(mode="json"), "env": env.name,
        "env_overrides": dict(card.extras.get("env_overrides") or {}) | overrides,
        "episodes": len(episodes), "batches": len(plan), "rows": rows, "tokens": tokens,
        "generated_tokens": generated, "created_at": dt.datetime.now(dt.UTC).isoformat(),
    }  # fmt: skip
    store.put_create(summary_key, (json.dumps(summary, indent=2) + "\n").encode())
    return ConversionReport(run_id, name, len(episodes), len(plan), rows, tokens, generated, summary_key)


# ==== evaluation of offline-trained adapters in the online environment ============================


@dataclass
class DayOutcome:
    """One evaluated day: the return and what it was made of (sums over the day's steps)."""

    day: int
    episode_return: float = 0.0
    steps: int = 0
    invalid: int = 0
    comfort: float = 0.0  # normalised comfort regret (reward weight 0.2 by default)
    energy: float = 0.0  # normalised energy cost (weight 0.4)
    carbon: float = 0.0  # normalised carbon (weight 0.4)
    energy_usd: float = 0.0
    carbon_kg: float = 0.0
    productivity_usd: float = 0.0

    def add(self, env: BuildingHVAC, reward: float, valid: bool) -> None:
        """Count one step (``reward`` already includes any format penalty)."""
        b = env.breakdown
        self.episode_return += reward
        self.steps += 1
        self.invalid += not valid
        self.comfort += b.comfort
        self.energy += b.energy_cost
        self.carbon += b.carbon
        self.energy_usd += b.electricity_cost_usd + b.gas_cost_usd
        self.carbon_kg += b.carbon_kg
        self.productivity_usd += b.productivity_usd


def hold_answer(env: BuildingHVAC) -> str:
    """An answer that keeps the setpoints in force."""
    return format_answer([f"{env.setpoints.water_k:.6f}K, {env.setpoints.air_k:.6f}K"])


def applicable_answer(env: BuildingHVAC, text: str) -> tuple[str, bool]:
    """``(text, True)`` when the environment would accept ``text``, else ``(hold_answer, False)``.

    Why: online, an invalid answer costs the format penalty and does not move the clock, so
    a policy that always fails would sit out the day at -0.1 a turn and look better than a
    real controller.  Here every policy runs the same simulated day; an invalid answer keeps
    the previous setpoints for that step and still pays the penalty.
    """
    parsed = parse_answer(text, max_actions=env.config.max_actions_per_turn)
    ok = parsed.ok and all(_is_setpoint_pair(env.config, action) for action in parsed.actions)
    return (text, True) if ok else (hold_answer(env), False)


def _is_setpoint_pair(cfg: BuildingConfig, action: str) -> bool:
    """Whether the environment's parser accepts ``action`` (two setpoints, each a value it can place)."""
    values = parse_setpoint_values(action)
    return (values is not None and to_kelvin(values[0], cfg.supply_water_range_k) is not None
            and to_kelvin(values[1], cfg.supply_air_heating_range_k) is not None)


def scripted_outcomes(
    policy_of_day: Callable[[int], str], days: Sequence[int], seed: int, overrides: Mapping[str, Any] | None = None
) -> list[DayOutcome]:
    """Days played by scripted controllers (``heuristic`` or ``random`` per day)."""
    outcomes = []
    for day in days:
        env = day_env(day, overrides)
        env.reset(day)
        rng = random.Random(f"rlpipe-eval:{seed}:{day}")
        policy = policy_of_day(day)
        outcome = DayOutcome(day)
        while not env.done:
            result = env.step(policy_answer(env, policy, rng))
            outcome.add(env, result.reward, bool(result.info["action_is_valid"]))
        outcomes.append(outcome)
    return outcomes


@dataclass(frozen=True)
class SamplingSettings:
    """How the language-model policy samples during evaluation."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    seed: int = 0


def model_outcomes(
    sampler: Any,
    tokenizer: Any,
    adapter: Any,
    days: Sequence[int],
    overrides: Mapping[str, Any] | None = None,
    sampling: SamplingSettings | None = None,
) -> list[DayOutcome]:
    """Days played by the language model (``adapter`` None: the base model), all days in lockstep
    so each turn is one batched generation; prompts are built by the producer's own ``Episode``."""
    from producers.episode import ChatFormat, Episode
    from producers.samplers.base import SampleRequest
    from schemas.trajectory import NO_ADAPTER_SHA

    sampling = sampling or SamplingSettings()
    chat = ChatFormat.from_tokenizer(tokenizer)
    episodes, outcomes = [], []
    for day in days:
        env = day_env(day, overrides)
        episode = Episode(
            env=env, tokenizer=tokenizer, chat=chat, seed=day, episode_id=f"eval-{day}", group_id=f"eval-{day}",
            policy_version=getattr(adapter, "version", 0), adapter_sha256=getattr(adapter, "sha256", NO_ADAPTER_SHA),
            per_turn=True, history_turns=env.config.history_turns, max_model_len=sampler.max_model_len,
        )
        episode.start()
        episodes.append(episode)
        outcomes.append(DayOutcome(day))
    turn = 0
    while live := [i for i, episode in enumerate(episodes) if not episode.done]:
        prompts = [episodes[i].next_prompt() for i in live]
        outputs = sampler.generate([SampleRequest(p, sampling.max_new_tokens) for p in prompts], adapter,
                                   sampling.temperature, sampling.top_p, seed=sampling.seed * 1_000_003 + turn)
        for i, prompt, output in zip(live, prompts, outputs, strict=True):
            episode, env = episodes[i], episodes[i].env
            text = episode.record_generation(prompt, output.token_ids, output.logprobs)
            answer, valid = applicable_answer(env, text)
            result = env.step(answer)
            episode.apply_step(result)
            outcomes[i].add(env, result.reward + (0.0 if valid else env.config.format_penalty), valid)
        turn += 1
    return outcomes


def outcome_breakdown(outcomes: Sequence[DayOutcome]) -> dict[str, float]:
    """Per-day means of the reward's parts and their physical amounts, and the invalid-answer rate."""
    n = len(outcomes)
    steps = sum(o.steps for o in outcomes)
    mean = {key: sum(getattr(o, key) for o in outcomes) / n
            for key in ("comfort", "energy", "carbon", "energy_usd", "carbon_kg", "productivity_usd")}
    return {**mean, "invalid_rate": sum(o.invalid for o in outcomes) / max(steps, 1),
            "mean_step_reward": sum(o.episode_return for o in outcomes) / max(steps, 1)}


def eval_result(run_id: str, policy: str, version: int, outcomes: Sequence[DayOutcome]) -> Any:
    """The ``EvalResult`` of some evaluated days (seed = day index; ``seed_start`` the first day)."""
    from schemas.evaluation import EvalResult

    ordered = sorted(outcomes, key=lambda o: o.day)
    days = [o.day for o in ordered]
    if days != list(range(days[0], days[0] + len(days))):
        raise ValueError("evaluated days must be consecutive (episode i used seed_start + i)")
    return EvalResult.from_episodes(
        run_id=run_id, env=BuildingHVAC.name, version=version, seed_start=days[0],
        returns=[o.episode_return for o in ordered], successes=[False] * len(ordered), policy=policy,
        breakdown=outcome_breakdown(ordered),
    )


def store_eval_result(store: ObjectStore, result: Any) -> str:
    """Write one result create-only under ``runs/<run>/eval/``; return its key."""
    from schemas.evaluation import eval_key, eval_to_bytes

    key = eval_key(result)
    store.put_create(key, eval_to_bytes(result))
    return key


def behaviour_spec(card: DatasetCard) -> GenerationSpec:
    """The logged (behaviour) controller of a generated dataset; refused for data the simulator did not log."""
    generation = card.extras.get("generation")
    if not generation:
        raise DatasetImportError(f"dataset {card.name} was not generated by the simulator: its controller is unknown")
    return GenerationSpec.model_validate(generation)


def held_out_days(card: DatasetCard, count: int, first_day: int | None = None) -> list[int]:
    """``count`` consecutive day indices after the dataset's own (or from ``first_day``)."""
    if first_day is None:
        generation = card.extras.get("generation") or {}
        first_day = int(generation.get("first_day", 0)) + int(generation.get("days", 0))
        first_day = first_day or 1_000_000
    return list(range(first_day, first_day + count))


EVAL_POLICIES = ("adapter", "base", "behaviour", "heuristic", "random")


def evaluate_building(
    store: ObjectStore,
    run_id: str,
    policies: Sequence[str],
    days: Sequence[int],
    *,
    card: DatasetCard | None = None,
    model_path: str | None = None,
    version: int | None = None,
    sampling: SamplingSettings | None = None,
    history_turns: int | None = None,
    env_overrides: Mapping[str, Any] | None = None,
    cache_dir: str | Path | None = None,
    store_results: bool = True,
) -> list[Any]:
    """Play ``days`` with each policy and store one ``EvalResult`` each under ``runs/<run_id>/eval/``.

    ``adapter``: the run's adapter ``version`` (default: latest) on ``model_path``;
    ``base``: the model without adapter; ``behaviour``: the controller that logged ``card``;
    ``heuristic`` / ``random``: the environment's own.  The environment settings are the
    dataset's (so the model sees the prompts it was trained on), then ``env_overrides`` and
    ``history_turns``.
    """
    unknown = [p for p in policies if p not in EVAL_POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from {', '.join(EVAL_POLICIES)}")
    overrides = dict(card.extras.get("env_overrides") or {}) if card is not None else {}
    overrides |= dict(env_overrides or {})
    if history_turns is not None:
        overrides["history_turns"] = history_turns
    sampling = sampling or SamplingSettings()
    results = []
    for policy in policies:
        outcomes, policy_version = _policy_outcomes(store, run_id, policy, days, card, model_path, version,
                                                    sampling, overrides, cache_dir)
        result = eval_result(run_id, policy, policy_version, outcomes)
        if store_results:
            store_eval_result(store, result)
        results.append(result)
    return results


def _policy_outcomes(
    store: ObjectStore, run_id: str, policy: str, days: Sequence[int], card: DatasetCard | None,
    model_path: str | None, version: int | None, sampling: SamplingSettings, overrides: dict[str, Any],
    cache_dir: str | Path | None,
) -> tuple[list[DayOutcome], int]:
    if policy in ("heuristic", "random"):
        return scripted_outcomes(lambda day: policy, days, sampling.seed, overrides), 0
    if policy == "behaviour":
        if card is None:
            raise ValueError("the behaviour policy needs the dataset (--dataset) whose controller it replays")
        spec = behaviour_spec(card)
        return scripted_outcomes(lambda day: day_policy(spec, day), days, sampling.seed, overrides), 0
    if model_path is None:
        raise ValueError(f"policy {policy!r} needs a model (--model PATH or tiny)")
    adapter = _adapter_handle(store, run_id, version, cache_dir) if policy == "adapter" else None
    from transformers import AutoTokenizer

    from producers.samplers import make_sampler
    from schemas.config import SamplerConfig

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    config = SamplerConfig(backend="transformers", temperature=sampling.temperature, top_p=sampling.top_p,
                           max_new_tokens=sampling.max_new_tokens, seed=sampling.seed)
    with make_sampler("transformers", model_path, config, max_batch=max(1, min(len(days), 32))) as sampler:
        return model_outcomes(sampler, tokenizer, adapter, days, overrides, sampling), getattr(adapter, "version", 0)


def _adapter_handle(store: ObjectStore, run_id: str, version: int | None, cache_dir: str | Path | None) -> Any:
    """The run's adapter ``version`` (None: the latest) pulled, digest-checked, into a local folder."""
    from pipeline.registry import AdapterRegistry
    from pipeline.stack import rlpipe_home
    from producers.samplers.base import AdapterHandle

    registry = AdapterRegistry(store, run_id)
    if version is None:
        latest = registry.latest()
        if latest is None:
            raise FileNotFoundError(f"run {run_id} has no adapter versions; train it first (`rlpipe replay --train`)")
        version = latest.version
    folder = registry.pull(version, Path(cache_dir) if cache_dir else rlpipe_home() / "cache" / "adapters")
    return AdapterHandle.for_version(version, str(folder), registry.adapter_sha256(version))
