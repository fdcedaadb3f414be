"""The Smart Buildings importer: its folder layout, JSON or (trusted) pickled metadata, refused partitions."""

from __future__ import annotations

import datetime as dt
import io
import os
import pickle
import sys
import types

import numpy as np
import pytest
from typer.testing import CliRunner

from pipeline.io.datasets import dataset_names, iter_partitions
from pipeline.io.store import ObjectStore
from producers.offline.cli import app
from producers.offline.episodes import DatasetImportError
from producers.offline.generation import write_sbd_partition
from producers.offline.smart_buildings import (
    PickleRefusedError,
    import_smart_buildings,
    load_trusted_pickle,
)

runner = CliRunner(env={"COLUMNS": "200"})


@pytest.fixture
def store(tmp_path):
    return ObjectStore((tmp_path / "store").as_uri())


def _nothing_written(store) -> bool:
    return store.list("", recursive=True) == []


def _sbd_partition(rows_a: int = 72, rows_b: int = 4):
    """A small partition in the real layout: 22:00 UTC on 2023-03-01 onwards, 5-minute rows, a 1 h gap."""
    t0 = dt.datetime(2023, 3, 1, 22, 0, tzinfo=dt.UTC)
    times = [t0 + dt.timedelta(minutes=5 * k) for k in range(rows_a)]
    times += [times[-1] + dt.timedelta(hours=1, minutes=5 * (k + 1)) for k in range(rows_b)]
    n = len(times)
    k = np.arange(n, dtype=np.float32)
    matrices = {
        "observation_value_matrix": np.stack([290 + 0.01 * k, 280 - 0.02 * k], axis=1).astype(np.float32),
        "action_value_matrix": (330 + 0.1 * k)[:, None].astype(np.float32),
        "reward_value_matrix": np.stack([-0.001 * k * (j + 1) for j in range(17)], axis=1).astype(np.float32),
        "reward_info_value_matrix": np.stack([294 + 0 * k, 50 * k], axis=1).astype(np.float32),
    }
    metadata = {
        "observation_ids": {"1001@zone_air_temperature_sensor": 0, "1002@outside_air_temperature_sensor": 1},
        "action_ids": {"2001@supply_water_temperature_setpoint": 0},
        "reward_ids": {"rooms/1@heating_setpoint_temperature": 0, "2001@pump_electrical_energy_rate": 1},
        "device_infos": [], "zone_infos": [],
        "units": {"1001@zone_air_temperature_sensor": "K", "1002@outside_air_temperature_sensor": "K",
                  "2001@supply_water_temperature_setpoint": "K", "agent_reward_value": "1",
                  "2001@pump_electrical_energy_rate": "W"},
    }  # fmt: skip
    for key in ("observation_timestamps", "action_timestamps", "reward_timestamps", "reward_info_timestamps"):
        metadata[key] = list(times)
    return matrices, metadata


def _write_json_partition(folder, matrices, metadata):
    as_json = {k: ([t.isoformat() for t in v] if k.endswith("_timestamps") else v) for k, v in metadata.items()}
    return write_sbd_partition(folder, matrices, as_json)


def test_import_smart_buildings_layout_with_json_metadata(tmp_path, store):
    matrices, metadata = _sbd_partition()
    folder = _write_json_partition(tmp_path / "sb1" / "2023_a", matrices, metadata)
    card = import_smart_buildings(store, tmp_path / "sb1", "sb-march")
    # shapes: 76 rows; 2 observation + 1 action + 17 reward + 2 reward-info columns
    assert card.num_rows == 76 and len(card.fields) == 22
    assert card.observation_columns == ["1001@zone_air_temperature_sensor", "1002@outside_air_temperature_sensor"]
    assert card.action_columns == ["action:2001@supply_water_temperature_setpoint"]
    assert card.reward_column == "reward:agent_reward_value"
    assert card.units()["1002@outside_air_temperature_sensor"] == "K"
    assert card.units()["reward_info:2001@pump_electrical_energy_rate"] == "W"
    assert card.units()["reward:carbon_emitted"] is None  # not stated by the source
    assert set(card.source_files) == {"2023_a/data.npy.npz", "2023_a/metadata.json"}
    assert card.time_start == metadata["observation_timestamps"][0]
    assert card.time_end == metadata["observation_timestamps"][-1]
    # episodes: UTC midnight (24 steps after 22:00) and the gap split the log
    assert card.num_episodes == 3
    assert [f.path for f in card.files] == ["steps/date=2023-03-01/part-00000.parquet",
                                            "steps/date=2023-03-02/part-00000.parquet"]
    tables = [table for _, table in iter_partitions(store, card)]
    assert [t.num_rows for t in tables] == [24, 52]
    import pyarrow as pa

    table = pa.concat_tables(tables)
    assert table["timestamp"].to_pylist() == metadata["observation_timestamps"]
    firsts = [i for i, first in enumerate(table["is_first"].to_pylist()) if first]
    assert firsts == [0, 24, 72]
    assert table["step"].to_pylist()[72:] == [0, 1, 2, 3]
    assert table["is_last"].to_pylist()[23] and table["is_last"].to_pylist()[71] and table["is_last"].to_pylist()[-1]
    # values arrive unchanged, column by column
    for column, name in enumerate(metadata["observation_ids"]):
        assert table[name].to_numpy().tolist() == matrices["observation_value_matrix"][:, column].astype(float).tolist()
    assert table["reward"].to_numpy().tolist() == matrices["reward_value_matrix"][:, 0].tolist()
    assert table["reward:normalized_carbon_emission"].to_numpy().tolist() == \
        matrices["reward_value_matrix"][:, 16].astype(float).tolist()
    assert table["observation"].to_pylist()[5] == matrices["observation_value_matrix"][5].tolist()
    assert table["action"].to_pylist()[5] == matrices["action_value_matrix"][5].tolist()
    assert folder.exists()


def _pandas_like_pickle(metadata, monkeypatch) -> bytes:
    """Pickle ``metadata`` as upstream does (timestamps as pandas Timestamps), without pandas installed."""

    def _unpickle_timestamp(value, freq, tz, reso=10):  # pickled by reference only
        raise AssertionError("never called")

    names = ["pandas", "pandas._libs", "pandas._libs.tslibs", "pandas._libs.tslibs.timestamps"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    _unpickle_timestamp.__module__ = names[-1]
    _unpickle_timestamp.__qualname__ = "_unpickle_timestamp"
    sys.modules[names[-1]]._unpickle_timestamp = _unpickle_timestamp

    class UpstreamPickler(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, dt.datetime):
                ns = (obj - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)) // dt.timedelta(microseconds=1) * 1000
                return _unpickle_timestamp, (ns, None, dt.UTC, 10)
            return NotImplemented

    sink = io.BytesIO()
    UpstreamPickler(sink, protocol=4).dump(metadata)
    for name in names:
        monkeypatch.delitem(sys.modules, name)
    return sink.getvalue()


def test_pickle_metadata_is_refused_without_the_flag_and_nothing_is_written(tmp_path, store, monkeypatch):
    matrices, metadata = _sbd_partition()
    folder = tmp_path / "part"
    write_sbd_partition(folder, matrices, {})
    (folder / "metadata.json").unlink()
    (folder / "metadata.pickle").write_bytes(_pandas_like_pickle(metadata, monkeypatch))
    assert "pandas" not in sys.modules  # the stand-in never needs pandas
    with pytest.raises(PickleRefusedError, match="--trust-pickle"):
        import_smart_buildings(store, folder, "sb-pickle")
    assert _nothing_written(store)
    result = runner.invoke(app, ["import", "smart-buildings", str(folder), "--name", "sb-pickle",
                                 "--root", store.root])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "pickle" in lines[0] and "--trust-pickle" in lines[0] and "Traceback" not in lines[0]
    assert _nothing_written(store)
    # trusted: the same dataset as from the JSON metadata
    trusted = import_smart_buildings(store, folder, "sb-pickle", trust_pickle=True)
    json_folder = _write_json_partition(tmp_path / "json", matrices, metadata)
    plain = import_smart_buildings(store, json_folder, "sb-json")
    assert trusted.num_rows == plain.num_rows and trusted.fields == plain.fields
    assert [f.sha256 for f in trusted.files] == [f.sha256 for f in plain.files]


def test_the_trusted_unpickler_still_refuses_code(tmp_path, store):
    class Exploit:
        def __reduce__(self):
            return (os.system, ("echo owned",))

    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        load_trusted_pickle(pickle.dumps({"observation_ids": Exploit()}))
    matrices, _ = _sbd_partition()
    folder = tmp_path / "evil"
    write_sbd_partition(folder, matrices, {})
    (folder / "metadata.json").unlink()
    (folder / "metadata.pickle").write_bytes(pickle.dumps({"observation_ids": Exploit()}))
    with pytest.raises(DatasetImportError, match="convert the metadata to JSON"):
        import_smart_buildings(store, folder, "evil", trust_pickle=True)
    assert _nothing_written(store)


def test_malformed_partitions_are_refused_before_writing(tmp_path, store):
    matrices, metadata = _sbd_partition()
    matrices["action_value_matrix"] = np.zeros((76, 2), dtype=np.float32)  # metadata names 1 action column
    _write_json_partition(tmp_path / "bad", matrices, metadata)
    with pytest.raises(DatasetImportError, match="action_value_matrix has shape"):
        import_smart_buildings(store, tmp_path / "bad", "bad")
    assert "bad" not in dataset_names(store)


@pytest.mark.parametrize(("action", "said"), [
    (np.array([[object()]] * 76, dtype=object), "cannot be read without pickle"),
    (np.array([["warm"]] * 76), "must be a 2-D numeric matrix"),
])
def test_an_action_matrix_of_objects_or_text_is_one_line_naming_the_file(tmp_path, store, action, said):
    matrices, metadata = _sbd_partition()
    matrices["action_value_matrix"] = action
    _write_json_partition(tmp_path / "sb1" / "2023_a", matrices, metadata)
    result = runner.invoke(app, ["import", "smart-buildings", str(tmp_path / "sb1"), "--name", "odd",
                                 "--root", store.root])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1
    assert said in result.output and "2023_a" in result.output and "data.npy.npz" in result.output, result.output
    assert _nothing_written(store)


def test_partitions_that_overlap_in_time_are_refused_naming_both_and_nothing_is_written(tmp_path, store):
    matrices, metadata = _sbd_partition()
    _write_json_partition(tmp_path / "sb1" / "2023_a", matrices, metadata)
    _write_json_partition(tmp_path / "sb1" / "2023_a_copy", matrices, metadata)  # the same partition twice
    result = runner.invoke(app, ["import", "smart-buildings", str(tmp_path / "sb1"), "--name", "twice",
                                 "--root", store.root])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert "2023_a" in result.output and "2023_a_copy" in result.output and "76 timestamps" in result.output
    assert _nothing_written(store)
    # one partition that logs a time twice is refused the same way
    metadata["observation_timestamps"][5] = metadata["observation_timestamps"][4]
    _write_json_partition(tmp_path / "dup", matrices, metadata)
    with pytest.raises(DatasetImportError, match=r"metadata.json logs 1 timestamp twice"):
        import_smart_buildings(store, tmp_path / "dup", "dup")
    assert _nothing_written(store)


def test_a_path_that_does_not_exist_is_bad_input_naming_it(tmp_path, store):
    missing = tmp_path / "sb1" / "2022_a"
    result = runner.invoke(app, ["import", "smart-buildings", str(missing), "--name", "sb", "--root", store.root])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and str(missing) in lines[0] and "point at a partition folder" in lines[0], lines
    assert _nothing_written(store)


@pytest.mark.parametrize(("matrix", "column", "said"), [
    ("action_value_matrix", 0, "action:2001@supply_water_temperature_setpoint"),
    ("reward_value_matrix", 0, "reward:agent_reward_value"),
])
def test_a_missing_action_or_reward_is_refused_naming_column_and_time_and_nothing_is_written(
    tmp_path, store, matrix, column, said
):
    # a NaN setpoint would become the grid's lowest cell in offline CQL, a NaN reward every return it touches
    matrices, metadata = _sbd_partition()
    matrices[matrix][30, column] = np.nan
    _write_json_partition(tmp_path / "sb1" / "2023_a", matrices, metadata)
    result = runner.invoke(app, ["import", "smart-buildings", str(tmp_path / "sb1"), "--name", "gappy",
                                 "--root", store.root])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1
    assert said in result.output and "2023_a" in result.output and "2023-03-02 00:30" in result.output
    assert _nothing_written(store)
    # a NaN in a reward column that is not the reward, or in an observation, is kept (a sensor may drop out)
    matrices[matrix][30, column] = 0.0
    matrices["reward_value_matrix"][30, 5] = np.nan
    matrices["observation_value_matrix"][30, 0] = np.nan
    _write_json_partition(tmp_path / "sb2" / "2023_a", matrices, metadata)
    assert import_smart_buildings(store, tmp_path / "sb2", "kept").num_rows == 76


def test_rows_out_of_time_order_are_imported_in_time_order_each_with_its_own_values(tmp_path, store):
    matrices, metadata = _sbd_partition()
    _write_json_partition(tmp_path / "sorted", matrices, metadata)
    order = np.random.default_rng(0).permutation(76)  # the same rows, shuffled together with their times
    shuffled = {name: values[order] for name, values in matrices.items()}
    shuffled_meta = {k: ([v[i] for i in order] if k.endswith("_timestamps") else v) for k, v in metadata.items()}
    _write_json_partition(tmp_path / "shuffled", shuffled, shuffled_meta)
    expected = import_smart_buildings(store, tmp_path / "sorted", "sorted")
    card = import_smart_buildings(store, tmp_path / "shuffled", "shuffled")
    assert card.num_episodes == expected.num_episodes == 3
    assert card.extras["timestamps_aligned"]
    import pyarrow as pa

    got = pa.concat_tables([t for _, t in iter_partitions(store, card)])
    want = pa.concat_tables([t for _, t in iter_partitions(store, expected)])
    assert got.equals(want)


def test_rewards_stamped_a_step_before_the_observations_are_paired_by_time_not_by_row(tmp_path, store):
    # as upstream's partitions: reward (and reward info) row j is stamped 5 minutes before observation row j,
    # so the reward of the step that starts at observation t is the reward row stamped t (row j + 1), not row j
    matrices, metadata = _sbd_partition()
    five = dt.timedelta(minutes=5)
    for key in ("reward_timestamps", "reward_info_timestamps"):
        metadata[key] = [t - five for t in metadata["observation_timestamps"]]
    _write_json_partition(tmp_path / "shifted", matrices, metadata)
    card = import_smart_buildings(store, tmp_path / "shifted", "shifted")
    import pyarrow as pa

    table = pa.concat_tables([t for _, t in iter_partitions(store, card)])
    reward_row = {t: j for j, t in enumerate(metadata["reward_timestamps"])}
    paired = [k for k, t in enumerate(metadata["observation_timestamps"]) if t in reward_row]
    # the row before the 1 h gap and the last row have no reward stamped at their time: no step starts there
    assert paired == [*range(71), 72, 73, 74] and card.num_rows == 74
    assert table["timestamp"].to_pylist() == [metadata["observation_timestamps"][k] for k in paired]
    rewards = matrices["reward_value_matrix"][:, 0]
    assert table["reward"].to_numpy().tolist() == [rewards[k + 1] for k in paired]
    assert table["reward_info:2001@pump_electrical_energy_rate"].to_numpy().tolist() == \
        [float(matrices["reward_info_value_matrix"][k + 1, 1]) for k in paired]
    actions = matrices["action_value_matrix"][:, 0]  # stamped with the observations: row by row
    assert table["action"].to_pylist() == [[actions[k]] for k in paired]
    assert not card.extras["timestamps_aligned"]
