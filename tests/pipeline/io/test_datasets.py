"""Datasets in the store: the card as commit point, pruned scans."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.io.datasets import (
    CARD_SCHEMA_VERSION,
    DatasetError,
    DatasetField,
    DatasetWriter,
    card_from_bytes,
    card_key,
    dataset_names,
    device_columns,
    read_card,
    read_steps,
    scan_steps,
    select_files,
    verify_dataset,
)
from pipeline.io.steps_arrays import steps_table_from_arrays
from pipeline.io.store import ObjectStore

US = 1_000_000
T0 = int(dt.datetime(2023, 3, 1, 22, 0, tzinfo=dt.UTC).timestamp()) * US  # 22:00 UTC


@pytest.fixture
def store(tmp_path):
    return ObjectStore(tmp_path.as_uri())


# ---- writing and reading ----------------------------------------------------------------------


def _day_table(day_index: int, rows: int = 12, zones: int = 2):
    """One episode of ``rows`` 5-minute steps starting at 08:00 UTC of 2023-01-(1 + day_index)."""
    start = int(dt.datetime(2023, 1, 1 + day_index, 8, tzinfo=dt.UTC).timestamp()) * US
    times = start + np.arange(rows) * 300 * US
    features = {f"zone_{z}@temp": 290.0 + z + np.arange(rows) * 0.1 + day_index for z in range(zones)}
    features["action:boiler@sp"] = np.full(rows, 330.0)
    features["reward:r"] = -np.arange(rows) / 100.0
    names = list(features)
    table = steps_table_from_arrays([f"ep{day_index}"], np.array([0]), times, features, names[:zones],
                                    ["action:boiler@sp"], features["reward:r"])
    fields = [DatasetField(name=n, role="observation" if n.startswith("zone") else n.split(":")[0],
                           source_id=n.split(":")[-1], unit="K") for n in names]
    return table, fields


def _write(store, name="demo", days=3, commit=True):
    writer = DatasetWriter(store, name).open()
    fields = None
    for d in range(days):
        table, fields = _day_table(d)
        writer.write_partition(dt.date(2023, 1, 1 + d), table)
    if not commit:
        return writer
    return writer.commit(source="test", fields=fields, observation_columns=["zone_0@temp", "zone_1@temp"],
                         action_columns=["action:boiler@sp"], reward_column="reward:r", step_seconds=300.0)


def test_the_card_names_every_file_with_counts_span_and_checksums(store):
    card = _write(store)
    assert dataset_names(store) == ["demo"]
    again = read_card(store, "demo")
    assert again == card
    assert card.num_rows == 36 and card.num_episodes == 3
    assert [f.path for f in card.files] == [f"steps/date=2023-01-0{d}/part-00000.parquet" for d in (1, 2, 3)]
    assert card.time_start == dt.datetime(2023, 1, 1, 8, tzinfo=dt.UTC)
    assert card.time_end == dt.datetime(2023, 1, 3, 8, 55, tzinfo=dt.UTC)
    assert card.units()["zone_0@temp"] == "K"
    assert verify_dataset(store, card) == []
    # the checksum in the card is the file's
    import hashlib

    raw = store.get(f"datasets/demo/{card.files[0].path}")
    assert hashlib.sha256(raw).hexdigest() == card.files[0].sha256
    assert pq.read_table(store.open_input(f"datasets/demo/{card.files[0].path}")).num_rows == 12


def test_a_dataset_is_create_only_and_a_crashed_import_is_cleared(store):
    _write(store)
    with pytest.raises(FileExistsError, match="already exists"):
        DatasetWriter(store, "demo").open()
    _write(store, "half", commit=False)  # crashed before its card
    assert "half" not in dataset_names(store)
    assert store.list("datasets/half", recursive=True)
    with pytest.raises(FileNotFoundError, match="no dataset 'half'"):
        read_card(store, "half")
    DatasetWriter(store, "half").open()  # a new import of that name removes the leftovers
    assert store.list("datasets/half", recursive=True) == []


class RetriedCreateStore(ObjectStore):
    """A gs:// create whose answer was lost: the client retries it, and the retry reports ``FileExistsError`` for
    the object the first attempt wrote."""

    def put_create(self, key: str, data: bytes) -> str:
        super().put_create(key, data)
        raise FileExistsError(f"{self.url(key)} already exists")


def test_a_retried_create_of_the_card_that_landed_commits_the_dataset(tmp_path):
    store = RetriedCreateStore(tmp_path.as_uri())
    card = _write(store)
    assert read_card(store, "demo") == card and dataset_names(store) == ["demo"]


def test_verify_finds_a_tampered_file(store):
    card = _write(store)
    key = f"datasets/demo/{card.files[1].path}"
    table, _ = _day_table(7)
    import io

    sink = io.BytesIO()
    pq.write_table(table, sink)
    store.put(key, sink.getvalue())
    problems = verify_dataset(store, card)
    assert len(problems) == 1 and card.files[1].path in problems[0] and "checksum" in problems[0]


def test_a_newer_card_major_is_refused(store):
    _write(store)
    data = store.get(card_key("demo")).replace(
        f'"schema_version": "{CARD_SCHEMA_VERSION}"'.encode(), b'"schema_version": "9.0"')
    with pytest.raises(ValueError, match="upgrade rlpipe"):
        card_from_bytes(data)


def test_scans_prune_by_time_and_project_devices(store):
    card = _write(store, days=5)
    start, end = dt.datetime(2023, 1, 2, 8, 30, tzinfo=dt.UTC), dt.datetime(2023, 1, 3, 8, 20, tzinfo=dt.UTC)
    # only the files of Jan 2 and Jan 3 can match: the others are never opened
    assert [f.date for f in select_files(card, start, end)] == [dt.date(2023, 1, 2), dt.date(2023, 1, 3)]
    assert select_files(card, dt.datetime(2024, 1, 1, tzinfo=dt.UTC)) == []
    table = read_steps(store, "demo", start, end, devices=["zone_1"])
    assert "zone_1@temp" in table.column_names and "zone_0@temp" not in table.column_names
    times = table["timestamp"].to_pylist()
    # Jan 2: 08:30..08:55 (6 rows); Jan 3: 08:00..08:15 (4 rows; 08:20 is excluded)
    assert len(times) == 10 and min(times) == start and max(times) == dt.datetime(2023, 1, 3, 8, 15, tzinfo=dt.UTC)
    assert device_columns(card, ["boiler"]) == ["action:boiler@sp"]
    lazy = scan_steps(store, "demo", start, end, columns=["timestamp", "zone_0@temp"]).collect()
    assert lazy.height == 10 and lazy.columns == ["timestamp", "zone_0@temp"]
    empty = read_steps(store, "demo", dt.datetime(2024, 1, 1, tzinfo=dt.UTC), columns=["step"])
    assert empty.num_rows == 0 and empty.column_names == ["step"]
    with pytest.raises(DatasetError, match="no columns"):
        read_steps(store, "demo", columns=["nope"])


def test_write_commit_and_scan_on_every_store_backend(any_store):
    card = _write(any_store, days=2)
    assert dataset_names(any_store) == ["demo"] and verify_dataset(any_store, card) == []
    start = dt.datetime(2023, 1, 2, 8, 10, tzinfo=dt.UTC)
    table = read_steps(any_store, "demo", start, columns=["timestamp", "zone_1@temp"])
    assert table.num_rows == 10 and table["timestamp"].to_pylist()[0] == start  # 08:10 .. 08:55 on Jan 2
    assert scan_steps(any_store, "demo", start).collect().height == 10


def test_a_dataset_name_differing_only_in_case_is_neither_read_nor_written_as_the_other(tmp_path):
    """On a case-insensitive filesystem (macOS, Windows) ``datasets/demo`` is ``datasets/Demo``'s folder: a read of
    ``demo`` would get Demo's card and files, and an import of ``demo`` would clear or mix with Demo's."""
    from tests.pipeline.test_runtime import CaseInsensitiveStore

    local = CaseInsensitiveStore(f"file://{tmp_path}/store")
    _write(local, "Demo")
    _write(local, "Half", commit=False)  # an import under way (or crashed): its files have no card yet
    before = sorted(local.list("datasets", recursive=True))
    with pytest.raises(FileNotFoundError, match=r"no dataset 'demo'.*'Demo'"):
        read_card(local, "demo")
    for name, twin in (("demo", "Demo"), ("half", "Half")):
        with pytest.raises(FileExistsError, match=rf"'{name}'.*'{twin}'.*another --name"):
            DatasetWriter(local, name).open()
    assert sorted(local.list("datasets", recursive=True)) == before  # nothing of the others' cleared
    assert read_card(local, "Demo").name == "Demo"
