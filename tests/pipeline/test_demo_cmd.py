"""The demo's verdict: the two ratios it is judged by, and whether the 95% intervals separate."""

import math

from pipeline.cli.demo_cmd import targets_line, verdict


def result(version, mean, ci):
    return {"version": version, "mean_return": mean, "ci95": ci}


def test_verdict_judges_last_against_base_and_warm_start():
    out = verdict(result(0, 20.0, 3.0), result(31, 130.0, 15.0), result(1, 25.0, 5.0))
    assert out["ratio"] == 6.5 and out["doubled"] and out["intervals_separate"]
    assert out["ratio_rl"] == 5.2 and out["rl_raised_1_5x"] and out["rl_intervals_separate"]
    assert out["warm_version"] == 1 and out["last_version"] == 31


def test_verdict_reports_failures_and_overlaps_honestly():
    out = verdict(result(0, 20.0, 3.0), result(9, 35.0, 14.0), result(1, 30.0, 5.0))
    assert not out["doubled"] and not out["intervals_separate"]  # 35 - 14 < 20 + 3
    assert not out["rl_raised_1_5x"] and not out["rl_intervals_separate"]
    assert "ratio_rl" not in verdict(result(0, 20.0, 3.0), result(9, 35.0, 14.0))
    assert math.isnan(verdict(result(0, 0.0, 0.0), result(2, 5.0, 1.0))["ratio"])


def test_targets_line_says_met_or_missed_and_the_fix():
    good = verdict(result(0, 20.0, 3.0), result(21, 105.0, 15.0), result(1, 23.0, 4.0))
    assert targets_line(good) == "targets: x2 over the base model: met; x1.5 over the warm start: met"
    # doubled on average but the intervals overlap: not a measured improvement
    weak = verdict(result(0, 20.0, 3.0), result(21, 41.0, 19.0), result(1, 23.0, 4.0))
    line = targets_line(weak)
    assert "x2 over the base model: MISSED" in line and "x1.5 over the warm start: MISSED" in line
    assert "--steps" in line
    assert targets_line(verdict(result(0, 20.0, 3.0), result(9, 50.0, 5.0))) == "targets: x2 over the base model: met"


def test_a_recipe_seed_moves_every_training_seed_but_not_the_held_out_ones():
    from pipeline.cli.demo_cmd import SEED_STRIDE, seed_settings
    from schemas.config import RunConfig

    assert seed_settings(0) == []
    sets = dict(arg.split("=", 1) for arg in seed_settings(7)[1::2])
    assert sets == {"sampler.seed": "7", "learner.seed": "7", "producer.seed_start": str(7 * SEED_STRIDE)}
    # the largest seed the option accepts still leaves room for every producer's range below the held-out seeds
    config = RunConfig.model_validate({"producer": {"seed_start": 999 * SEED_STRIDE}})
    assert max(config.training_seeds("p-255")) < config.env.eval_seed_offset
