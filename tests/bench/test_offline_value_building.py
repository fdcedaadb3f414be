"""bench/offline_value_building.py: picking a network per group of seeds on the validation days."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from bench.offline_value_building import paired_summary, picks, pool


def test_picks_take_each_groups_best_validation_seed_keyed_by_its_first_seed():
    validation = {
        "cql": {12: -31.4, 13: -30.6, 14: -30.4, 15: -29.9, 16: -31.0, 17: -30.1},
        "bc": {12: -30.2, 13: -30.9, 14: -30.8, 15: -30.7, 16: -30.6, 17: -30.5},
        "cql-filtered": {12: -30.0, 13: -30.9, 14: -31.0, 15: -30.0, 16: -30.2, 17: -30.3},
    }
    chosen = picks(validation, 3)
    assert chosen["cql-picked"] == {12: ("cql", 14), 15: ("cql", 15)}
    assert chosen["bc-picked"] == {12: ("bc", 12), 15: ("bc", 17)}
    assert chosen["cql-filtered-picked"] == {12: ("cql-filtered", 12), 15: ("cql-filtered", 15)}
    # the best of every CQL kind, never BC: seeds 12-14's best is the filtered seed 12, 15-17's plain seed 15
    assert chosen["cql-any-picked"] == {12: ("cql-filtered", 12), 15: ("cql", 15)}


def test_picks_leave_out_a_last_group_that_is_not_full_and_need_two_cql_kinds_for_any():
    chosen = picks({"cql": {0: -1.0, 1: -2.0, 2: -0.5}, "bc": {0: -1.0, 1: -0.5, 2: -3.0}}, 2)
    assert chosen == {"cql-picked": {0: ("cql", 0)}, "bc-picked": {0: ("bc", 1)}}


def test_paired_summary_gives_the_mean_with_intervals_over_pairs_seeds_and_days():
    # two seeds, three days; the baseline plays once (seed 0 stands for every seed)
    network = {3: [1.0, 2.0, 6.0], 4: [0.0, 2.0, 4.0]}
    baseline = {0: [0.0, 2.0, 3.0]}
    d = paired_summary(network, baseline)
    # differences: seed 3: 1, 0, 3; seed 4: 0, 0, 1
    assert d["pairs"] == 6 and d["mean"] == pytest.approx(5 / 6)
    assert (d["seeds"], d["seeds_above"], d["days"]) == (2, 2, 3)
    # seed means 4/3 and 1/3: t(1) x sd / sqrt(2); day means 0.5, 0, 2: t(2) x sd / sqrt(3)
    assert d["seeds_ci95"] == pytest.approx(12.706 * statistics.stdev([4 / 3, 1 / 3]) / 2 ** 0.5, rel=1e-3)
    assert d["days_ci95"] == pytest.approx(4.303 * statistics.stdev([0.5, 0.0, 2.0]) / 3 ** 0.5, rel=1e-3)


def run_file(path: Path, first_seed: int, validation: dict[int, float], held_out: dict[int, float],
             steps: str = "24000") -> Path:
    def returns(means: dict[int, float]) -> dict[str, dict[str, list[float]]]:
        rows = {kind: {str(seed): [m + k, m - k] for seed, m in means.items()} for k, kind in enumerate(["cql", "bc"])}
        return rows | {"behaviour": {str(seed): [-1.0, -1.0] for seed in means}, "heuristic": {"0": [-2.0, -2.0]},
                       "random": {str(seed): [-9.0, -9.0] for seed in means}}

    path.write_text(json.dumps({
        "args": {"steps": steps, "first_seed": str(first_seed), "seeds": "2", "json": str(path)},
        "validation": {"days": [21, 22], "returns": returns(validation)},
        "held-out": {"days": [14, 15], "returns": returns(held_out)},
    }))
    return path


def test_pool_picks_again_over_the_pooled_seeds_and_refuses_what_does_not_pool(tmp_path, capsys):
    a = run_file(tmp_path / "a.json", 0, {0: -5.0, 1: -3.0}, {0: -4.0, 1: 0.5})
    b = run_file(tmp_path / "b.json", 2, {2: -1.0, 3: -6.0}, {2: 1.5, 3: -7.0})
    pool([a, b], 2)
    out = capsys.readouterr().out
    # the picks: seed 1 (validation -3 > -5) and seed 2 (-1 > -6); their held-out means 0.5 and 1.5
    assert "| cql-picked | 2 | 1.000 ±" in out
    assert "| cql | 4 | -2.250 ±" in out
    with pytest.raises(SystemExit, match="cql seed 0 is in two of the pooled files"):
        pool([a, run_file(tmp_path / "c.json", 0, {0: -5.0, 1: -3.0}, {0: -4.0, 1: 0.5})], 2)
    with pytest.raises(SystemExit, match=r"other settings than .* \(steps\)"):
        pool([a, run_file(tmp_path / "d.json", 2, {2: -1.0, 3: -6.0}, {2: 1.5, 3: -7.0}, steps="8000")], 2)
