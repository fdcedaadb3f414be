"""Steps tables from column arrays and where episodes start in a log (pure, no store)."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pytest

from pipeline.io.datasets import DatasetError
from pipeline.io.steps_arrays import episode_starts, steps_table_from_arrays
from schemas.steps import check_steps_table

US = 1_000_000
T0 = int(dt.datetime(2023, 3, 1, 22, 0, tzinfo=dt.UTC).timestamp()) * US  # 22:00 UTC


def test_steps_table_from_arrays_marks_episodes_and_stacks_vectors():
    # two episodes: rows 0-2 and 3-4; the second truly terminates
    features = {"a@x": np.array([1.0, 2, 3, 4, 5]), "b@y": np.array([10.0, 20, 30, 40, 50]),
                "act@u": np.array([0.5, 0.6, 0.7, 0.8, 0.9]), "r": np.array([-1.0, -2, -3, -4, -5])}
    terminal = np.array([False, False, False, False, True])
    table = steps_table_from_arrays(["e0", "e1"], np.array([0, 3]), T0 + np.arange(5) * 300 * US, features,
                                    ["a@x", "b@y"], ["act@u"], features["r"], terminal)
    check_steps_table(table)
    cols = table.to_pydict()
    assert cols["episode_id"] == ["e0", "e0", "e0", "e1", "e1"]
    assert cols["step"] == [0, 1, 2, 0, 1]
    assert cols["is_first"] == [True, False, False, True, False]
    assert cols["is_last"] == [False, False, True, False, True]
    assert cols["is_terminal"] == [False, False, False, False, True]
    assert cols["discount"] == [1.0, 1.0, 1.0, 1.0, 0.0]
    assert cols["observation"][3] == [4.0, 40.0]
    assert cols["action"][1] == pytest.approx([0.6])
    assert cols["reward"] == [-1.0, -2.0, -3.0, -4.0, -5.0]
    assert cols["timestamp"][1] == dt.datetime(2023, 3, 1, 22, 5, tzinfo=dt.UTC)
    assert cols["b@y"] == [10.0, 20.0, 30.0, 40.0, 50.0]


def test_episode_starts_split_at_local_midnight_and_at_gaps():
    # 22:00 .. 02:55 UTC every 5 minutes (72 steps), then a 1-hour gap, then 4 more steps
    times = np.concatenate([T0 + np.arange(72) * 300 * US, T0 + (72 * 300 + 3600) * US + np.arange(4) * 300 * US])
    # UTC midnight is 2 hours (24 steps) after 22:00
    assert episode_starts(times, 300, "day", 0.0).tolist() == [0, 24, 72]
    # at UTC-1, local midnight is 01:00 UTC: 36 steps after 22:00
    assert episode_starts(times, 300, "day", -1.0).tolist() == [0, 36, 72]
    assert episode_starts(times, 300, "gap").tolist() == [0, 72]
    with pytest.raises(DatasetError, match="strictly increase"):
        episode_starts(np.array([T0, T0, T0 + 300 * US]), 300)
