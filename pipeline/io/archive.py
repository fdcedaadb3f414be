"""The trajectory archive: immutable Parquet batches in the object store, and scans across them.

Producer -> ``write_batch`` -> store -> ``TrajectoryBatchCommitted`` -> learner ->
``read_batch``.  One batch is one Parquet file written create-only at

    runs/<run_id>/trajectories/date=YYYY-MM-DD/<batch_id>.parquet

so a retried write with the same ``batch_id`` cannot duplicate data (it fails with
``FileExistsError``), and the date folders let scans skip whole days.  The file's
schema metadata carries ``rlpipe.schema_version``; readers refuse a newer major.

Each batch records when it was committed: in the Parquet file's metadata
(``rlpipe.committed_at``) and, with the file's sha256, in a small commit record
``<batch_id>.commit.json`` beside it, written first (a record without its file is
ignored).  Offline replay orders batches by that time and verifies that digest
without a broker (``commits``, ``check_digests``).  A file whose record is missing,
corrupt or names another file is refused: without its digest nothing shows that
the file is the one committed, and replay would train on it unchecked.

Reading one batch (``read_batch``) verifies the sha256 from the claim-check event.
Scanning many (``scan``) is for replay and analysis: it prunes runs and dates by
listing folders, then hands polars a pyarrow dataset opened through the store's
own fsspec filesystem (polars' native gs:// client would ignore the emulator's
endpoint).  Scans do not verify digests; nothing names the set of files scanned.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Mapping
from datetime import UTC, date, datetime
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError

from pipeline.io.archive_layout import (
    batch_key,
    commit_record_key,
    damaged_run_fix,
    partition_date,
    steps_prefix,
    trajectories_prefix,
)
from pipeline.io.store import ChecksumError, ObjectStore, sha256_hex, validate_key
from schemas.events import TrajectoryBatchCommitted
from schemas.names import validate_name
from schemas.steps import BATCH_SUMMARY_KEY, STEPS_BASE_FIELDS, check_steps_table
from schemas.trajectory import (
    TRAJECTORY_SCHEMA,
    TrajectoryRecord,
    check_trajectory_values,
    conform_table,
    records_to_table,
)

COMMITTED_AT_KEY = b"rlpipe.committed_at"
DATE_PARTITION = pa.field("date", pa.date32())
SCAN_SCHEMA = TRAJECTORY_SCHEMA.append(DATE_PARTITION)
_HIVE_DATE = ds.partitioning(pa.schema([DATE_PARTITION]), flavor="hive")
PARQUET_COMPRESSION = "zstd"


class ArchiveError(ValueError):
    """A batch that cannot be written or read as asked."""


class BatchInfo(BaseModel):
    """What a written batch holds: everything a ``TrajectoryBatchCommitted`` event needs, and more."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str
    batch_id: str
    path: str = Field(description="object key relative to the store root")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size_bytes: int = Field(ge=0)
    num_rows: int = Field(ge=1)
    num_tokens: int = Field(ge=0)
    num_generated_tokens: int = Field(ge=0)
    num_groups: int = Field(ge=0)
    envs: list[str] = Field(description="distinct environments in the batch, sorted")
    producer_ids: list[str] = Field(description="distinct producers in the batch, sorted")
    policy_version_min: int = Field(ge=0)
    policy_version_max: int = Field(ge=0)
    reward_mean: float
    reward_min: float
    reward_max: float
    success_rate: float = Field(ge=0.0, le=1.0)
    created_at: datetime


def batch_committed_payload(
    info: BatchInfo, env: str | None = None, producer_id: str | None = None
) -> TrajectoryBatchCommitted:
    """The claim-check event for a written batch; ``env``/``producer_id`` default to the batch's only one."""
    return TrajectoryBatchCommitted(
        batch_id=info.batch_id,
        path=info.path,
        sha256=info.sha256,
        num_rows=info.num_rows,
        num_tokens=info.num_tokens,
        num_generated_tokens=info.num_generated_tokens,
        num_groups=info.num_groups,
        env=env if env is not None else _only(info.envs, "env"),
        producer_id=producer_id if producer_id is not None else _only(info.producer_ids, "producer_id"),
        policy_version_min=info.policy_version_min,
        policy_version_max=info.policy_version_max,
        reward_mean=info.reward_mean,
        reward_min=info.reward_min,
        reward_max=info.reward_max,
        success_rate=info.success_rate,
        created_at=info.created_at,
    )


class BatchCommit(BaseModel):
    """When a stored batch was committed and its file's digest (the commit record beside the file)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str
    batch_id: str
    committed_at: AwareDatetime = Field(description="UTC; a time without a zone cannot be ordered among the others")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @property
    def order(self) -> tuple[datetime, str]:
        """Commit order: time, then batch id (ties between producers broken the same way everywhere)."""
        return self.committed_at, self.batch_id


class TrajectoryArchive:
    """Write, read and scan trajectory batches in one ``ObjectStore``."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    # -- one batch ---------------------------------------------------------------------------

    def write_batch(
        self,
        run_id: str,
        table_or_records: pa.Table | Iterable[TrajectoryRecord | Mapping[str, Any]],
        batch_id: str | None = None,
        created: datetime | None = None,
    ) -> BatchInfo:
        """Write one immutable batch (create-only) and return its summary.

        ``batch_id`` defaults to the rows' own (they must all carry the same one);
        ``created`` (UTC, default now) picks the date folder.
        """
        table = _as_trajectory_table(table_or_records)
        if table.num_rows == 0:
            raise ArchiveError("a batch needs at least one row; write nothing instead")
        check_trajectory_values(table)  # no learner trains on a NaN, and no event can carry its mean
        _require_only(table, "run_id", validate_name(run_id, "run_id"))
        batch_id = batch_id or _only(_distinct(table, "batch_id"), "batch_id")
        _require_only(table, "batch_id", batch_id)
        created = _utc(created or datetime.now(UTC))
        key = batch_key(run_id, created.date(), batch_id)
        data = parquet_bytes(_with_commit_time(table, created))
        sha256 = sha256_hex(data)
        self._write_commit_record(key, batch_id, created, sha256)
        if self.store.put_create_once(key, data) != sha256:  # once: a retried create of our own file lands
            raise ArchiveError(f"{self.store.url(key)} was stored with other bytes than written; write it again")
        return summarize_batch(
            table, run_id=run_id, batch_id=batch_id, path=key, sha256=sha256, size_bytes=len(data), created_at=created
        )

    def _write_commit_record(self, key: str, batch_id: str, committed_at: datetime, sha256: str) -> None:
        """The commit record, create-only; one left by an attempt that died before its file is replaced."""
        record = BatchCommit(key=key, batch_id=batch_id, committed_at=committed_at, sha256=sha256)
        data = record.model_dump_json().encode()
        try:
            self.store.put_create(commit_record_key(key), data)
        except FileExistsError:
            if self.store.exists(key):
                raise FileExistsError(f"batch {batch_id} already exists at {self.store.url(key)}") from None
            self.store.put(commit_record_key(key), data)

    def commits(self, run_id: str) -> list[BatchCommit]:
        """Every stored batch of ``run_id`` with its commit time and digest, in commit order.

        From the commit records; a batch whose record is missing, corrupt or names
        another file is refused (``ArchiveError``, naming the batch and the fix).
        """
        return sorted((self._commit_of(run_id, key) for key in self.list_batches(run_id)),
                      key=lambda commit: commit.order)

    def _commit_of(self, run_id: str, key: str) -> BatchCommit:
        record_key = commit_record_key(key)
        batch_id = key.rsplit("/", 1)[-1].removesuffix(".parquet")
        try:
            data = self.store.get(record_key)
        except FileNotFoundError:
            raise ArchiveError(f"trajectory batch {batch_id} of run {run_id} has no commit record "
                               f"({self.store.url(record_key)}), so its digest cannot be checked; "
                               f"{damaged_run_fix(run_id)}") from None
        try:
            commit = BatchCommit.model_validate_json(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise ArchiveError(f"commit record {self.store.url(record_key)} is corrupt "
                               f"({where + ': ' if where else ''}{first['msg']}); {damaged_run_fix(run_id)}") from None
        if commit.key != key or commit.batch_id != batch_id:  # else one file is offered twice, the other never
            raise ArchiveError(f"commit record {self.store.url(record_key)} names batch {commit.key}, not the file "
                               f"beside it; {damaged_run_fix(run_id)}")
        return commit

    def check_digests(self, run_id: str, commits: Iterable[BatchCommit]) -> None:
        """Refuse (``ChecksumError``, naming the batch and the fix) the first batch whose file no longer has the
        digest its commit record holds: replay checks every batch before it trains or announces any."""
        for commit in commits:
            self._committed_bytes(run_id, commit)

    def _committed_bytes(self, run_id: str, commit: BatchCommit) -> bytes:
        """A batch's file, refused (``ChecksumError`` naming it and the fix) unless its commit record's digest."""
        try:
            return self.store.get(commit.key, sha256=commit.sha256)
        except ChecksumError:
            raise ChecksumError(f"trajectory batch {commit.batch_id} of run {run_id} "
                                f"({self.store.url(commit.key)}) does not match the sha256 in its commit "
                                f"record: it is corrupt or was replaced; {damaged_run_fix(run_id)}") from None

    def read_batch(self, path: str, sha256: str | None = None) -> pa.Table:
        """The batch at ``path`` (a key from an event), digest-verified when ``sha256`` is given, schema-checked."""
        return self._batch_table(path, self.store.get(path, sha256))

    def _batch_table(self, path: str, data: bytes) -> pa.Table:
        try:
            table = pq.read_table(pa.BufferReader(data))
        except pa.ArrowException as exc:
            raise ArchiveError(f"{self.store.url(path)} is not a readable Parquet file: {exc}") from None
        return conform_table(table)

    def describe_batch(self, key: str, run_id: str, commit: BatchCommit | None = None) -> BatchInfo:
        """The summary of a stored batch, for announcing it: verified against its commit record's digest (read
        unless given), so a file changed since its commit is refused (``ChecksumError``), as a learner would."""
        commit = commit or self._commit_of(run_id, key)
        data = self._committed_bytes(run_id, commit)
        table = self._batch_table(key, data)
        return summarize_batch(
            table, run_id=run_id, batch_id=commit.batch_id, path=key, sha256=commit.sha256, size_bytes=len(data),
            created_at=min(table.column("created_at").to_pylist()),
        )

    def list_batches(self, run_id: str) -> list[str]:
        """Keys of every batch of ``run_id``, oldest date first (by name within a date: see ``commits``)."""
        keys = self.store.list(trajectories_prefix(run_id), recursive=True)
        return [key for key in keys if key.endswith(".parquet")]

    # -- many batches ------------------------------------------------------------------------

    def dataset(
        self, run_id: str | None = None, date_from: date | str | None = None, date_to: date | str | None = None
    ) -> ds.Dataset:
        """A pyarrow dataset over the batches of one run (or all runs) within the dates (inclusive)."""
        keys = self._batch_keys(run_id, _as_date(date_from), _as_date(date_to))
        return ds.dataset(
            [self.store.path(key) for key in keys],
            filesystem=self.store.filesystem,
            format="parquet",
            partitioning=_HIVE_DATE,
            partition_base_dir=self.store.path("runs"),
            schema=SCAN_SCHEMA,  # older minor versions lacking optional columns read as nulls
        )

    def scan(
        self,
        run_id: str | None = None,
        env: str | None = None,
        date_from: date | str | None = None,
        date_to: date | str | None = None,
        policy_version_min: int | None = None,
        policy_version_max: int | None = None,
    ) -> pl.LazyFrame:
        """Rows across many batches as a polars LazyFrame (``.collect()`` it), with a ``date`` column.

        Run and date filters skip folders without opening files; every filter is also
        pushed into the pyarrow scan.  Bounds are inclusive.
        """
        dataset = self.dataset(run_id, date_from, date_to)
        condition = _scan_filter(
            run_id, env, _as_date(date_from), _as_date(date_to), policy_version_min, policy_version_max
        )
        if not dataset.files:
            return pl.from_arrow(SCAN_SCHEMA.empty_table()).lazy()  # type: ignore[union-attr]
        return pl.scan_pyarrow_dataset(dataset.filter(condition) if condition is not None else dataset)

    def _batch_keys(self, run_id: str | None, date_from: date | None, date_to: date | None) -> list[str]:
        runs = [validate_name(run_id, "run_id")] if run_id else [k.rsplit("/", 1)[-1] for k in self.store.list("runs")]
        keys: list[str] = []
        for run in runs:
            for folder in self.store.list(f"runs/{run}/trajectories"):
                day = partition_date(folder)
                if day is None or (date_from and day < date_from) or (date_to and day > date_to):
                    continue
                keys += [key for key in self.store.list(folder) if key.endswith(".parquet")]
        return keys

    # -- steps tables (RLDS-like) ------------------------------------------------------------

    def write_steps(self, key: str, table: pa.Table) -> str:
        """Write a steps table create-only at ``key`` (e.g. ``datasets/<name>/part-0000.parquet``); return sha256."""
        check_steps_table(table)
        return self.store.put_create_once(validate_key(key), parquet_bytes(table))

    def read_steps(self, key: str, sha256: str | None = None) -> pa.Table:
        """One steps table, digest-verified when ``sha256`` is given, schema-checked."""
        return _steps_table(self.store.get(key, sha256), self.store.url(key))

    def list_steps(self, run_id: str) -> list[str]:
        """Keys of every steps batch of ``run_id`` (a numeric actor's), oldest date first."""
        return [key for key in self.store.list(steps_prefix(run_id), recursive=True) if key.endswith(".parquet")]

    def describe_steps(self, key: str) -> tuple[str, dict[str, Any] | None]:
        """A stored steps batch's sha256 (from its bytes) and the event fields its actor wrote into it
        (``BATCH_SUMMARY_KEY``; None for a file without them)."""
        data = self.store.get(key)
        summary = (_steps_table(data, self.store.url(key)).schema.metadata or {}).get(BATCH_SUMMARY_KEY)
        return sha256_hex(data), None if summary is None else dict(json.loads(summary))

    def scan_steps(self, prefix: str) -> pl.LazyFrame:
        """Every steps Parquet file under ``prefix`` as one LazyFrame (schema of the first file)."""
        keys = [key for key in self.store.list(prefix, recursive=True) if key.endswith(".parquet")]
        if not keys:
            raise ArchiveError(f"no steps Parquet files under {self.store.url(prefix)}")
        dataset = ds.dataset([self.store.path(k) for k in keys], filesystem=self.store.filesystem, format="parquet")
        return pl.scan_pyarrow_dataset(dataset)


# -- pure helpers ----------------------------------------------------------------------------


def _steps_table(data: bytes, where: str) -> pa.Table:
    """The steps table in ``data`` (the file at ``where``), refused in one line naming it unless readable."""
    try:
        table = _restore_timestamp_units(pq.read_table(pa.BufferReader(data)))
    except pa.ArrowException as exc:
        raise ArchiveError(f"{where} is not a readable Parquet file: {str(exc).splitlines()[0]}") from None
    check_steps_table(table)
    return table


def parquet_bytes(table: pa.Table) -> bytes:
    """Serialise ``table`` to Parquet in memory; its schema metadata (schema_version) goes into the file."""
    sink = io.BytesIO()
    pq.write_table(table, sink, compression=PARQUET_COMPRESSION)
    return sink.getvalue()


def _with_commit_time(table: pa.Table, committed_at: datetime) -> pa.Table:
    """``table`` with its commit time in the schema metadata (so in the Parquet file's)."""
    metadata = {**(table.schema.metadata or {}), COMMITTED_AT_KEY: committed_at.isoformat().encode()}
    return table.replace_schema_metadata(metadata)


def summarize_batch(table: pa.Table, **identity: Any) -> BatchInfo:
    """Counts, policy-version range and reward summary of a (conformed, non-empty) trajectory table."""
    versions = pc.min_max(table["policy_version"]).as_py()
    rewards = pc.min_max(table["reward"]).as_py()
    return BatchInfo(
        num_rows=table.num_rows,
        num_tokens=int(pc.sum(pc.list_value_length(table["tokens"])).as_py() or 0),
        num_generated_tokens=int(pc.sum(pc.list_flatten(table["loss_mask"])).as_py() or 0),
        num_groups=int(pc.count_distinct(table["group_id"]).as_py()),
        envs=_distinct(table, "env"),
        producer_ids=_distinct(table, "producer_id"),
        policy_version_min=versions["min"],
        policy_version_max=versions["max"],
        reward_mean=float(pc.mean(table["reward"]).as_py()),
        reward_min=float(rewards["min"]),
        reward_max=float(rewards["max"]),
        success_rate=float(pc.mean(pc.cast(table["success"], pa.float64())).as_py()),
        **identity,
    )


def _restore_timestamp_units(table: pa.Table) -> pa.Table:
    """Parquet cannot store second-resolution timestamps (it writes milliseconds); cast the steps
    table's own timestamp column back to its declared unit (a safe cast: it refuses to truncate)."""
    for field in STEPS_BASE_FIELDS:
        if field.name in table.schema.names and pa.types.is_timestamp(field.type):
            index = table.schema.get_field_index(field.name)
            if table.schema.field(index).type != field.type:
                table = table.set_column(index, field, table.column(index).cast(field.type))
    return table


def _as_trajectory_table(table_or_records: Any) -> pa.Table:
    if isinstance(table_or_records, pa.Table):
        return conform_table(table_or_records)
    return records_to_table(table_or_records)


def _distinct(table: pa.Table, column: str) -> list[str]:
    return sorted(pc.unique(table[column]).to_pylist())


def _only(values: list[str], what: str) -> str:
    if len(values) != 1:
        raise ArchiveError(f"the batch has {len(values)} distinct {what} values ({', '.join(values[:5])}); pass {what}")
    return values[0]


def _require_only(table: pa.Table, column: str, expected: str) -> None:
    others = [value for value in _distinct(table, column) if value != expected]
    if others:
        raise ArchiveError(f"rows carry {column} {others[:3]} but the batch is written as {expected!r}; fix the rows")


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _as_date(value: date | str | None) -> date | None:
    if value is None or (isinstance(value, date) and not isinstance(value, datetime)):
        return value
    if isinstance(value, datetime):
        return _utc(value).date()
    try:
        return date.fromisoformat(value)
    except ValueError:
        raise ArchiveError(f"date {value!r} is not of the form YYYY-MM-DD") from None


def _scan_filter(
    run_id: str | None,
    env: str | None,
    date_from: date | None,
    date_to: date | None,
    version_min: int | None,
    version_max: int | None,
) -> ds.Expression | None:
    parts = []
    if run_id is not None:
        parts.append(ds.field("run_id") == run_id)
    if env is not None:
        parts.append(ds.field("env") == env)
    if date_from is not None:
        parts.append(ds.field("date") >= date_from)
    if date_to is not None:
        parts.append(ds.field("date") <= date_to)
    if version_min is not None:
        parts.append(ds.field("policy_version") >= version_min)
    if version_max is not None:
        parts.append(ds.field("policy_version") <= version_max)
    if not parts:
        return None
    condition = parts[0]
    for part in parts[1:]:
        condition = condition & part
    return condition
