"""Offline datasets: the building generator, logged steps as online prompts, token trajectories, training
through `rlpipe replay --train`, and evaluation online (the importers: test_smart_buildings, test_table)."""

from __future__ import annotations

import json
import logging
import math
import re

import numpy as np
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from pipeline.io.archive import TrajectoryArchive
from pipeline.io.datasets import iter_partitions, read_card
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from producers.envs.building import BuildingHVAC
from producers.envs.evaluate import run_episode
from producers.offline.cli import app
from producers.offline.evaluation import SamplingSettings, evaluate_building, model_outcomes, scripted_outcomes
from producers.offline.generation import (
    GenerationSpec,
    day_env,
    day_policy,
    generate_building_dataset,
    simulate_day,
)
from producers.offline.smart_buildings import (
    REWARD_VALUE_IDS,
)
from producers.offline.trajectories import (
    TrajectoryOptions,
    building_env_for,
    dataset_to_trajectories,
    plan_batches,
    render_building_episode,
    setpoint_answer,
)
from producers.samplers.base import SampleOutput

runner = CliRunner(env={"COLUMNS": "200"})
US = 1_000_000


@pytest.fixture
def store(tmp_path):
    return ObjectStore((tmp_path / "store").as_uri())


# ---- the building environment restores a logged state ------------------------------------------------


def test_load_state_from_telemetry_reproduces_text_telemetry_and_physics():
    env = BuildingHVAC()
    env.reset(5)
    states = []
    for _ in range(120):  # 00:00 .. 09:55 on a Thursday: night setback, preheat, arrivals
        states.append((env.observation(), env.telemetry(), env.step_index, env._state.mode_Z.copy()))
        env.step(env.heuristic_answer())
    for observation, telemetry, step_index, modes in states:
        fresh = BuildingHVAC()
        assert fresh.load_state_from_telemetry(telemetry, modes=modes) == observation
        assert fresh.step_index == step_index  # derived from the time of day
        assert fresh.telemetry() == telemetry
    # at night nobody arrives, so stepping on from the restored state follows the original exactly
    observation, telemetry, step_index, modes = states[40]
    original = BuildingHVAC()
    original.reset(5)
    for _ in range(40):
        original.step(original.heuristic_answer())
    restored = BuildingHVAC()
    restored.load_state_from_telemetry(telemetry, modes=modes)
    for _ in range(5):
        answer = original.heuristic_answer()
        assert restored.heuristic_answer() == answer
        assert restored.step(answer).observation == original.step(answer).observation
    assert restored.telemetry() == original.telemetry()
    with pytest.raises(ValueError, match="outside this episode"):
        BuildingHVAC().load_state_from_telemetry(telemetry, step_index=288)


# ---- the simulator's logs -------------------------------------------------------------------------


def test_generated_telemetry_round_trips_through_the_importer(store):
    spec = GenerationSpec(days=2, policy="mixed", seed=4, first_day=1)
    card = generate_building_dataset(store, "sim", spec)
    logs = [simulate_day(day, day_policy(spec, day), spec.seed) for day in (1, 2)]
    assert [e["policy"] for e in card.extras["episodes"]] == [lg.policy for lg in logs]
    assert card.num_episodes == 2 and card.num_rows == 2 * 288 and card.step_seconds == 300
    units = card.units()
    for name, unit in BuildingHVAC.telemetry_fields():
        if not name.startswith(("reward@", "time@")):
            assert units[name] == unit
    for (_, table), day_log in zip(iter_partitions(store, card), logs, strict=True):
        cols = table.to_pydict()
        now, after = day_log.telemetry[:-1], day_log.telemetry[1:]
        assert [t.timestamp() for t in cols["timestamp"]] == [row["time@timestamp"] for row in now]
        for name in now[0]:
            if not name.startswith(("reward@", "time@")):  # observations: the state when the step starts
                assert cols[name] == [row[name] for row in now], name
        # actions and rewards: what the step did (the next telemetry row)
        assert cols["action:boiler_0@supply_water_setpoint"] == [r["action@supply_water_setpoint"] for r in after]
        assert cols["action:ahu_0@supply_air_heating_temperature_setpoint"] == \
            [r["action@supply_air_heating_temperature_setpoint"] for r in after]
        for reward_id, telemetry in (("agent_reward_value", "reward@reward"), ("normalized_energy_cost",
                                     "reward@energy_cost"), ("carbon_emitted", "reward@carbon_emitted")):
            assert cols[f"reward:{reward_id}"] == [r[telemetry] for r in after]
        assert cols["reward:energy_cost_weight"] == [0.4] * 288
        assert np.allclose(cols["reward"], [r["reward@reward"] for r in after], rtol=1e-6)  # float32 column
        assert len(REWARD_VALUE_IDS) == 17 and all(f"reward:{r}" in cols for r in REWARD_VALUE_IDS)


def test_logged_steps_render_as_exactly_the_online_prompts(store):
    # a Friday (comfort hours, the evening night drift) and a Saturday; heuristic and random days
    spec = GenerationSpec(days=2, policy="mixed", seed=4, first_day=1)
    card = generate_building_dataset(store, "sim", spec)
    env = building_env_for(card)
    for (_, table), day in zip(iter_partitions(store, card), (1, 2), strict=True):
        logged = simulate_day(day, day_policy(spec, day), spec.seed, keep_text=True)
        steps = render_building_episode(env, table, answer_decimals=1)
        assert [s.observation for s in steps] == logged.observations
        if logged.policy == "heuristic":  # its answers are written in the same kelvin format
            assert [s.answer for s in steps] == logged.answers
        whole = render_building_episode(env, table)  # whole kelvin by default
        row = table.slice(100, 1).to_pylist()[0]
        water, air = row["action:boiler_0@supply_water_setpoint"], row["action:ahu_0@supply_air_heating_temperature_setpoint"]
        assert whole[100].answer == f"<answer>{round(water)}K, {round(air)}K</answer>"


def test_setpoint_answers_in_kelvin_or_normalised_to_the_ranges():
    cfg = BuildingHVAC.Config()  # water 310-355 K, supply air 285-300 K
    assert setpoint_answer(cfg, 330.4, 291.6) == "<answer>330K, 292K</answer>"
    # normalised: 2 (k - low) / (high - low) - 1; 330 K -> -0.111, 292 K -> -0.067
    assert setpoint_answer(cfg, 330.0, 292.0, "normalized") == "<answer>-0.1, -0.1</answer>"
    assert setpoint_answer(cfg, 330.0, 292.0, "normalized", decimals=2) == "<answer>-0.11, -0.07</answer>"
    assert setpoint_answer(cfg, 355.0, 285.0, "normalized") == "<answer>1.0, -1.0</answer>"
    # 332.4 K -> -0.004: written 0.0, not -0.0; beyond the range -> clipped to +-1
    assert setpoint_answer(cfg, 332.4, 301.0, "normalized") == "<answer>0.0, 1.0</answer>"
    with pytest.raises(ValidationError, match="answer_format"):
        TrajectoryOptions(answer_format="celsius")


def test_normalised_answers_make_the_env_apply_the_logged_setpoints_within_the_rounding_step(store):
    spec = GenerationSpec(days=2, policy="mixed", seed=4, first_day=1)
    card = generate_building_dataset(store, "sim", spec)
    assert sorted(e["policy"] for e in card.extras["episodes"]) == ["heuristic", "random"]
    render_env = building_env_for(card)
    (w_lo, w_hi), (a_lo, a_hi) = render_env.config.supply_water_range_k, render_env.config.supply_air_heating_range_k
    # one decimal of [-1, 1]: a step of 0.1 = 0.05 of the range, so at most 0.025 of it off
    water_tol, air_tol = 0.025 * (w_hi - w_lo) + 1e-9, 0.025 * (a_hi - a_lo) + 1e-9
    for (_, table), day in zip(iter_partitions(store, card), (1, 2), strict=True):
        steps = render_building_episode(render_env, table, answer_format="normalized")
        logged = table.select(["action:boiler_0@supply_water_setpoint",
                               "action:ahu_0@supply_air_heating_temperature_setpoint"]).to_pydict()
        env = day_env(day)
        env.reset(day)
        for step, water, air in zip(steps, *logged.values(), strict=True):
            assert re.fullmatch(r"<answer>-?[01]\.\d, -?[01]\.\d</answer>", step.answer), step.answer
            result = env.step(step.answer)
            assert result.info["action_is_valid"] and not env.setpoints.clipped
            assert abs(env.setpoints.water_k - water) <= water_tol and abs(env.setpoints.air_k - air) <= air_tol
        assert len(steps) == 288 and env.done


def test_list_show_and_sample_commands(store, monkeypatch):
    from pipeline.cli import common

    monkeypatch.setattr(common.console, "_width", 200)  # rich fixes its width when the console is made: wide enough
    spec = GenerationSpec(days=2, policy="heuristic")
    generate_building_dataset(store, "two-days", spec)
    listed = runner.invoke(app, ["list", "--root", store.root, "--json"])
    assert listed.exit_code == 0 and [d["name"] for d in json.loads(listed.stdout)] == ["two-days"]
    assert json.loads(listed.stdout)[0]["rows"] == 576
    shown = runner.invoke(app, ["show", "two-days", "--fields", "--verify", "--root", store.root])
    assert shown.exit_code == 0, shown.output
    assert "zone_1_1@zone_air_temperature_sensor" in shown.output and "all 2 files match" in shown.output
    sampled = runner.invoke(app, ["sample", "two-days", "-n", "3", "--root", store.root, "--json",
                                  "--columns", "zone_0_0@zone_air_temperature_sensor"])
    rows = json.loads(sampled.stdout)
    assert [r["step"] for r in rows] == [0, 1, 2]
    first = simulate_day(0, "heuristic").telemetry[0]["zone_0_0@zone_air_temperature_sensor"]
    assert rows[0]["zone_0_0@zone_air_temperature_sensor"] == first
    missing = runner.invoke(app, ["show", "nope", "--root", store.root])
    assert missing.exit_code != 0 and "no dataset 'nope'" in missing.output and "Traceback" not in missing.output


# ---- token trajectories ---------------------------------------------------------------------------


def test_plan_batches_covers_every_turn_once_per_epoch():
    plan = plan_batches([10, 7, 10], episodes_per_batch=2, turns_per_batch=4, epochs=2, seed=1)
    items = [item for batch in plan for item in batch]
    expected = {(e, t) for e, n in enumerate([10, 7, 10]) for t in range(n)}
    assert len(items) == 2 * len(expected) and set(items) == expected
    for batch in plan:  # a batch holds the same turns of its episodes (a baseline compares them)
        assert len({e for e, _ in batch}) <= 2
        turns_by_episode = {}
        for e, t in batch:
            turns_by_episode.setdefault(e, set()).add(t)
        assert len({min(turns) for turns in turns_by_episode.values()}) == 1


def test_to_trajectories_writes_the_online_prompt_and_the_logged_answer(store, tiny_tokenizer):
    from producers.episode import prompt_ids

    spec = GenerationSpec(days=2, policy="heuristic", first_day=0)
    card = generate_building_dataset(store, "heur", spec)
    options = TrajectoryOptions(episodes_per_batch=2, turns_per_batch=8, history_turns=1, discount=0.9,
                                answer_decimals=1)  # the heuristic's own answers have one decimal
    report = dataset_to_trajectories(store, "heur", "heur-data", tiny_tokenizer, options)
    assert report.rows == 576 and report.episodes == 2 and report.batches == 36
    archive = TrajectoryArchive(store)
    rows = [r for key in archive.list_batches("heur-data") for r in archive.read_batch(key).to_pylist()]
    assert len(rows) == 576 and len({(r["episode_id"], r["turn"]) for r in rows}) == 576
    logs = {day: simulate_day(day, "heuristic", 0, keep_text=True) for day in (0, 1)}
    system = day_env(0).system_prompt()
    for row in rows[::37]:
        day_log, k = logs[row["env_seed"]], row["turn"]
        messages = [{"role": "system", "content": system}]
        if k > 0:
            messages += [{"role": "user", "content": day_log.observations[k - 1]},
                         {"role": "assistant", "content": day_log.answers[k - 1]}]
        messages.append({"role": "user", "content": day_log.observations[k]})
        prompt = prompt_ids(tiny_tokenizer, messages)
        assert row["tokens"][:len(prompt)] == prompt
        answer = [t for t, m in zip(row["tokens"], row["loss_mask"], strict=True) if m]
        eos = tiny_tokenizer.eos_token_id
        assert answer == [*tiny_tokenizer.encode(day_log.answers[k], add_special_tokens=False), eos]
        assert row["loss_mask"] == [0] * len(prompt) + [1] * len(answer)
        assert row["logprobs"] == [0.0] * len(row["tokens"]) and row["policy_version"] == 0
        rewards = [r["reward@reward"] for r in day_log.telemetry[1:]]
        assert row["return_to_go"] == pytest.approx(sum(0.9 ** j * r for j, r in enumerate(rewards[k:])), rel=1e-5)
        assert row["reward"] == pytest.approx(sum(rewards), rel=1e-5)
        assert row["turn_rewards"] == [pytest.approx(rewards[k], rel=1e-6)]
        assert row["group_id"] == f"heur@workday@{k * 5 // 60:02d}:{k * 5 % 60:02d}"  # Thursday, Friday
    with pytest.raises(FileExistsError, match="new --run"):
        dataset_to_trajectories(store, "heur", "heur-data", tiny_tokenizer, options)
    assert card.name == "heur"
    store.delete("runs/heur-data/offline/heur.json")  # as a conversion cut short leaves it: batches, no summary
    with pytest.raises(FileExistsError, match=r"did not finish.*rlpipe runs delete --run heur-data"):
        dataset_to_trajectories(store, "heur", "heur-data", tiny_tokenizer, options)


def test_a_conversion_cut_short_is_refused_by_replay_until_it_is_deleted(store, tiny_tokenizer, monkeypatch):
    from consumers.cli import replay_app

    generate_building_dataset(store, "heur", GenerationSpec(days=1, policy="heuristic", first_day=0))
    options = TrajectoryOptions(episodes_per_batch=1, turns_per_batch=48, history_turns=0)

    def interrupted(done: int, total: int) -> None:
        if done == 2:
            raise KeyboardInterrupt  # as Ctrl-C or a killed process leaves it: two of six batches written

    with pytest.raises(KeyboardInterrupt):
        dataset_to_trajectories(store, "heur", "cut", tiny_tokenizer, options, progress=interrupted)
    assert len(TrajectoryArchive(store).list_batches("cut")) == 2
    monkeypatch.setenv("RLPIPE_HOME", str(store.root.removeprefix("file://")) + "-home")
    monkeypatch.setenv("RLPIPE_STORE__ROOT", store.root)
    for args in (["--train", "--set", "run_id=from-cut"], ["--to-topic"]):
        result = runner.invoke(replay_app, ["--run", "cut", *args, "--preset", "building-hvac"])
        line = result.output.strip()
        assert result.exit_code == 2 and "\n" not in line, result.output
        assert "did not finish" in line and "heur" in line and "rlpipe runs delete --run cut" in line
    assert not store.exists("runs/from-cut/run.json")
    whole = dataset_to_trajectories(store, "heur", "whole", tiny_tokenizer, options)
    assert whole.batches == 6 and store.list("runs/whole/offline") == ["runs/whole/offline/heur.json"]


# ---- evaluation ------------------------------------------------------------------------------------


class FixedSampler:
    """Answers every prompt with the same text (a stand-in for the language model)."""

    max_model_len = 4096

    def __init__(self, tokenizer, text):
        self.ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
        self.batches = []

    def generate(self, requests, adapter=None, temperature=1.0, top_p=1.0, seed=None):
        self.batches.append(len(requests))
        return [SampleOutput(list(self.ids), [0.0] * len(self.ids), "stop") for _ in requests]


SHORT = {"episode_days": 6 / 288, "history_turns": 0}  # 6 steps


def test_model_outcomes_match_a_scripted_run_of_the_same_answers(tiny_tokenizer):
    sampler = FixedSampler(tiny_tokenizer, "<answer>330K, 292K</answer>")
    outcomes = model_outcomes(sampler, tiny_tokenizer, None, [3, 4], SHORT, SamplingSettings(max_new_tokens=16))
    assert sampler.batches == [2] * 6  # both days in lockstep, one batch per turn
    for outcome in outcomes:
        env = day_env(outcome.day, SHORT)
        expected = run_episode(env, lambda e: "<answer>330K, 292K</answer>", outcome.day)
        assert outcome.episode_return == pytest.approx(expected.episode_return, abs=1e-12)
        assert outcome.steps == 6 and outcome.invalid == 0
    # invalid answers hold the setpoints (340 K, 285 K at the start) and still pay the format penalty
    garbled = model_outcomes(FixedSampler(tiny_tokenizer, "I am not sure"), tiny_tokenizer, None, [3], SHORT)
    held = run_episode(day_env(3, SHORT), lambda e: "<answer>340K, 285K</answer>", 3)
    assert garbled[0].invalid == 6
    assert garbled[0].episode_return == pytest.approx(held.episode_return + 6 * -0.1, abs=1e-12)


def test_scripted_evaluation_breaks_out_comfort_energy_and_carbon(store):
    results = evaluate_building(store, "baseline", ["heuristic", "random"], [10, 11], env_overrides=SHORT)
    heuristic, random_ = results
    expected = [run_episode(day_env(d, SHORT), lambda e: e.heuristic_answer(), d).episode_return for d in (10, 11)]
    assert heuristic.returns == pytest.approx(expected, abs=1e-12)
    assert heuristic.seed_start == 10 and heuristic.episodes == 2 and heuristic.version == 0
    for r in results:  # reward = -(0.2 comfort + 0.4 energy + 0.4 carbon) per step, so per day too
        b = r.breakdown
        assert r.mean_return == pytest.approx(-(0.2 * b["comfort"] + 0.4 * b["energy"] + 0.4 * b["carbon"]), rel=1e-9)
        assert b["invalid_rate"] == 0.0 and b["energy_usd"] > 0
    keys = store.list("runs/baseline/eval")
    assert len(keys) == 2 and any("/heuristic-v000000-seed10-" in k for k in keys)
    assert random_.returns != heuristic.returns
    assert scripted_outcomes(lambda d: "heuristic", [10], 0, SHORT)[0].episode_return == expected[0]


# ---- end to end: generate -> import -> to-trajectories -> replay --train (awr) -> adapter -> eval -----


@pytest.fixture
def one_torch_thread():
    """Two torch threads on two shared, busy cores spin against each other (tens of times slower)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_generate_convert_train_with_awr_publish_and_evaluate(tmp_path, tiny_model_dir, monkeypatch, one_torch_thread):
    from consumers.cli import replay_app

    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    root = (tmp_path / "store").as_uri()
    result = runner.invoke(app, ["generate", "building-hvac", "--days", "2", "--policy", "mixed", "--seed", "4",
                                 "--name", "e2e", "--root", root])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["to-trajectories", "e2e", "--run", "e2e-data", "--model", tiny_model_dir,
                                 "--episodes-per-batch", "2", "--turns-per-batch", "3", "--history-turns", "0",
                                 "--answer-format", "normalized", "--root", root])
    assert result.exit_code == 0, result.output
    assert "rlpipe replay --run e2e-data --train" in result.output
    from transformers import AutoTokenizer

    tokenizer, archive = AutoTokenizer.from_pretrained(tiny_model_dir), TrajectoryArchive(ObjectStore(root))
    rows = archive.read_batch(archive.list_batches("e2e-data")[0]).to_pylist()
    for row in rows:  # the trained answer: the logged setpoints normalised, with one decimal, then end of turn
        answer = tokenizer.decode([t for t, m in zip(row["tokens"], row["loss_mask"], strict=True) if m])
        assert re.fullmatch(r"<answer>-?[01]\.\d, -?[01]\.\d</answer><\|im_end\|>", answer), answer
    result = runner.invoke(replay_app, [
        "--run", "e2e-data", "--train", "--preset", "building-hvac", "--set", "run_id=e2e-awr",
        "--set", f"store.root={root}", "--set", f"model.base_model={tiny_model_dir}",
        "--set", "learner.loss=awr", "--set", "learner.advantage=return_to_go", "--set", "learner.batch_rows=6",
        "--set", "learner.max_steps=2", "--set", "learner.max_staleness=1000", "--set", "learner.lora_rank=4",
    ])
    assert result.exit_code == 0, result.output
    for handler in list(logging.root.handlers):  # replay's log handler printed into that command's output
        logging.root.removeHandler(handler)
    store = ObjectStore(root)
    registry = AdapterRegistry(store, "e2e-awr")
    assert registry.versions() == [1, 2]
    assert registry.show(2).metrics["rows"] == 6  # one batch (2 days x 3 turns) per step
    result = runner.invoke(app, ["eval-building", "--run", "e2e-awr", "--dataset", "e2e", "--model", tiny_model_dir,
                                 "--days", "1", "--policies", "adapter,behaviour", "--set", "episode_days=0.01",
                                 "--history-turns", "0", "--root", root, "--json"])
    assert result.exit_code == 0, result.output
    evaluated = json.loads(result.stdout)
    assert [(r["policy"], r["version"], r["seed_start"]) for r in evaluated] == [("adapter", 2, 2), ("behaviour", 0, 2)]
    assert all(math.isfinite(r["mean_return"]) and "energy" in r["breakdown"] for r in evaluated)
    assert len(store.list("runs/e2e-awr/eval")) == 2


def test_a_varied_log_draws_the_heuristics_preheat_per_day():
    spec = GenerationSpec(days=12, policy="varied", seed=3, preheat_hours=(2.0, 4.0))
    labels = [day_policy(spec, day) for day in range(12)]
    assert set(labels) == {"heuristic-2h", "heuristic-4h"}  # both drawn in 12 days
    assert labels == [day_policy(spec, day) for day in range(12)]  # reproducibly
    # day 0 is a Thursday: the same answers until 02:00 local, then the 4-hour day warms the building first
    two, four = simulate_day(0, "heuristic-2h"), simulate_day(0, "heuristic-4h")
    assert two.answers[:24] == four.answers[:24] and two.answers[24:48] != four.answers[24:48]
    assert two.answers == simulate_day(0, "heuristic").answers  # 2 h is the heuristic's own preheat
    with pytest.raises(ValueError, match="use heuristic, heuristic-<hours>h or random"):
        simulate_day(0, "heuristic-xh")
    with pytest.raises(ValidationError):
        GenerationSpec(days=1, policy="varied", preheat_hours=())


def test_generate_takes_the_varied_logs_preheat_hours(tmp_path):
    root = (tmp_path / "store").as_uri()
    result = runner.invoke(app, ["generate", "building-hvac", "--days", "4", "--policy", "varied", "--seed", "3",
                                 "--preheat-hours", "2,4,4", "--name", "varied", "--root", root, "--json"])
    assert result.exit_code == 0, result.output
    card = read_card(ObjectStore(root), "varied")
    spec = GenerationSpec(days=4, policy="varied", seed=3, preheat_hours=(2.0, 4.0, 4.0))
    assert [e["policy"] for e in card.extras["episodes"]] == [day_policy(spec, day) for day in range(4)]
    assert {e["policy"] for e in card.extras["episodes"]} <= {"heuristic-2h", "heuristic-4h"}
    refused = runner.invoke(app, ["generate", "building-hvac", "--days", "1", "--policy", "varied",
                                  "--preheat-hours", "2,x", "--name", "bad", "--root", root])
    assert refused.exit_code == 2 and "--preheat-hours takes hours" in refused.output


# ---- the commands' mistakes and edges -------------------------------------------------------------


def _one_line_error(result, code: int = 2) -> str:
    assert result.exit_code == code and "Traceback" not in result.output, result.output
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    return result.stderr


def test_a_missing_dataset_is_bad_input_that_ends_in_one_line_and_exit_2(store):
    """As a missing run or session: the name is the user's to fix, so the commands exit 2 (a store failure exits 1)."""
    where = ["--root", store.root]
    for args in (["show", "nope"], ["sample", "nope"], ["to-trajectories", "nope", "--run", "r", "--model", "tiny"],
                 ["eval-building", "--run", "r", "--dataset", "nope", "--policies", "random", "--days", "1"]):
        error = _one_line_error(runner.invoke(app, [*args, *where]))
        assert "no dataset 'nope'" in error and "rlpipe datasets list" in error, args


def test_a_missing_model_folder_or_adapter_version_ends_in_one_line(store, tmp_path):
    generate_building_dataset(store, "short", GenerationSpec(days=1, policy="heuristic"))
    error = _one_line_error(runner.invoke(app, ["to-trajectories", "short", "--run", "r", "--model", "/nonexistent",
                                                "--root", store.root]))
    assert "base model /nonexistent: no such folder" in error and "tiny" in error
    error = _one_line_error(runner.invoke(app, ["eval-building", "--run", "r", "--model", "/nonexistent", "--days",
                                                "1", "--policies", "base", "--root", store.root]))
    assert "base model /nonexistent: no such folder" in error
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # a folder that is not a whole model: no tokenizer
    error = _one_line_error(runner.invoke(app, ["to-trajectories", "short", "--run", "r", "--model", str(model),
                                                "--root", store.root]))
    assert f"cannot load a tokenizer from {model}" in error
    registry = AdapterRegistry(store, "trained")
    for step in (1, 2):
        registry.publish_files({"adapter_config.json": b"{}", "adapter_model.safetensors": b"\0"}, str(model),
                               step - 1, step)
    evaluated = runner.invoke(app, ["eval-building", "--run", "trained", "--model", str(model), "--version", "999",
                                    "--days", "1", "--policies", "behaviour,adapter", "--dataset", "short",
                                    "--root", store.root])
    error = _one_line_error(evaluated)
    assert "run 'trained' has no adapter version 999" in error and "versions: 1, 2" in error
    assert store.list("runs/trained/eval") == []  # refused before any policy played


def test_a_run_without_adapter_versions_is_bad_input_refused_before_the_model_is_loaded(
    store, tmp_path, monkeypatch
):
    """The adapter policy needs a trained version: a run with none (or no such run) exits 2 before the base model
    is looked at, so --model tiny builds nothing (minutes, the first time) only to be refused."""
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    for base in (str(model), "tiny"):
        error = _one_line_error(runner.invoke(app, ["eval-building", "--run", "untrained", "--model", base,
                                                    "--days", "1", "--policies", "random,adapter",
                                                    "--root", store.root]))
        assert "run 'untrained' has no adapter versions" in error and "rlpipe replay --train" in error, error
    assert not (tmp_path / "home" / "models").exists()  # the tiny model was not built
    assert store.list("runs/untrained", recursive=True) == []  # random was not played and stored first

def test_the_behaviour_policy_of_a_dataset_the_simulator_did_not_log_is_refused_before_any_policy_plays(
    store, tmp_path
):
    from producers.offline.table import TableMapping, import_table

    log = tmp_path / "log.csv"
    log.write_text("time,temp,sp,r\n" + "".join(f"2024-01-01T{h:02d}:00:00Z,{20 + h},21,{-h}\n" for h in range(12)))
    import_table(store, log, "plant", TableMapping(timestamp="time", observation=["temp"], action=["sp"], reward="r"))
    evaluated = runner.invoke(app, ["eval-building", "--run", "r1", "--dataset", "plant", "--days", "1",
                                    "--policies", "heuristic,behaviour", "--root", store.root])
    error = _one_line_error(evaluated)
    assert "dataset plant was not generated by the simulator" in error
    assert store.list("runs/r1/eval", recursive=True) == []  # heuristic was not played and stored first

def test_list_flags_a_broken_card_and_still_lists_the_others(store):
    generate_building_dataset(store, "good", GenerationSpec(days=1, policy="heuristic"))
    store.put_create("datasets/bad/dataset.json", b"{not json")
    listed = runner.invoke(app, ["list", "--root", store.root])
    assert listed.exit_code == 1 and "Traceback" not in listed.output
    assert "good" in listed.stdout and "bad" in listed.stdout and "not JSON" in listed.stdout
    assert "1 dataset card cannot be read: bad" in listed.stderr
    listed = runner.invoke(app, ["list", "--root", store.root, "--json"])
    rows = {row["name"]: row for row in json.loads(listed.stdout)}
    assert listed.exit_code == 1 and rows["good"]["rows"] == 288 and "not JSON" in rows["bad"]["error"]


def test_to_trajectories_hints_the_documented_training_recipe(store, tiny_model_dir):
    from pathlib import Path

    generate_building_dataset(store, "short", GenerationSpec(days=1, policy="heuristic"))
    result = runner.invoke(app, ["to-trajectories", "short", "--run", "r", "--model", tiny_model_dir,
                                 "--history-turns", "0", "--root", store.root])
    assert result.exit_code == 0, result.output
    hint = next(line for line in result.stdout.splitlines() if line.startswith("train:"))
    doc = (Path(__file__).parents[3] / "docs" / "offline.md").read_text()
    recipe = doc[doc.index("rlpipe replay --run hvac-mixed-data"):].split("rlpipe datasets eval-building")[0]
    documented = set(re.findall(r"--set (learner\.(?:loss|advantage|awr_beta|max_staleness)=\S+)", recipe))
    assert "learner.awr_beta=2" in documented
    assert documented <= set(re.findall(r"--set (\S+)", hint)), hint


def test_to_trajectories_hints_the_rows_of_its_smallest_batch_so_each_batch_is_one_step(store, tiny_model_dir):
    """2 days of 288 turns, 7 episodes x 17 turns a batch: only 2 episodes, every 17th turn (16 phases of 17
    turns, one of 16), so 16 batches of 34 rows and one of 32; batch_rows 32 makes each batch one learner step
    (7 x 17 = 119 would train seven batches a step, 34 would join the 32-row batch to the next)."""
    generate_building_dataset(store, "short", GenerationSpec(days=2, policy="heuristic"))
    result = runner.invoke(app, ["to-trajectories", "short", "--run", "r", "--model", tiny_model_dir,
                                 "--episodes-per-batch", "7", "--turns-per-batch", "17", "--history-turns", "0",
                                 "--root", store.root])
    assert result.exit_code == 0, result.output
    archive = TrajectoryArchive(store)
    sizes = sorted(archive.read_batch(ref).num_rows for ref in archive.list_batches("r"))
    assert sizes == [32] + [34] * 16
    hint = next(line for line in result.stdout.splitlines() if line.startswith("train:"))
    assert "--set learner.batch_rows=32 " in hint, hint

def test_sample_after_the_end_says_so_and_a_single_day_has_no_interval(store):
    generate_building_dataset(store, "short", GenerationSpec(days=1, policy="heuristic"))
    sampled = runner.invoke(app, ["sample", "short", "--start", "2030-01-01", "--root", store.root])
    assert sampled.exit_code == 0
    assert "no steps of short from 2030-01-01 00:00 on" in sampled.output and "it spans" in sampled.output
    played = runner.invoke(app, ["eval-building", "--run", "base", "--dataset", "short", "--days", "1",
                                 "--policies", "behaviour,random", "--set", "episode_days=0.01", "--root", store.root])
    assert played.exit_code == 0, played.output
    assert "n/a" in played.stdout and "± 0.000" not in played.stdout
    assert "behaviour: day 1 of 1" in played.stderr  # a line per day played, off a terminal too
    played = runner.invoke(app, ["eval-building", "--run", "base", "--dataset", "short", "--days", "2",
                                 "--policies", "random", "--set", "episode_days=0.01", "--root", store.root,
                                 "--json"])
    assert played.exit_code == 0 and json.loads(played.stdout)[0]["ci95"] is not None
    played = runner.invoke(app, ["eval-building", "--run", "base", "--dataset", "short", "--days", "1",
                                 "--policies", "random", "--set", "episode_days=0.01", "--root", store.root,
                                 "--json"])
    assert played.exit_code == 0 and json.loads(played.stdout)[0]["ci95"] is None


def test_eval_building_is_refused_on_held_out_days_a_validation_played(store):
    """A validation of the run played held-out days 3-4 (counted from the dataset's first held-out day, 1 past its
    one logged day): 7 days from the first would report on what runs were chosen on, so nothing is played or stored
    and the one line names the days and the --days and --first-day that keep off them.  2 days still play."""
    from producers.evaluation import save_validation
    from producers.offline.evaluation import held_out_days
    from schemas.evaluation import ValidationPlayed

    generate_building_dataset(store, "short", GenerationSpec(days=1, policy="heuristic"))
    first = held_out_days(read_card(store, "short"), 1)[0]
    save_validation(store, ValidationPlayed(run_id="chosen", env=BuildingHVAC.name, seed_start=first + 2, episodes=2))
    play = ["eval-building", "--run", "chosen", "--dataset", "short", "--policies", "random",
            "--set", "episode_days=0.01", "--root", store.root]
    error = _one_line_error(runner.invoke(app, [*play, "--days", "7"]))
    assert f"held-out days {first + 2}-{first + 3}" in error and "--days 2 or fewer" in error, error
    assert f"--first-day {first + 4}" in error, error
    assert store.list("runs/chosen/eval", recursive=True) == []
    played = runner.invoke(app, [*play, "--days", "2", "--json"])
    assert played.exit_code == 0, played.output
    assert [r["seed_start"] for r in json.loads(played.stdout)] == [first]
    assert len(store.list("runs/chosen/eval", recursive=True)) == 1


def test_the_docs_recipe_uses_the_benchmarks_history_and_temperature():
    from pathlib import Path

    from bench.offline_building import parse_args

    bench = parse_args([])
    doc = (Path(__file__).parents[3] / "docs" / "offline.md").read_text()
    recipe = doc[:doc.index("## In the store")]
    for command in ("rlpipe datasets to-trajectories", "rlpipe datasets eval-building"):
        line = recipe[recipe.index(command):].split("\nrlpipe ")[0]
        assert f"--history-turns {bench.history_turns}" in line, line
    evaluation = recipe[recipe.index("rlpipe datasets eval-building"):].split("```")[0]
    assert "--temperature 0.5" in evaluation and "0.5" in bench.temperatures.split(",")


def test_generate_refuses_a_taken_or_bad_name_before_simulating_a_day(store, tmp_path):
    generate_building_dataset(store, "taken", GenerationSpec(days=1, policy="heuristic"))
    simulated = []
    for name, error in (("taken", FileExistsError), ("../up", ValueError)):
        with pytest.raises(error, match=r"choose another --name|dataset name"):
            generate_building_dataset(store, name, GenerationSpec(days=30, policy="heuristic"), tmp_path / "raw",
                                      progress=lambda done, total: simulated.append(done))
    assert simulated == [] and not (tmp_path / "raw").exists()  # refused up front: no day simulated, nothing written


def test_a_second_conversion_into_a_run_is_refused_before_the_dataset_is_read(store, tiny_tokenizer):
    generate_building_dataset(store, "heur", GenerationSpec(days=1, policy="heuristic", first_day=0))
    options = TrajectoryOptions(episodes_per_batch=1, turns_per_batch=48, history_turns=0)
    dataset_to_trajectories(store, "heur", "once", tiny_tokenizer, options)
    store.put_create("runs/cut/offline/heur.converting", b"{}\n")  # a conversion into run cut that did not finish
    store.delete("datasets/heur/steps", recursive=True)  # reading the days now fails: the refusal must come first
    with pytest.raises(FileExistsError, match="run once already holds dataset heur"):
        dataset_to_trajectories(store, "heur", "once", tiny_tokenizer, options)
    with pytest.raises(FileExistsError, match="conversion of dataset heur into run cut did not finish"):
        dataset_to_trajectories(store, "heur", "cut", tiny_tokenizer, options)


def test_a_raw_dir_that_is_a_file_is_refused_before_the_simulation(store, tmp_path):
    taken = tmp_path / "notes.txt"
    taken.write_text("kept")
    result = runner.invoke(app, ["generate", "building-hvac", "--days", "1", "--name", "sim", "--raw-dir", str(taken),
                                 "--root", store.root])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert f"--raw-dir {taken} is a file, not a folder" in result.output and taken.read_text() == "kept"


@pytest.mark.parametrize(("run", "message"), [
    ("A B", "run_id 'A B' is not allowed"),
    ("trained", "run trained is a training run (it has a run.json); convert into a run of its own"),
])
def test_a_run_that_cannot_take_the_conversion_is_refused_before_the_model_loads(store, monkeypatch, run, message):
    """Loading the model (building tiny takes minutes) comes after the run is known to be a fit."""
    from producers.offline import cli

    def load(model: str) -> str:
        raise AssertionError("the model was loaded before the run was checked")

    monkeypatch.setattr(cli, "_model_path", load)
    generate_building_dataset(store, "sim", GenerationSpec(days=1, policy="heuristic"))
    store.put("runs/trained/run.json", b"{}")
    result = runner.invoke(app, ["to-trajectories", "sim", "--run", run, "--model", "tiny", "--root", store.root])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert message in result.output
    assert not store.exists("runs/trained/offline/sim.converting")
