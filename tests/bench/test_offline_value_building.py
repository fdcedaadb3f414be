"""bench/offline_value_building.py: picking a network per group of seeds on the validation days."""

from __future__ import annotations

from bench.offline_value_building import picks


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
