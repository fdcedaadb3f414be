"""Where the trajectory archive keeps things: the object keys of batches, commit records and
conversions, and the ids batches are named by (``pipeline.io.archive`` reads and writes them)."""

from __future__ import annotations

import uuid
from datetime import date, datetime

from pipeline.io.store import ObjectStore
from schemas.names import MAX_NAME_LENGTH, validate_name

COMMIT_RECORD_SUFFIX = ".commit.json"


def trajectories_prefix(run_id: str) -> str:
    """Folder key of a run's trajectory batches."""
    return f"runs/{validate_name(run_id, 'run_id')}/trajectories"


def steps_prefix(run_id: str) -> str:
    """Folder key of a run's steps batches (numeric actors): ``runs/<run>/env-steps``."""
    return f"runs/{validate_name(run_id, 'run_id')}/env-steps"


def batch_key(run_id: str, day: date, batch_id: str) -> str:
    """Object key of one batch: ``runs/<run_id>/trajectories/date=YYYY-MM-DD/<batch_id>.parquet``."""
    return f"{trajectories_prefix(run_id)}/date={day.isoformat()}/{validate_name(batch_id, 'batch_id')}.parquet"


def conversion_keys(run_id: str, dataset: str) -> tuple[str, str]:
    """The marker a dataset conversion into ``run_id`` writes first and the summary it writes last."""
    folder = f"runs/{validate_name(run_id, 'run_id')}/offline/{validate_name(dataset, 'dataset')}"
    return f"{folder}.converting", f"{folder}.json"


def unfinished_conversions(store: ObjectStore, run_id: str) -> list[str]:
    """The datasets whose conversion into ``run_id`` started and never wrote its summary (cut short)."""
    keys = set(store.list(f"runs/{validate_name(run_id, 'run_id')}/offline"))
    started = [key.rsplit("/", 1)[-1].removesuffix(".converting") for key in keys if key.endswith(".converting")]
    return sorted(name for name in started if conversion_keys(run_id, name)[1] not in keys)


def new_batch_id(prefix: str = "b") -> str:
    """A fresh, unique, path-safe batch id (``<prefix>-<32 hex>``)."""
    return validate_name(f"{prefix}-{uuid.uuid4().hex}", "batch_id")


def producer_batch_id(producer_id: str, now: datetime) -> str:
    """A producer's next batch id, ``<producer>-b<UTC time>-<8 hex>``: readable in listings, unique by its time
    and random part.  A producer id too long to leave room for them is cut short (its batches' rows name it
    in full)."""
    suffix = f"-b{now:%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"
    return validate_name(producer_id[: MAX_NAME_LENGTH - len(suffix)] + suffix, "batch_id")


def commit_record_key(batch_key: str) -> str:
    """``.../<batch_id>.commit.json`` beside ``.../<batch_id>.parquet``."""
    return batch_key.removesuffix(".parquet") + COMMIT_RECORD_SUFFIX


def damaged_run_fix(run_id: str) -> str:
    """What to do about a damaged batch of ``run_id`` (the end of each refusal's one line)."""
    return (f"restore it from where the run came from, or delete the run (rlpipe runs delete --run {run_id} "
            "--yes) and convert or sample it again")


def key_date(key: str) -> date | None:
    """The ``date=`` folder of a batch's key (``runs/<run>/trajectories/date=2026-03-10/<id>.parquet``), if any."""
    return partition_date(key.rsplit("/", 1)[0])


def partition_date(folder_key: str) -> date | None:
    name = folder_key.rsplit("/", 1)[-1]
    if not name.startswith("date="):
        return None
    try:
        return date.fromisoformat(name.removeprefix("date="))
    except ValueError:
        return None
