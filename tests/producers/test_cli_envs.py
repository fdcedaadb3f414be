"""The ``envs`` command line, driven through Typer's CliRunner on the classic and RecSim envs."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from producers import cli
from producers.cli import app
from producers.envs import registry

runner = CliRunner()


def test_list_shows_envs_and_survives_a_broken_module(monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, "zz-broken", "producers.envs.does_not_exist:Nope")
    monkeypatch.setattr(cli.console, "_width", 250)  # one table row per line; undoing the width property would fix the width of later tests
    result = runner.invoke(app, ["list"])
    assert result.exit_code == 0, result.output
    for name in ("cartpole", "cartpole-v1", "acrobot", "recsim-interest-evolution", "zz-broken"):
        assert name in result.stdout
    assert "failed to load" in result.stdout and "ModuleNotFoundError" in result.stdout
    assert "turns 200, actions/turn 1, actions 200, env steps 200" in result.stdout


def test_list_json_gives_every_env_with_its_defaults(monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, "zz-broken", "producers.envs.does_not_exist:Nope")
    result = runner.invoke(app, ["list", "--json"])
    assert result.exit_code == 0, result.output
    by_name = {env["name"]: env for env in json.loads(result.stdout)}
    assert by_name["cartpole"]["defaults"]["max_turns"] == 200 and by_name["cartpole"]["description"]
    assert "ModuleNotFoundError" in by_name["zz-broken"]["error"]


def test_eval_heuristic_cartpole_json():
    result = runner.invoke(app, ["eval", "cartpole", "--policy", "heuristic", "--episodes", "3", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["episodes"] == 3 and summary["mean_return"] == 200.0 and summary["ci95"] == 0.0
    assert summary["success_rate"] == 1.0 and summary["env_steps_per_second"] > 0


def test_eval_random_acrobot_and_table_output(monkeypatch):
    args = ["eval", "acrobot", "--policy", "random", "--episodes", "2", "--seed-start", "7", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["mean_return"] == -500.0 and summary["success_rate"] == 0.0 and summary["seed_start"] == 7
    monkeypatch.setattr(cli.console, "_width", 200)
    table = runner.invoke(app, ["eval", "recsim-interest-evolution", "-n", "2"])
    assert table.exit_code == 0, table.output
    assert "mean return" in table.stdout and "95% CI" in table.stdout and "env steps / s" in table.stdout


@pytest.mark.parametrize("command", [["eval", "no-such-env"], ["play", "no-such-env"]])
def test_unknown_env_is_one_line_exit_2(command):
    result = runner.invoke(app, command)
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "unknown environment 'no-such-env'" in lines[0] and "cartpole" in lines[0]


def test_eval_rejects_zero_episodes():
    result = runner.invoke(app, ["eval", "cartpole", "--episodes", "0"])
    assert result.exit_code == 2 and "Traceback" not in result.output


def test_play_human_reads_bare_and_tagged_answers():
    result = runner.invoke(
        app, ["play", "cartpole", "--seed", "1", "--max-turns", "4"], input="left\nRIGHT\njump\n<answer>1</answer>\n"
    )
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "Cart position" in out and "Actions: left" in out
    assert out.count("reward +1.000") == 3 and out.count("reward -0.100") == 1
    assert "final return +2.900 over 4 turns (3 env steps)" in out
    assert "(invalid: 'jump' is not an action here; answer left or right)" in out


def test_play_human_stops_cleanly_when_input_ends():
    result = runner.invoke(app, ["play", "acrobot", "--seed", "0"], input="+1\n")
    assert result.exit_code == 0, result.output
    assert "reward -1.000" in result.stdout and "input ended after 1 turns; return so far -1.000" in result.stdout


def test_play_scripted_policies():
    heuristic = runner.invoke(app, ["play", "cartpole", "--policy", "heuristic", "--seed", "2"])
    assert heuristic.exit_code == 0, heuristic.output
    assert "episode truncated; success: True" in heuristic.stdout
    assert "final return +200.000 over 200 turns" in heuristic.stdout
    recsim = runner.invoke(app, ["play", "recsim-interest-evolution", "--policy", "random", "--max-turns", "3"])
    assert recsim.exit_code == 0, recsim.output
    assert "Candidates:" in recsim.stdout and "over 3 turns" in recsim.stdout


def test_a_negative_seed_is_refused_in_one_line():
    """Seeds are >= 0 everywhere (building-hvac raised a traceback; the others played seed |n| silently)."""
    for args in (["play", "building-hvac", "--seed", "-1", "--policy", "heuristic"],
                 ["play", "sokoban", "--seed", "-1", "--policy", "random"],
                 ["eval", "building-hvac", "--seed-start", "-3", "-n", "1"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert "Invalid value for '--seed" in result.output and "greater than or equal to" in result.output


def test_play_and_eval_take_environment_overrides_and_name_a_bad_field():
    played = runner.invoke(app, ["play", "text2sql", "--seed", "3", "--policy", "heuristic", "--overrides",
                                 '{"split": "test"}'])
    assert played.exit_code == 0 and "final return" in played.output, played.output
    evaluated = runner.invoke(app, ["eval", "text2sql", "--policy", "random", "-n", "3", "--json", "--overrides",
                                    '{"split": "all"}'])
    assert evaluated.exit_code == 0, evaluated.output
    base = json.loads(runner.invoke(app, ["eval", "text2sql", "--policy", "random", "-n", "3", "--json"]).output)
    assert json.loads(evaluated.output)["mean_return"] != base["mean_return"]  # another task set was played
    for command in (["play", "sokoban"], ["eval", "sokoban"], ["record", "sokoban", "--run", "x"]):
        typo = runner.invoke(app, [*command, "--overrides", '{"widht": 3}'])
        assert typo.exit_code == 2 and "widht" in typo.output and "\n" not in typo.output.strip(), typo.output
        assert "widht: no such setting (rlpipe envs show sokoban lists them)" in typo.output, typo.output
        broken = runner.invoke(app, [*command, "--overrides", "{bad json"])
        assert broken.exit_code == 2 and "--overrides" in broken.output, broken.output
    typo = runner.invoke(app, ["eval", "tetris", "--overrides", '{"widht": 3}'])
    assert "invalid settings for tetris: widht: no such setting; did you mean width?" in typo.output, typo.output


def test_record_refuses_a_bad_run_name_before_loading_anything():
    result = runner.invoke(app, ["record", "sokoban", "--run", "../escape"])
    assert result.exit_code == 2 and "run" in result.output and "'../escape'" in result.output, result.output


def test_show_lists_every_setting_with_its_default_bounds_and_description():
    wide = CliRunner(env={"COLUMNS": "220"})
    shown = wide.invoke(app, ["show", "tetris"])
    assert shown.exit_code == 0, shown.output
    from producers.envs.tetris import Tetris

    for name in Tetris.Config.model_fields:
        assert name in shown.output
    assert "1 ≤ x ≤ 100000" in shown.output  # max_turns' bounds
    as_json = json.loads(wide.invoke(app, ["show", "text2sql", "--json"]).output)
    split = next(s for s in as_json["settings"] if s["name"] == "split")
    assert split["default"] == "train" and set(split["choices"]) >= {"train", "test", "all"}
    assert as_json["name"] == "text2sql" and all(s["description"] for s in as_json["settings"])
    unknown = runner.invoke(app, ["show", "nope"])
    assert unknown.exit_code == 2 and "sokoban" in unknown.output


def test_show_gives_the_defaults_an_environment_runs_with_even_those_derived_from_other_settings():
    # The building's limits are filled in from its episode: 1 day of 300 s steps = 86,400 / 300 = 288.
    as_json = json.loads(runner.invoke(app, ["show", "building-hvac", "--json"]).output)
    shown = {s["name"]: s["default"] for s in as_json["settings"]}
    assert shown["max_turns"] == shown["max_actions_total"] == shown["max_env_steps"] == 288
    listed = next(e for e in json.loads(runner.invoke(app, ["list", "--json"]).output) if e["name"] == "building-hvac")
    assert {name: listed["defaults"][name] for name in ("max_turns", "max_actions_total", "max_env_steps")} == {
        "max_turns": 288, "max_actions_total": 288, "max_env_steps": 288}


def test_weighted_recording_of_an_environment_with_many_answers_names_the_setting_that_makes_few(tmp_path):
    store = ["--root", (tmp_path / "store").as_uri(), "--episodes", "1", "--weighted"]
    sokoban = runner.invoke(app, ["record", "sokoban", "--run", "w", *store])
    assert sokoban.exit_code == 2 and "max_actions_per_turn" in sokoban.output, sokoban.output
    tetris = runner.invoke(app, ["record", "tetris", "--run", "w", *store])
    assert tetris.exit_code == 2 and "without --weighted" in tetris.output and "max_actions" not in tetris.output


def test_record_writes_to_the_store_the_environment_names(tmp_path, monkeypatch, tiny_model_dir):
    """`envs record` wrote into the embedded stack's store whatever RLPIPE_STORE__ROOT said, so a warm start reading
    the configured store found no demonstrations."""
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RLPIPE_STORE__ROOT", (tmp_path / "configured").as_uri())
    result = runner.invoke(app, ["record", "cartpole", "--run", "demos", "--episodes", "1", "--model", tiny_model_dir])
    assert result.exit_code == 0, result.output
    assert list((tmp_path / "configured" / "runs" / "demos").rglob("*.parquet"))
    assert not (tmp_path / "home" / "store" / "runs" / "demos").exists()


def test_record_refuses_a_training_run_before_writing_into_it(tmp_path):
    """Demonstrations written under a training run (one with run.json) would be announced by its producers' orphan
    sweep and reach its learner, and its replay would mix them with the run's own rows."""
    from pipeline.io.store import ObjectStore

    store = ObjectStore((tmp_path / "store").as_uri())
    store.put("runs/live/run.json", b"{}")
    result = runner.invoke(app, ["record", "cartpole", "--run", "live", "--episodes", "1", "--root", store.root])
    assert result.exit_code == 2, result.output
    assert "run live is a training run" in result.output and "--run live-demos" in result.output
    assert store.list("runs/live", recursive=True) == ["runs/live/run.json"]
