"""The table importer: CSV or Parquet columns mapped onto a steps dataset."""

from __future__ import annotations

import datetime as dt
import math

import pytest
from typer.testing import CliRunner

from pipeline.io.datasets import dataset_names, iter_partitions, read_card
from pipeline.io.store import ObjectStore
from producers.offline.cli import app
from producers.offline.table import TableMapping, import_table

runner = CliRunner(env={"COLUMNS": "200"})


@pytest.fixture
def store(tmp_path):
    return ObjectStore((tmp_path / "store").as_uri())


def refused(tmp_path, store, rows: str, mapping: str) -> str:
    """The one-line error of importing the CSV ``rows`` with ``mapping`` (YAML), which must store nothing."""
    csv, mapping_file = tmp_path / "log.csv", tmp_path / "map.yaml"
    csv.write_text(rows)
    mapping_file.write_text(mapping)
    result = runner.invoke(app, ["import", "table", str(csv), "--mapping", str(mapping_file), "--name", "p",
                                 "--root", store.root])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert len(result.stderr.strip().splitlines()) == 1
    assert dataset_names(store) == []
    return result.stderr


def test_import_table_with_a_column_mapping(tmp_path, store):
    csv = tmp_path / "plant.csv"
    csv.write_text(
        "building,time,temp,setpoint,r,done,humidity,note\n"
        "b2,2023-05-02T10:00:00Z,21.0,0.5,-1.0,false,40,x\n"
        "b1,2023-05-01T10:05:00Z,20.5,0.4,-0.5,true,41,y\n"
        "b1,2023-05-01T10:00:00Z,20.0,0.3,-0.2,false,42,z\n"
        "b2,2023-05-02T10:05:00Z,21.5,0.6,-2.0,false,43,w\n"
    )
    mapping = TableMapping(episode_id="building", timestamp="time", observation=["temp"], action=["setpoint"],
                           reward="r", terminal="done", units={"temp": "degC", "humidity": "%"})
    card = import_table(store, csv, "plant", mapping)
    assert card.num_rows == 4 and card.num_episodes == 2
    roles = {f.name: f.role for f in card.fields}
    assert roles == {"temp": "observation", "setpoint": "action", "r": "reward", "humidity": "feature"}
    assert card.units()["temp"] == "degC" and card.units()["setpoint"] is None
    table = read_card(store, "plant") and next(t for _, t in iter_partitions(store, card))
    cols = table.to_pydict()
    assert cols["episode_id"] == ["b1", "b1"]  # b1 starts first; its rows sorted by time
    assert cols["temp"] == [20.0, 20.5] and cols["observation"] == [[20.0], [20.5]]
    assert cols["is_terminal"] == [False, True] and cols["discount"] == [1.0, 0.0]
    assert cols["reward"] == [pytest.approx(-0.2), -0.5]
    assert [f.date for f in card.files] == [dt.date(2023, 5, 1), dt.date(2023, 5, 2)]
    untimed = import_table(store, csv, "untimed", TableMapping(observation=["temp"], reward="r"))
    assert untimed.num_episodes == 1 and untimed.time_start is None and untimed.files[0].date == dt.date(1970, 1, 1)
    bad = tmp_path / "map.yaml"
    bad.write_text("episode_id: building\ntimestamp: time\nreward: missing_column\n")
    result = runner.invoke(app, ["import", "table", str(csv), "--mapping", str(bad), "--name", "p2",
                                 "--root", store.root])
    assert result.exit_code == 2 and "missing_column" in result.output
    assert "p2" not in dataset_names(store)


def test_a_missing_mapping_column_is_named_with_every_column_the_file_has(tmp_path, store):
    csv = tmp_path / "wide.csv"
    columns = ["building", "time", "temp", "setpoint", "r", "done", "humidity", "pressure", "note", "flow"]
    csv.write_text(",".join(columns) + "\n" + "b1,2023-05-01T10:00:00Z,20,0.3,-0.2,false,42,1.0,x,3.5\n")
    bad = tmp_path / "map.yaml"
    bad.write_text("timestamp: time\nreward: missing_column\n")
    result = runner.invoke(app, ["import", "table", str(csv), "--mapping", str(bad), "--name", "wide",
                                 "--root", store.root])
    assert result.exit_code == 2 and "missing_column" in result.output
    assert all(repr(c) in result.output for c in columns), result.output
    assert dataset_names(store) == []


@pytest.mark.parametrize(("no", "yes"), [("no", "YES"), ("False", "true"), ("0", "1"), ("n0", None)])
def test_a_terminal_column_of_text_reads_true_false_yes_no_1_0_in_any_case(tmp_path, store, no, yes):
    """Parquet text columns, and CSV yes/no (which polars leaves as text); anything else is refused."""
    import polars as pl

    log = tmp_path / "log.parquet"
    flags = [no, no.upper(), no.lower(), yes if yes is not None else "maybe"]
    pl.DataFrame({"temp": [20.0, 21.0, 22.0, 23.0], "r": [-1.0, -2.0, -3.0, -4.0], "done": flags}).write_parquet(log)
    mapping = TableMapping(observation=["temp"], reward="r", terminal="done")  # no times: one episode, file order
    if yes is None:
        with pytest.raises(ValueError, match=r"^log.parquet: column 'done': 'n0' \(row 1\) is not a terminal flag; .*yes/no"):
            import_table(store, log, "plant", mapping)
        assert dataset_names(store) == []
        return
    table = next(t for _, t in iter_partitions(store, import_table(store, log, "plant", mapping)))
    assert table.column("is_terminal").to_pylist() == [False, False, False, True]


def test_a_csv_terminal_column_that_is_not_a_flag_is_one_line_naming_it(tmp_path, store):
    mapping = "observation: [temp]\nreward: r\nterminal: done\n"
    said = refused(tmp_path, store, "temp,r,done\n20,-1,no\n21,-2,maybe\n22,-3,yes\n", mapping)
    assert "column 'done': 'maybe' (row 2) is not a terminal flag" in said and "yes/no" in said
    said = refused(tmp_path, store, "temp,r,done\n20,-1,0\n21,-2,2\n", mapping)
    assert "column 'done': 2 (row 2) is not a terminal flag" in said


@pytest.mark.parametrize(("column", "cells", "row"), [("r", ["-1", "", "-3"], 2), ("sp", ["21.0", "21.5", "NaN"], 3),
                                                       ("sp", ["inf", "21", "21"], 1)])
def test_a_missing_or_non_finite_reward_or_action_is_refused_naming_the_column_and_row(
    tmp_path, store, column, cells, row
):
    """A NaN reward or action would train on nothing; an observation may miss values (it stays NaN)."""
    values = {"temp": ["20", "", "22"], "sp": ["21", "21", "21"], "r": ["-1", "-2", "-3"]} | {column: cells}
    rows = "temp,sp,r\n" + "".join(f"{values['temp'][i]},{values['sp'][i]},{values['r'][i]}\n" for i in range(3))
    said = refused(tmp_path, store, rows, "observation: [temp]\naction: [sp]\nreward: r\n")
    assert f"column {column!r}" in said and f"row {row}" in said, said
    gappy = tmp_path / "gappy.csv"
    gappy.write_text("temp,sp,r\n20,21,-1\n,21,-2\n")
    card = import_table(store, gappy, "gappy", TableMapping(observation=["temp"], action=["sp"], reward="r"))
    temps = next(t for _, t in iter_partitions(store, card)).column("temp").to_pylist()
    assert temps[0] == 20.0 and math.isnan(temps[1])


def test_a_terminal_row_ends_its_episode_and_the_next_row_starts_another(tmp_path, store):
    """Twelve hourly rows of one day, terminal at row 6 (and at the last): two episodes, 6 + 6 rows."""
    csv = tmp_path / "log.csv"
    csv.write_text("time,temp,sp,r,done\n" + "".join(
        f"2024-01-01T{h:02d}:00:00Z,{20 + h},21,{-h},{'true' if h in (5, 11) else 'false'}\n" for h in range(12)))
    mapping = TableMapping(timestamp="time", observation=["temp"], action=["sp"], reward="r", terminal="done")
    card = import_table(store, csv, "plant", mapping)
    assert card.num_episodes == 2 and card.num_rows == 12
    assert card.episode_rule.endswith("a terminal row ('done') ends its episode")
    cols = next(t for _, t in iter_partitions(store, card)).to_pydict()
    assert cols["episode_id"] == ["20240101T000000Z"] * 6 + ["20240101T060000Z"] * 6
    assert cols["step"] == [*range(6), *range(6)]
    assert [i for i, last in enumerate(cols["is_last"]) if last] == [5, 11]
    assert [i for i, t in enumerate(cols["is_terminal"]) if t] == [5, 11]
    assert cols["discount"][5] == 0.0 and cols["discount"][6] == 1.0
    untimed = import_table(store, csv, "untimed", TableMapping(observation=["temp"], reward="r", terminal="done"))
    assert untimed.num_episodes == 2  # file order, no times: the terminal row still ends the first episode


def test_episodes_that_start_within_one_second_get_ids_of_their_own(tmp_path, store):
    """Ids are start times to the second: steps of 0.1 s cut by terminal rows every 3 rows gave three episodes one
    id, which everything grouping by episode_id then merged."""
    csv = tmp_path / "log.csv"
    csv.write_text("time,temp,sp,r,done\n" + "".join(
        f"2024-01-01T00:00:00.{i}Z,{20 + i},21,{-i},{'true' if i % 3 == 2 else 'false'}\n" for i in range(8)))
    mapping = TableMapping(timestamp="time", observation=["temp"], action=["sp"], reward="r", terminal="done")
    card = import_table(store, csv, "fast", mapping)
    cols = next(t for _, t in iter_partitions(store, card)).to_pydict()
    assert card.num_episodes == 3 == len(set(cols["episode_id"]))
    assert cols["step"] == [0, 1, 2, 0, 1, 2, 0, 1]


def test_a_terminal_row_inside_a_named_episode_is_refused_naming_the_row(tmp_path, store):
    said = refused(tmp_path, store, "building,temp,r,done\nb1,20,-1,false\nb1,21,-2,true\nb1,22,-3,false\nb2,23,-4,true\n",
                   "episode_id: building\nobservation: [temp]\nreward: r\nterminal: done\n")
    assert "row 2" in said and "'b1'" in said and "last row of its episode" in said


def one_line_refusal(tmp_path, store, name: str, content: bytes) -> str:
    """``rlpipe datasets import table`` of a file ``name`` holding ``content``: refused as bad input in one line,
    which is returned."""
    log, mapping = tmp_path / name, tmp_path / "map.yaml"
    log.write_bytes(content)
    mapping.write_text("reward: b\nobservation: [a]\n")
    result = runner.invoke(app, ["import", "table", str(log), "--mapping", str(mapping), "--name", "p",
                                 "--root", store.root])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    return result.stderr


@pytest.mark.parametrize(("name", "content"), [("log.parquet", b"a,b\n1,2\n"), ("log.csv", b'a,b\n1,2\n"open,3\n')])
def test_a_file_that_is_not_what_its_name_says_is_one_line_naming_it(tmp_path, store, name, content):
    said = one_line_refusal(tmp_path, store, name, content)
    assert f"{name} cannot be read as {'Parquet' if name.endswith('parquet') else 'CSV'}" in said
    assert dataset_names(store) == []


@pytest.mark.parametrize("content", [b"\x89PNG\r\n\x1a\n" + bytes(200), "a,b\n1,2\n".encode("utf-16"),
                                     bytes(range(256)) * 4], ids=["png", "utf-16", "bytes"])
def test_a_binary_file_named_csv_is_one_line_saying_it_is_not_utf8_text(tmp_path, store, content):
    """Read as text, such a file would give garbage column names and an error about the mapping instead."""
    said = one_line_refusal(tmp_path, store, "log.csv", content)
    assert "log.csv is not a readable CSV" in said and "UTF-8" in said, said
    assert "mapping" not in said and dataset_names(store) == []


@pytest.mark.parametrize(("make", "said"), [
    (lambda path: None, "does not exist"),
    (lambda path: path.mkdir(), "is a folder"),
    (lambda path: path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(20)), "is not text"),
], ids=["missing", "folder", "binary"])
def test_a_mapping_file_that_cannot_be_read_is_one_line_naming_it(tmp_path, store, make, said):
    csv, mapping = tmp_path / "log.csv", tmp_path / "map.yaml"
    csv.write_text("a,b\n1,2\n")
    make(mapping)
    result = runner.invoke(app, ["import", "table", str(csv), "--mapping", str(mapping), "--name", "p",
                                 "--root", store.root])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"mapping file {str(mapping)!r} {said}" in result.stderr, result.stderr
    assert dataset_names(store) == []


@pytest.mark.parametrize("make", [lambda path: None, lambda path: path.mkdir()], ids=["missing", "folder"])
def test_a_log_path_that_is_no_file_is_bad_input_naming_it(tmp_path, store, make):
    """Exit status 2 (the input is wrong), as for every other refused import, and a folder is not called missing."""
    log, mapping = tmp_path / "log.csv", tmp_path / "map.yaml"
    make(log)
    mapping.write_text("reward: b\nobservation: [a]\n")
    result = runner.invoke(app, ["import", "table", str(log), "--mapping", str(mapping), "--name", "p",
                                 "--root", store.root])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert str(log) in result.stderr and ("is a folder" in result.stderr) == log.is_dir(), result.stderr
    assert "give the path of a .csv or .parquet file" in result.stderr, result.stderr


@pytest.mark.parametrize("episode_id", ["episode_id: b\n", ""])
def test_a_time_logged_twice_in_an_episode_is_refused_naming_both_rows(tmp_path, store, episode_id):
    # the same step twice (a log exported twice) would train on it twice, as a step that took no time
    rows = ("b,time,temp,sp,r\n"
            "b1,2023-05-01T10:05:00Z,20,1,0\n"
            "b1,2023-05-01T10:00:00Z,20,1,0\n"
            "b2,2023-05-01T10:05:00Z,20,1,0\n"
            "b1,2023-05-01T10:05:00Z,21,1,0\n")
    mapping = episode_id + "timestamp: time\nobservation: [temp]\naction: [sp]\nreward: r\n"
    if episode_id:  # another episode at the same time is fine
        rows = rows.replace("b1,2023-05-01T10:05:00Z,21", "b1,2023-05-01T10:10:00Z,21")
        assert import_table(store, _csv(tmp_path, rows), "two", TableMapping(
            episode_id="b", timestamp="time", observation=["temp"], action=["sp"], reward="r")).num_rows == 4
        rows = rows.replace("b1,2023-05-01T10:10:00Z,21", "b1,2023-05-01T10:05:00Z,21")
        store = ObjectStore((tmp_path / "store2").as_uri())
    error = refused(tmp_path, store, rows, mapping)
    pair = "rows 1 and 4" if episode_id else "rows 1 and 3"
    assert "2023-05-01 10:05:00" in error and pair in error and "drop" in error, error


def _csv(tmp_path, rows: str):
    path = tmp_path / "log.csv"
    path.write_text(rows)
    return path


B1_WITH_A_HOLE = "b,time,temp,sp,r\n" + "".join(  # every 5 minutes, with a 5-hour hole after 10:10
    f"b1,2023-05-01T{t}:00Z,20,1,-1\n" for t in ("10:00", "10:05", "10:10", "15:10", "15:15"))


def test_a_gap_inside_a_named_episode_ends_it_there_instead_of_becoming_one_long_step(tmp_path, store):
    # b1 is logged every 5 minutes with a 5-hour hole: 10:10 -> 15:10 is no 5-minute step
    rows = B1_WITH_A_HOLE + "b2,2023-05-01T11:00:00Z,20,1,-1\nb2,2023-05-01T11:05:00Z,20,1,-1\n"
    mapping = TableMapping(episode_id="b", timestamp="time", observation=["temp"], action=["sp"], reward="r")
    card = import_table(store, _csv(tmp_path, rows), "holes", mapping)
    assert card.num_episodes == 3 and card.step_seconds == 300
    table = next(t for _, t in iter_partitions(store, card))
    cols = table.to_pydict()
    assert cols["episode_id"] == ["b1"] * 3 + ["b2"] * 2 + ["b1-1"] * 2  # episodes in order of their start
    assert cols["step"] == [0, 1, 2, 0, 1, 0, 1]
    assert cols["is_last"] == [False, False, True, False, True, False, True]
    assert not any(cols["is_terminal"])  # cut by the gap, not ended


def test_the_part_after_a_gap_takes_a_name_no_episode_of_the_log_has(tmp_path, store):
    # b1 has a 5-hour hole; the log also names a real episode b1-1, so b1's second part becomes b1-2
    rows = B1_WITH_A_HOLE + "b1-1,2023-05-01T15:12:00Z,30,2,-2\nb1-1,2023-05-01T15:17:00Z,30,2,-2\n"
    mapping = TableMapping(episode_id="b", timestamp="time", observation=["temp"], action=["sp"], reward="r")
    card = import_table(store, _csv(tmp_path, rows), "holes", mapping)
    assert card.num_episodes == 3
    cols = next(t for _, t in iter_partitions(store, card)).to_pydict()
    assert cols["episode_id"] == ["b1"] * 3 + ["b1-2"] * 2 + ["b1-1"] * 2  # in order of their start
    assert cols["temp"] == [20.0] * 5 + [30.0] * 2  # the real b1-1 keeps its own rows only
