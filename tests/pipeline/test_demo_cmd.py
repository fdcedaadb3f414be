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


def rate(version, success, episodes=64):
    return {"version": version, "success_rate": success, "episodes": episodes, "mean_return": 1.0, "ci95": 0.1}


def test_success_verdict_needs_x1_5_over_base_and_beating_random_with_separate_intervals():
    from pipeline.cli.demo_cmd import success_verdict

    good = success_verdict(rate(0, 0.25), rate(15, 0.80), rate(0, 0.30))
    assert good["success_ratio"] == 3.2 and good["success_x1_5"] and good["success_above_random"]
    assert good["last_success_ci"][0] < 0.80 < good["last_success_ci"][1]
    line = targets_line({**verdict(rate(0, 0.25), rate(15, 0.80)), **good})
    assert line == "targets: success x1.5 over the base model: met; success above random: met"
    # x1.6 on average, but 40% of 64 and 25% of 64 have overlapping Wilson intervals
    close = success_verdict(rate(0, 0.25), rate(15, 0.40), rate(0, 0.30))
    assert close["success_ratio"] == 1.6 and not close["success_x1_5"] and not close["success_above_random"]
    missed = targets_line({**verdict(rate(0, 0.25), rate(15, 0.40)), **close})
    assert "MISSED" in missed and "--demonstrations" in missed
    # a base model that never succeeds: any success is an infinite ratio, none is undefined
    assert success_verdict(rate(0, 0.0), rate(15, 0.5), rate(0, 0.1))["success_ratio"] == math.inf
    assert math.isnan(success_verdict(rate(0, 0.0), rate(15, 0.0), rate(0, 0.1))["success_ratio"])


def test_each_demo_preset_names_an_environment_with_a_recipe_and_a_matching_warm_start():
    from pipeline.cli.demo_cmd import recipe_for
    from pipeline.config import load_preset

    for preset in ("demo", "demo-gae", "demo-sokoban", "demo-tetris"):
        env_name, overrides, recipe = recipe_for(preset)
        warm = load_preset(recipe.warm_preset)
        online = load_preset(preset)
        assert warm["env"]["name"] == env_name and (warm["env"].get("overrides") or {}) == overrides
        for key in ("lora_rank", "lora_alpha"):
            assert warm["learner"][key] == online["learner"][key]
    assert recipe_for("demo-sokoban")[2].judge == "success" and recipe_for("demo")[2].judge == "return"


def test_a_value_based_preset_is_refused_before_the_model_is_built(tmp_path, monkeypatch):
    """Its environment has a recipe, but the demo's phases warm-start and train a LoRA adapter: the online phase
    would refuse `learner.init_from` on a value run only after the model, the demonstrations and the warm start."""
    from typer.testing import CliRunner

    from pipeline.cli import demo_cmd

    phases: list[tuple[str, ...]] = []
    monkeypatch.setattr(demo_cmd, "_phase", lambda title, *args, **kwargs: phases.append(args))
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path))
    result = CliRunner().invoke(demo_cmd.app, ["--preset", "dqn-cartpole"])
    assert result.exit_code == 2, result.output
    assert "dqn-cartpole is value-based" in result.output and "rlpipe run --preset dqn-cartpole" in result.output
    assert phases == []


def test_a_preset_without_a_demo_recipe_is_a_usage_error(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from pipeline.cli import demo_cmd

    phases: list[tuple[str, ...]] = []
    monkeypatch.setattr(demo_cmd, "_phase", lambda title, *args, **kwargs: phases.append(args))
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path))
    result = CliRunner().invoke(demo_cmd.app, ["--preset", "text2sql"])
    assert result.exit_code == 2, result.output  # the user's choice of preset, as an unknown preset is
    assert "rlpipe demo has no recipe for 'text2sql'" in result.output and phases == []
