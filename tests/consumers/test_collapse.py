"""Signs of collapse on hand-computed steps, the warning that fires once per crossing, the uncertain-group filter."""

from __future__ import annotations

import logging
import math

import numpy as np
import pyarrow as pa
import pytest

from consumers.collapse import (
    CollapseMonitor,
    collapse_signs,
    group_reward_spreads,
    identical_group_share,
    keep_uncertain_groups,
    reward_spread,
    zero_advantage_share,
)
from schemas.config import LearnerConfig

PROMPT = [1, 2]


def rows(episodes: list[tuple[str, str, list[list[int]], float]]) -> dict[str, list]:
    """Columns of per-turn rows: one (group, episode, answers per turn, episode reward) per episode."""
    cols: dict[str, list] = {k: [] for k in ("tokens", "loss_mask", "group_id", "episode_id", "turn", "reward")}
    for group, episode, answers, reward in episodes:
        for turn, answer in enumerate(answers):
            cols["tokens"].append(PROMPT + answer)
            cols["loss_mask"].append([0] * len(PROMPT) + [1] * len(answer))
            cols["group_id"].append(group)
            cols["episode_id"].append(episode)
            cols["turn"].append(turn)
            cols["reward"].append(reward)
    return cols


def share(cols: dict[str, list]) -> float:
    return identical_group_share(cols["tokens"], cols["loss_mask"], cols["group_id"], cols["episode_id"], cols["turn"])


def test_groups_whose_samples_are_all_identical_count_fully():
    same = rows([("g", f"e{i}", [[5], [6, 7]], 1.0) for i in range(4)])
    assert share(same) == 1.0
    mixed = rows([("g", f"e{i}", [[5], [6, 7]], 1.0) for i in range(3)] + [("g", "e3", [[5], [6, 8]], 0.0)])
    assert share(mixed) == 0.0


def test_identical_share_compares_whole_episodes_in_turn_order_and_skips_single_episode_groups():
    cols = rows([
        ("a", "a0", [[5], [6]], 0.0), ("a", "a1", [[5], [6]], 0.0),  # identical
        ("b", "b0", [[5], [6]], 0.0), ("b", "b1", [[6], [5]], 0.0),  # same answers, other turns: different
        ("c", "c0", [[5]], 0.0),  # one episode: nothing to compare
    ])  # fmt: skip
    order = [3, 0, 7, 2, 1, 6, 5, 4, 8]  # rows arrive in any order
    shuffled = {k: [v[i] for i in order] for k, v in cols.items()}
    assert share(shuffled) == 0.5
    assert math.isnan(share(rows([("c", "c0", [[5]], 0.0)])))


def test_prompt_tokens_do_not_count_as_answers():
    cols = {"tokens": [[1, 2, 5], [9, 9, 5]], "loss_mask": [[0, 0, 1], [0, 0, 1]], "group_id": ["g", "g"],
            "episode_id": ["e0", "e1"], "turn": [0, 0]}  # fmt: skip
    assert share(cols) == 1.0


def test_zero_advantage_share():
    assert zero_advantage_share([0.0, 0.0, 0.0]) == 1.0
    assert zero_advantage_share([0.0, 0.5, -0.5, 1e-12]) == 0.5
    assert math.isnan(zero_advantage_share([]))


def test_reward_spread_is_the_mean_within_group_std_of_episode_rewards():
    # group a: rewards 0, 2 (two turns each, counted once per episode) -> std 1; group b: 3, 3 -> 0;
    # group c: one episode -> left out of the mean.
    cols = rows([("a", "a0", [[5], [5]], 0.0), ("a", "a1", [[6], [6]], 2.0), ("b", "b0", [[5]], 3.0),
                 ("b", "b1", [[6]], 3.0), ("c", "c0", [[5]], 9.0)])  # fmt: skip
    assert group_reward_spreads(cols["reward"], cols["group_id"], cols["episode_id"]) == {"a": 1.0, "b": 0.0, "c": 0.0}
    assert reward_spread(cols["reward"], cols["group_id"], cols["episode_id"]) == 0.5


def table(cols: dict[str, list]) -> pa.Table:
    return pa.table({**cols, "turn": pa.array(cols["turn"], pa.int32())})


def test_collapse_signs_of_a_table():
    cols = rows([("a", "a0", [[5]], 1.0), ("a", "a1", [[5]], 1.0), ("b", "b0", [[5]], 0.0), ("b", "b1", [[6]], 1.0)])
    assert collapse_signs(table(cols)) == {"identical_group_share": 0.5, "reward_spread": 0.25}


def test_keep_uncertain_groups_keeps_the_top_fraction_by_reward_spread():
    # spreads: a 0, b 1.5, c 0.5, d 1.5 (ties: b before d), e one episode (0)
    cols = rows([("a", "a0", [[5]], 1.0), ("a", "a1", [[5]], 1.0), ("b", "b0", [[5], [6]], 0.0),
                 ("b", "b1", [[6]], 3.0), ("c", "c0", [[5]], 0.0), ("c", "c1", [[5]], 1.0),
                 ("d", "d0", [[5]], 3.0), ("d", "d1", [[5]], 0.0), ("e", "e0", [[5]], 7.0)])  # fmt: skip
    steps = table(cols)
    kept = keep_uncertain_groups(steps, 0.25)  # ceil(0.25 x 5) = 2 groups
    assert set(kept.column("group_id").to_pylist()) == {"b", "d"}
    assert kept.num_rows == 5  # b has three rows, d two: whole groups stay
    assert set(keep_uncertain_groups(steps, 0.5).column("group_id").to_pylist()) == {"b", "c", "d"}
    assert set(keep_uncertain_groups(steps, 0.01).column("group_id").to_pylist()) == {"b"}  # at least one group
    assert keep_uncertain_groups(steps, 1.0) is steps


def test_the_warning_fires_once_per_crossing_and_again_after_recovery(caplog):
    monitor = CollapseMonitor(LearnerConfig(warn_identical_group_share=0.5))
    caplog.set_level(logging.INFO, logger="rlpipe.learner")
    fired = [monitor.check({"step": step, "identical_group_share": value})
             for step, value in enumerate([0.0, 0.75, 1.0, 1.0, 0.25, 0.5, 0.75], start=1)]
    assert fired == [[], ["identical_group_share"], [], [], [], [], ["identical_group_share"]]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "step 2: 75% of groups sampled identical answers" in warnings[0]
    assert any("back within its threshold at step 5" in r.getMessage() for r in caplog.records)


def test_relative_thresholds_compare_with_the_first_steps(caplog):
    config = LearnerConfig(warn_entropy_fraction=0.5, warn_reward_spread_fraction=0.25, collapse_baseline_steps=2)
    monitor = CollapseMonitor(config)
    caplog.set_level(logging.WARNING, logger="rlpipe.learner")
    steps = [{"entropy_mean": 2.0, "reward_spread": 1.0}, {"entropy_mean": 1.0, "reward_spread": 1.0},
             {"entropy_mean": 0.8, "reward_spread": 0.3}, {"entropy_mean": 0.7, "reward_spread": 0.2},
             {"entropy_mean": math.nan, "reward_spread": 0.1}]  # fmt: skip
    fired = [monitor.check({"step": i + 1, **m}) for i, m in enumerate(steps)]
    # baselines: entropy 1.5 (warn below 0.75), spread 1.0 (warn below 0.25)
    assert fired == [[], [], [], ["entropy_mean", "reward_spread"], []]
    assert "policy entropy 0.7 is below 0.5 x its first steps' 1.5" in caplog.records[0].getMessage()


def test_zero_advantage_warning(caplog):
    monitor = CollapseMonitor(LearnerConfig())
    assert monitor.check({"zero_advantage_share": 1.0}) == ["zero_advantage_share"]
    assert monitor.check({"zero_advantage_share": 0.8}) == []  # not above 0.8: back, silently counted
    assert monitor.crossed == set()


@pytest.mark.parametrize("fraction", [0.0, 1.5])
def test_keep_uncertain_groups_is_bounded_in_the_config(fraction):
    with pytest.raises(ValueError):
        LearnerConfig(keep_uncertain_groups=fraction)


def test_metrics_are_plain_floats():
    cols = rows([("a", "a0", [[5]], 1.0), ("a", "a1", [[6]], 0.0)])
    signs = collapse_signs(table(cols))
    assert all(type(v) is float for v in signs.values())
    assert type(zero_advantage_share(np.zeros(2))) is float


def test_shrinking_spread_and_entropy_of_a_policy_that_improved_is_not_collapse(caplog):
    """A policy that learned the task samples alike and scores alike: that is convergence, not collapse."""
    config = LearnerConfig(warn_entropy_fraction=0.5, warn_reward_spread_fraction=0.25, collapse_baseline_steps=2)
    caplog.set_level(logging.WARNING, logger="rlpipe.learner")
    first = [{"entropy_mean": 1.0, "reward_spread": 10.0, "reward_mean": 20.0},
             {"entropy_mean": 1.0, "reward_spread": 10.0, "reward_mean": 24.0}]  # fmt: skip
    converged = CollapseMonitor(config)
    fired = [converged.check({"step": i + 1, **m}) for i, m in
             enumerate([*first, {"entropy_mean": 0.3, "reward_spread": 1.0, "reward_mean": 180.0}])]
    assert fired == [[], [], []] and not caplog.records
    # the same shrinking with no better reward (above the first steps' 22 by their spread, 10) is collapse
    stuck = CollapseMonitor(config)
    fired = [stuck.check({"step": i + 1, **m}) for i, m in
             enumerate([*first, {"entropy_mean": 0.3, "reward_spread": 1.0, "reward_mean": 31.0}])]
    assert fired[-1] == ["entropy_mean", "reward_spread"]
    assert "mean reward 31 has not risen above its first steps' 22 + 10" in caplog.records[0].getMessage()
