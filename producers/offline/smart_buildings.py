"""Import of the Smart Buildings layout (``google/sbsim`` dataset partitions) as a dataset.

``data.npy.npz`` holds ``observation_value_matrix``, ``action_value_matrix``,
``reward_value_matrix`` and ``reward_info_value_matrix`` (one row per 5-minute step); the
metadata maps column ids (``device@field``) to column indices and lists the timestamps.
Upstream the metadata is a pickle: it is refused unless the caller passes ``trust_pickle``
(the CLI's ``--trust-pickle``), and then read by ``TrustedMetadataUnpickler``, which loads
only builtins containers, datetimes and plain numpy arrays and maps pandas timestamps to
``datetime`` without importing pandas.  The same content as JSON is always accepted.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import itertools
import json
import math
import pickle
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.io.datasets import DatasetCard, DatasetField, DatasetWriter
from pipeline.io.steps_arrays import US_PER_SECOND, EpisodeSplit, episode_starts
from pipeline.io.store import ObjectStore
from producers.offline.episodes import (
    DatasetImportError,
    day_tables,
    episode_days,
    episode_id_for,
    episode_rule,
    median_step,
)

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
MATRIX_TIMES = dict(zip(MATRICES, ("observation_timestamps", "action_timestamps", "reward_timestamps",
                                   "reward_info_timestamps"), strict=True))


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
    matrix_times_us: dict[str, np.ndarray]  # matrix name -> UTC epoch microseconds of its rows (its own timestamps)


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
    matrix_times = {matrix: _timestamps_us(raw[key], key, where) if key in raw and key != "observation_timestamps"
                    else times for matrix, key in MATRIX_TIMES.items()}
    aligned = all(np.array_equal(stamps, times) for stamps in matrix_times.values())
    units = {str(k): str(v) for k, v in (raw.get("units") or {}).items()}
    extension = raw.get("rlpipe") or {}
    if not isinstance(extension, Mapping):
        raise DatasetImportError(f"{where}: 'rlpipe' must be a mapping")
    return SbdMetadata(ids=ids, times_us_R=times, units=units, rlpipe=dict(extension), aligned=aligned,
                       matrix_times_us=matrix_times)


def step_rows(metadata: SbdMetadata, where: str) -> dict[str, np.ndarray]:
    """Matrix name -> its row of each step, steps in time order.

    A step starts at an observation time; its action, reward and reward info are the rows of
    their matrices stamped with that time (each matrix has its own timestamps: upstream stamps
    a reward with the start of the interval it scores, one step before the observation of the
    same row).  An observation time that some matrix does not log starts no step.
    """
    order_S = np.argsort(metadata.times_us_R, kind="stable")
    times_S = metadata.times_us_R[order_S]
    rows = {}
    found_S = np.ones(times_S.size, dtype=bool)
    for matrix, stamps in metadata.matrix_times_us.items():
        if np.array_equal(stamps, metadata.times_us_R):
            rows[matrix] = order_S
            continue
        by_time = np.argsort(stamps, kind="stable")
        sorted_stamps = stamps[by_time]
        if np.any(np.diff(sorted_stamps) == 0):
            raise DatasetImportError(f"{where}: {MATRIX_TIMES[matrix]} holds a time twice; a matrix logs each time "
                                     "once: drop the repeated rows")
        position_S = np.minimum(np.searchsorted(sorted_stamps, times_S), max(stamps.size - 1, 0))
        found_S &= sorted_stamps[position_S] == times_S if stamps.size else False
        rows[matrix] = by_time[position_S] if stamps.size else position_S
    if not found_S.any():
        raise DatasetImportError(f"{where}: no observation time has an action, reward and reward info stamped at it; "
                                 "check the partition's timestamps")
    return {matrix: rows_S[found_S] for matrix, rows_S in rows.items()}


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
        raise DatasetImportError(f"no such file or folder: {path}; point at a partition folder (it holds "
                                 f"{NPZ_NAME}) or a folder of them")
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
    matrices = _read_matrices(npz_file, MATRICES)
    missing = [m for m in MATRICES if m not in matrices]
    if missing:
        raise DatasetImportError(f"{npz_file} lacks {', '.join(missing)}")
    _check_shapes(matrices, metadata, npz_file)
    base = root or folder
    source_files = {
        str(p.relative_to(base)) if p.is_relative_to(base) else p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in (npz_file, meta_file)
    }
    return SbdPartition(folder, matrices, metadata, source_files)


def _read_matrices(npz_file: Path, names: Sequence[str]) -> dict[str, np.ndarray]:
    """The matrices ``names`` that ``npz_file`` holds, read without pickle; a one-line error naming the file
    for an object array (which would need pickle) or a corrupt file."""
    try:
        with np.load(npz_file, allow_pickle=False) as npz:
            return {m: np.asarray(npz[m]) for m in names if m in npz.files}
    except ValueError as exc:
        raise DatasetImportError(f"{npz_file} cannot be read without pickle: {str(exc).splitlines()[0]}") from None


def _check_shapes(matrices: dict[str, np.ndarray], metadata: SbdMetadata, where: Path) -> None:
    for name in MATRICES:
        matrix = matrices[name]
        if matrix.ndim != 2 or not np.issubdtype(matrix.dtype, np.number):
            raise DatasetImportError(f"{where}: {name} must be a 2-D numeric matrix, got {matrix.dtype} {matrix.shape}")
        expected = (metadata.matrix_times_us[name].size, len(metadata.ids[name]))
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
    check_each_time_once(folders, metadatas, path)
    if reward_id not in metadatas[0].ids["reward_value_matrix"]:
        raise DatasetImportError(f"the reward matrix has no column {reward_id!r}; pass one of its reward_value_ids")
    for folder, metadata in zip(folders, metadatas, strict=True):
        check_steps_finite(folder, metadata, reward_id, path)
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
        step_seconds = step_seconds or median_step(np.sort(partition.metadata.times_us_R))
        for day, table in _partition_days(partition, fields, reward_id, step_seconds, split, offset):
            writer.write_partition(day, table)
    return writer.commit(
        source=source, description=description, source_files=source_files, fields=fields,
        observation_columns=[f.name for f in fields if f.role == "observation"],
        action_columns=[f.name for f in fields if f.role == "action"],
        reward_column=ROLE_PREFIX["reward"] + reward_id,
        episode_rule=episode_rule(split, offset), step_seconds=step_seconds,
        extras={**extension, "layout": "smart-buildings", "utc_offset_hours": offset, "timestamps_aligned": aligned,
                "partitions": [str(f.relative_to(path)) if f != path else "." for f in folders]},
    )


def check_each_time_once(folders: list[Path], metadatas: list[SbdMetadata], root: Path) -> None:
    """Refuse a time logged twice: within one partition, or by two partitions whose time ranges overlap
    (a folder holding a copy of a partition would otherwise import every step twice)."""

    def shown(folder: Path) -> str:
        return str(folder.relative_to(root)) if folder != root and folder.is_relative_to(root) else folder.name

    for folder, metadata in zip(folders, metadatas, strict=True):
        times = metadata.times_us_R
        twice = times.size - np.unique(times).size
        if twice:
            raise DatasetImportError(
                f"{shown(folder / metadata_path(folder).name)} logs {twice} timestamp{'s' if twice > 1 else ''} "
                "twice; a dataset holds each time once: drop the repeated rows from the partition"
            )
    spans = sorted(((int(m.times_us_R.min()), int(m.times_us_R.max()), f, m)
                    for f, m in zip(folders, metadatas, strict=True) if m.times_us_R.size), key=lambda s: s[:2])
    # sorted by first time, two partitions overlap only if some neighbours do
    for (_, end, first, earlier), (start, _, second, later) in itertools.pairwise(spans):
        if start <= end:
            both = np.intersect1d(earlier.times_us_R, later.times_us_R).size
            raise DatasetImportError(
                f"partitions {shown(first)} and {shown(second)} overlap in time ({_utc_text(start)} .. "
                f"{_utc_text(min(end, int(later.times_us_R.max())))} UTC, {both} timestamps in both); a dataset "
                "holds each time once: import one of them, or each as its own dataset (another --name)"
            )


def check_steps_finite(folder: Path, metadata: SbdMetadata, reward_id: str, root: Path) -> None:
    """Refuse a partition whose action or reward (column ``reward_id``) is missing (NaN) or infinite at some
    step, naming the column and the first such time: every step needs both (an observation may lack a reading).

    Reads only the action and reward matrices, so it runs for every partition before anything is written.
    """
    npz_file = folder / NPZ_NAME
    shown = str(npz_file.relative_to(root)) if npz_file.is_relative_to(root) else npz_file.name
    reward_column = metadata.ids["reward_value_matrix"].index(reward_id)
    rows = step_rows(metadata, shown)
    times_S = metadata.times_us_R[rows["observation_value_matrix"]]
    wanted = {"action_value_matrix": None, "reward_value_matrix": reward_column}
    stored = _read_matrices(npz_file, list(wanted))  # load_partition names any missing
    for matrix, only in wanted.items():
        values = stored.get(matrix)
        if values is None or values.ndim != 2 or not np.issubdtype(values.dtype, np.number):
            continue  # load_partition names what is missing or not numeric
        if values.shape != (metadata.matrix_times_us[matrix].size, len(metadata.ids[matrix])):
            continue  # load_partition names the shape
        values = values[rows[matrix]].astype(np.float64)
        columns = range(values.shape[1]) if only is None else [only]
        for column in columns:
            finite = np.isfinite(values[:, column])
            if not finite.all():
                row = int(np.argmin(finite))
                name = ROLE_PREFIX[MATRIX_ROLE[matrix]] + metadata.ids[matrix][column]
                raise DatasetImportError(
                    f"{shown}: {name} is missing or not finite at {_utc_text(int(times_S[row]))} UTC; every "
                    "step needs its action and reward: fill it in or drop the row"
                )


def _utc_text(epoch_us: int) -> str:
    moment = dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(microseconds=epoch_us)
    return moment.strftime("%Y-%m-%d %H:%M")


def _partition_days(
    partition: SbdPartition, fields: list[DatasetField], reward_id: str, step_seconds: float,
    split: EpisodeSplit, offset: float,
) -> Iterator[tuple[dt.date, pa.Table]]:
    """One partition's matrices -> per-day steps tables (every column a float64 feature), one row per step
    (``step_rows``: in time order, each matrix's row stamped with the step's time)."""
    rows = step_rows(partition.metadata, str(partition.folder))
    times = partition.metadata.times_us_R[rows["observation_value_matrix"]]
    features: dict[str, np.ndarray] = {}
    index = 0
    for matrix in MATRICES:
        values = partition.matrices[matrix][rows[matrix]]
        for column in range(values.shape[1]):
            features[fields[index].name] = values[:, column].astype(np.float64)
            index += 1
    starts = episode_starts(times, step_seconds, split, offset)
    columns = ([f.name for f in fields if f.role == "observation"], [f.name for f in fields if f.role == "action"],
               ROLE_PREFIX["reward"] + reward_id)
    ids = [episode_id_for(int(times[s])) for s in starts]
    yield from day_tables(times, episode_days(times, starts, offset), starts, ids, features, columns)
