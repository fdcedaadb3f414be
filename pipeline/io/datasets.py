"""Offline datasets in the store: the dataset card, steps partitions, listing and scanning.

Importer (``producers.offline``, building its tables with ``pipeline.io.steps_arrays``)
-> ``DatasetWriter`` -> store -> ``read_card`` / ``scan_steps`` -> to-trajectories,
``rlpipe datasets show|sample``, benchmarks.  Layout of one dataset::

    datasets/<name>/steps/date=YYYY-MM-DD/part-00000.parquet   steps tables (schemas.steps), create-only
    datasets/<name>/dataset.json                               the card: written LAST, create-only

A dataset exists exactly when its card exists (the commit point, as an adapter's
manifest).  The card names every partition file with its sha256, size, rows,
episodes and time range, plus the dataset's fields and units, row counts, time
span and where it came from.  Readers trust only files the card names: a crashed
import leaves files no card names, which nobody reads and the next import of
the same name removes.

Partitions: one folder per day, the date on which each episode starts (local
time for building logs), so an episode never straddles two files and a day's
episodes are read together.  Scans prune files by the card's per-file time range
before opening anything (partition pruning), then push the exact time filter and
the column projection into the Parquet reader, so a narrow query costs in
proportion to what it matches, not to the dataset's size.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, Literal

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipeline.io.archive import TrajectoryArchive
from pipeline.io.store import ChecksumError, ObjectStore
from schemas.names import case_twin_of, validate_name
from schemas.steps import STEPS_BASE_FIELDS, check_steps_table
from schemas.versions import check_readable

log = logging.getLogger("rlpipe.datasets")

DATASETS_PREFIX = "datasets"
CARD_NAME = "dataset.json"
CARD_SCHEMA_VERSION = "1.0"
STEPS_FOLDER = "steps"
BASE_COLUMNS = tuple(f.name for f in STEPS_BASE_FIELDS)
TIMESTAMP_TYPE = pa.timestamp("us", tz="UTC")
FieldRole = Literal["observation", "action", "reward", "reward_info", "feature"]


class DatasetError(ValueError):
    """A dataset that cannot be written or read as asked."""


class DatasetNotFoundError(FileNotFoundError, ValueError):
    """No dataset of that name in the store: its card is missing (a ``FileNotFoundError``), and the name is the
    user's to fix (a ``ValueError``, so a command exits 2, as for a missing run)."""


class DatasetField(BaseModel):
    """One feature column of the steps table: where it came from and its unit."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str = Field(min_length=1, description="column name in the steps table")
    role: FieldRole = Field(description="which part of the log it belongs to")
    source_id: str = Field(min_length=1, description="the id in the source (device@field, a CSV column)")
    unit: str | None = Field(None, description="unit as the source states it; None = not stated")


class DatasetFile(BaseModel):
    """One partition file, as the card names it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    path: str = Field(description="key relative to the dataset folder, e.g. steps/date=2023-01-05/part-00000.parquet")
    date: dt.date = Field(description="the partition's day")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size_bytes: int = Field(ge=0)
    rows: int = Field(ge=1)
    episodes: int = Field(ge=1)
    time_min: datetime | None = Field(None, description="earliest step timestamp (UTC); None without timestamps")
    time_max: datetime | None = Field(None, description="latest step timestamp (UTC)")


class DatasetCard(BaseModel):
    """What a dataset holds and where it came from; its existence commits the dataset."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_version: str = Field(CARD_SCHEMA_VERSION, description="MAJOR.MINOR of the card")
    name: str = Field(description="dataset name (the folder under datasets/)")
    source: str = Field(min_length=1, max_length=64, description="importer: smart-buildings, table, ...")
    description: str = Field("", max_length=4096, description="free text for people")
    source_files: dict[str, str] = Field(
        default_factory=dict, description="source file name -> sha256 of its bytes (provenance)"
    )
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    fields: list[DatasetField] = Field(description="feature columns, in table order")
    observation_columns: list[str] = Field(description="features stacked, in order, into the observation vector")
    action_columns: list[str] = Field(description="features stacked, in order, into the action vector")
    reward_column: str | None = Field(None, description="feature copied into the reward column")
    episode_rule: str = Field("", max_length=512, description="how episode boundaries were drawn")
    step_seconds: float | None = Field(None, gt=0, description="typical spacing of steps (s)")
    num_rows: int = Field(ge=0)
    num_episodes: int = Field(ge=0)
    time_start: datetime | None = Field(None, description="earliest timestamp (UTC)")
    time_end: datetime | None = Field(None, description="latest timestamp (UTC)")
    files: list[DatasetFile] = Field(description="every partition file, by date then part")
    extras: dict[str, Any] = Field(default_factory=dict, description="importer-specific facts (JSON)")

    @model_validator(mode="before")
    @classmethod
    def _readable(cls, data: object) -> object:
        if isinstance(data, dict) and "schema_version" in data:
            check_readable(str(data["schema_version"]), CARD_SCHEMA_VERSION, "dataset card")
        return data

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return validate_name(value, "dataset name")

    @model_validator(mode="after")
    def _consistent(self) -> DatasetCard:
        if sum(f.rows for f in self.files) != self.num_rows:
            raise ValueError(f"num_rows is {self.num_rows} but the files hold {sum(f.rows for f in self.files)}")
        names = {f.name for f in self.fields}
        for column in [*self.observation_columns, *self.action_columns, *filter(None, [self.reward_column])]:
            if column not in names:
                raise ValueError(f"column {column!r} is named by the card but is not one of its fields")
        return self

    def field(self, name: str) -> DatasetField:
        """The field called ``name`` (KeyError naming the choices otherwise)."""
        for item in self.fields:
            if item.name == name:
                return item
        raise KeyError(f"dataset {self.name} has no field {name!r}")

    def units(self) -> dict[str, str | None]:
        """Field name -> unit."""
        return {f.name: f.unit for f in self.fields}


# ---- keys -------------------------------------------------------------------------------------


def dataset_prefix(name: str) -> str:
    """Folder key of one dataset."""
    return f"{DATASETS_PREFIX}/{validate_name(name, 'dataset name')}"


def card_key(name: str) -> str:
    """Key of a dataset's card (``datasets/<name>/dataset.json``)."""
    return f"{dataset_prefix(name)}/{CARD_NAME}"


def partition_path(day: dt.date, part: int) -> str:
    """Partition file key relative to the dataset folder: ``steps/date=YYYY-MM-DD/part-00000.parquet``."""
    if part < 0:
        raise DatasetError(f"part number must be >= 0, got {part}")
    return f"{STEPS_FOLDER}/date={day.isoformat()}/part-{part:05d}.parquet"


# ---- writing ----------------------------------------------------------------------------------


class DatasetWriter:
    """Writes one new dataset: partition files first, the card last (create-only).

    ``open`` refuses a name whose card exists and removes leftovers of an import that
    crashed before its card (no reader ever trusted them).  ``write_partition`` may be
    called many times per day; each call is one file.  ``commit`` writes the card.
    """

    def __init__(self, store: ObjectStore, name: str) -> None:
        self.store, self.name = store, validate_name(name, "dataset name")
        self.archive = TrajectoryArchive(store)
        self.files: list[DatasetFile] = []
        self._parts: dict[dt.date, int] = {}
        self._committed = False

    def open(self) -> DatasetWriter:
        """Check the name is free and clear an unfinished earlier import; return self."""
        require_free_name(self.store, self.name)
        leftovers = self.store.list(dataset_prefix(self.name), recursive=True)
        if leftovers:
            log.warning("dataset %s: removing %d files of an unfinished import", self.name, len(leftovers))
            self.store.delete(dataset_prefix(self.name), recursive=True, missing_ok=True)
        return self

    def write_partition(self, day: dt.date, table: pa.Table) -> DatasetFile:
        """Write one steps table as the next part of ``day``'s partition; return its card entry."""
        if self._committed:
            raise DatasetError(f"dataset {self.name} is committed; write a new dataset instead")
        if table.num_rows == 0:
            raise DatasetError("a partition needs at least one row")
        check_steps_table(table)
        part = self._parts.get(day, 0)
        self._parts[day] = part + 1
        path = partition_path(day, part)
        sha256 = self.archive.write_steps(f"{dataset_prefix(self.name)}/{path}", table)
        time_min, time_max = _time_range(table)
        entry = DatasetFile(
            path=path, date=day, sha256=sha256, size_bytes=_size(self.store, f"{dataset_prefix(self.name)}/{path}"),
            rows=table.num_rows, episodes=int(pc.count_distinct(table["episode_id"]).as_py()),
            time_min=time_min, time_max=time_max,
        )
        self.files.append(entry)
        return entry

    def commit(self, **card_fields: Any) -> DatasetCard:
        """Write the card (create-only) naming every file written; the dataset exists from here on."""
        if not self.files:
            raise DatasetError(f"dataset {self.name}: nothing was written; a dataset needs at least one row")
        files = sorted(self.files, key=lambda f: f.path)
        starts = [f.time_min for f in files if f.time_min is not None]
        ends = [f.time_max for f in files if f.time_max is not None]
        card = DatasetCard(
            name=self.name, files=files, num_rows=sum(f.rows for f in files),
            num_episodes=card_fields.pop("num_episodes", sum(f.episodes for f in files)),
            time_start=min(starts) if starts else None, time_end=max(ends) if ends else None, **card_fields,
        )
        # once: a retried create (gs://) whose first attempt landed finds this card, with its own created_at
        self.store.put_create_once(card_key(self.name), card_to_bytes(card))
        self._committed = True
        return card


def require_free_name(store: ObjectStore, name: str) -> str:
    """``name`` if it is a valid dataset name that no committed dataset holds (``FileExistsError`` naming the fix
    otherwise): what writes a dataset checks this before work that would be lost on refusal."""
    twin = case_twin_of(name, (key.rsplit("/", 1)[-1] for key in store.list(DATASETS_PREFIX)))
    if twin is not None:  # committed or still importing: on a case-insensitive filesystem its folder is this one
        raise FileExistsError(f"dataset {name!r} differs only in case from {twin!r} in {store.url(DATASETS_PREFIX)}, "
                              "whose files it would share on a case-insensitive filesystem; choose another --name")
    if store.exists(card_key(name)):
        raise FileExistsError(f"dataset {name} already exists in {store.url(dataset_prefix(name))}; "
                              "choose another --name")
    return name


def card_to_bytes(card: DatasetCard) -> bytes:
    """Canonical JSON of a card (what ``dataset.json`` holds)."""
    return (json.dumps(card.model_dump(mode="json"), indent=2, sort_keys=True) + "\n").encode()


def card_from_bytes(data: bytes, where: str = "dataset card") -> DatasetCard:
    """Bytes -> validated card; ``DatasetError`` says what is wrong."""
    try:
        return DatasetCard.model_validate(json.loads(data))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DatasetError(f"{where} is not JSON: {exc}") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        place = ".".join(str(p) for p in first["loc"]) or "card"
        raise DatasetError(f"{where} is not a valid dataset card: {place}: {first['msg']}") from None


def _time_range(table: pa.Table) -> tuple[datetime | None, datetime | None]:
    bounds = pc.min_max(table["timestamp"]).as_py()
    return bounds["min"], bounds["max"]


def _size(store: ObjectStore, key: str) -> int:
    return int(store.filesystem.size(store.path(key)))


# ---- reading ----------------------------------------------------------------------------------


def dataset_names(store: ObjectStore) -> list[str]:
    """Names of the committed datasets (those with a card), sorted."""
    names = [key.rsplit("/", 1)[-1] for key in store.list(DATASETS_PREFIX)]
    return [name for name in names if store.exists(f"{DATASETS_PREFIX}/{name}/{CARD_NAME}")]


def read_card(store: ObjectStore, name: str) -> DatasetCard:
    """The card of dataset ``name``; a one-line error when there is none."""
    key = card_key(name)
    try:
        data = store.get(key)
    except FileNotFoundError:
        raise DatasetNotFoundError(
            f"no dataset {name!r} in {store.url(DATASETS_PREFIX)}; see `rlpipe datasets list`"
        ) from None
    card = card_from_bytes(data, store.url(key))
    if card.name != name and card.name.lower() == name.lower():  # a case-insensitive filesystem found the twin's
        raise DatasetNotFoundError(f"no dataset {name!r} in {store.url(DATASETS_PREFIX)}, but {card.name!r} is: "
                                   f"dataset names are case-sensitive; name it {card.name}")
    return card


def read_partition(store: ObjectStore, card: DatasetCard, entry: DatasetFile, verify: bool = True) -> pa.Table:
    """One partition file, its sha256 checked against the card unless ``verify`` is False (``ChecksumError``
    naming the file and the fix)."""
    key = f"{dataset_prefix(card.name)}/{entry.path}"
    try:
        return TrajectoryArchive(store).read_steps(key, entry.sha256 if verify else None)
    except ChecksumError:
        raise ChecksumError(
            f"{store.url(key)} does not match the sha256 checksum in dataset {card.name}'s card: it is corrupt or "
            f"was replaced; restore it, or import the dataset again under a new --name (`rlpipe datasets show "
            f"{card.name} --verify` lists every such file)"
        ) from None


def read_dataset(store: ObjectStore, card: DatasetCard) -> pa.Table:
    """Every step of the dataset as one table, each partition digest-checked against the card first: what
    trains on the whole dataset reads it here, so a file changed since the card was written is refused."""
    return pa.concat_tables([table for _, table in iter_partitions(store, card, verify=True)])


def iter_partitions(
    store: ObjectStore, card: DatasetCard, verify: bool = True
) -> Iterable[tuple[DatasetFile, pa.Table]]:
    """Every partition of the dataset in date order, one table at a time (memory stays one file)."""
    for entry in card.files:
        yield entry, read_partition(store, card, entry, verify)


def verify_dataset(store: ObjectStore, card: DatasetCard) -> list[str]:
    """Re-hash every file the card names; return one line per problem (empty when all is well)."""
    problems = []
    for entry in card.files:
        try:
            read_partition(store, card, entry, verify=True)
        except (FileNotFoundError, ValueError) as exc:
            problems.append(f"{entry.path}: {str(exc).splitlines()[0]}")
    return problems


# ---- scanning ---------------------------------------------------------------------------------


def select_files(card: DatasetCard, start: datetime | None = None, end: datetime | None = None) -> list[DatasetFile]:
    """Partition pruning: the files whose time range meets ``[start, end)`` (no file is opened)."""
    start, end = _utc(start), _utc(end)
    chosen = []
    for entry in card.files:
        if entry.time_min is None or entry.time_max is None:
            chosen.append(entry)  # no timestamps: cannot prune
            continue
        if (end is not None and entry.time_min >= end) or (start is not None and entry.time_max < start):
            continue
        chosen.append(entry)
    return chosen


def device_columns(card: DatasetCard, devices: Sequence[str]) -> list[str]:
    """Feature columns of the given devices (or zones): ``zone_0_1`` selects ``zone_0_1@*`` and
    ``action:zone_0_1@*``; the base columns come with every scan anyway."""
    wanted = set(devices)
    return [f.name for f in card.fields if f.source_id.split("@", 1)[0] in wanted]


def scan_dataset(
    store: ObjectStore,
    card: DatasetCard,
    start: datetime | None = None,
    end: datetime | None = None,
    columns: Sequence[str] | None = None,
) -> ds.Dataset | None:
    """A pyarrow dataset over the pruned files, or None when no file can match."""
    files = select_files(card, start, end)
    if not files:
        return None
    if columns is not None:
        known = set(BASE_COLUMNS) | {f.name for f in card.fields}
        unknown = [c for c in columns if c not in known]
        if unknown:
            raise DatasetError(f"dataset {card.name} has no columns {unknown[:5]}; see `rlpipe datasets show`")
    paths = [store.path(f"{dataset_prefix(card.name)}/{entry.path}") for entry in files]
    return ds.dataset(paths, filesystem=_arrow_filesystem(store), format="parquet")


def _arrow_filesystem(store: ObjectStore) -> Any:
    """Arrow's own local filesystem for a local root (multi-threaded native reads); fsspec otherwise."""
    if store.is_local:
        import pyarrow.fs as pafs

        return pafs.LocalFileSystem()
    return store.filesystem


def time_filter(start: datetime | None, end: datetime | None) -> ds.Expression | None:
    """``start <= timestamp < end`` (either bound optional) as a pushed-down Parquet filter."""
    parts = []
    if start is not None:
        parts.append(ds.field("timestamp") >= pa.scalar(_utc(start), type=TIMESTAMP_TYPE))
    if end is not None:
        parts.append(ds.field("timestamp") < pa.scalar(_utc(end), type=TIMESTAMP_TYPE))
    if not parts:
        return None
    return parts[0] & parts[1] if len(parts) == 2 else parts[0]


def read_steps(
    store: ObjectStore,
    name: str,
    start: datetime | None = None,
    end: datetime | None = None,
    columns: Sequence[str] | None = None,
    devices: Sequence[str] | None = None,
) -> pa.Table:
    """Steps of ``name`` with ``start <= timestamp < end``, only ``columns`` (or the base columns plus the
    features of ``devices``), as one Arrow table; cost follows the files and columns that match."""
    card = read_card(store, name)
    if devices is not None:
        columns = [*(columns or BASE_COLUMNS), *device_columns(card, devices)]
    dataset = scan_dataset(store, card, start, end, columns)
    if dataset is None:
        return _empty(card, columns)
    return dataset.to_table(columns=list(columns) if columns is not None else None, filter=time_filter(start, end))


def scan_steps(
    store: ObjectStore,
    name: str,
    start: datetime | None = None,
    end: datetime | None = None,
    columns: Sequence[str] | None = None,
    devices: Sequence[str] | None = None,
) -> pl.LazyFrame:
    """The same selection as ``read_steps`` as a polars LazyFrame: only the pruned files are scanned,
    with the time filter and the projection pushed down (polars' native reader on a local root)."""
    card = read_card(store, name)
    if devices is not None:
        columns = [*(columns or BASE_COLUMNS), *device_columns(card, devices)]
    dataset = scan_dataset(store, card, start, end, columns)
    if dataset is None:
        return pl.from_arrow(_empty(card, columns)).lazy()  # type: ignore[union-attr]
    if store.is_local:
        frame = pl.scan_parquet(dataset.files)
        if start is not None:
            frame = frame.filter(pl.col("timestamp") >= _utc(start))
        if end is not None:
            frame = frame.filter(pl.col("timestamp") < _utc(end))
    else:
        condition = time_filter(start, end)
        frame = pl.scan_pyarrow_dataset(dataset.filter(condition) if condition is not None else dataset)
    return frame.select(list(columns)) if columns is not None else frame


def _empty(card: DatasetCard, columns: Sequence[str] | None) -> pa.Table:
    from schemas.steps import steps_schema

    schema = steps_schema([f.name for f in card.fields])
    table = schema.empty_table()
    return table.select(list(columns)) if columns is not None else table


def _utc(moment: datetime | None) -> datetime | None:
    if moment is None:
        return None
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
