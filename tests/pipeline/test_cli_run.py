"""`rlpipe run`: a fresh run by default, an existing one only with --resume, and a finished one says so.

The launcher is replaced by a stand-in that records the configuration it was given
and creates the run in the store as the real one does, so nothing is started.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from typer.testing import CliRunner

from consumers.checkpoint import CheckpointStore
from pipeline.analysis.runs import summarize
from pipeline.cli.run_cmd import app
from pipeline.devstack import launcher
from pipeline.runtime import create_run, open_store
from schemas.checkpoint import LearnerState
from schemas.config import RunConfig

runner = CliRunner()


class FakeLauncher:
    launched: ClassVar[list[RunConfig]] = []
    live = False

    def __init__(self, config: RunConfig | list[RunConfig], dashboard: bool = True) -> None:
        self.configs = config if isinstance(config, list) else [config]

    def run(self) -> int:
        for config in self.configs:
            create_run(open_store(config.store), config, config.model.base_model)
        FakeLauncher.launched.extend(self.configs)
        return 0


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private RLPIPE_HOME (its store is the default), no broker from the environment, the stand-in launcher."""
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    for name in ("RLPIPE_BUS__BOOTSTRAP_SERVERS", "RLPIPE_STORE__ROOT", "RLPIPE_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(launcher, "Launcher", FakeLauncher)
    FakeLauncher.launched = []
    return tmp_path / "home"


def _run(*args: str) -> Any:
    return runner.invoke(app, ["--no-dashboard", *args])


def test_each_run_is_a_fresh_one_named_after_the_preset_and_the_time(home: Path) -> None:
    first, second = _run("--preset", "cartpole", "--max-steps", "2"), _run("--preset", "cartpole", "--max-steps", "2")
    assert first.exit_code == 0 and second.exit_code == 0, first.output + second.output
    ids = [config.run_id for config in FakeLauncher.launched]
    assert all(re.fullmatch(r"cartpole-\d{8}-\d{6}(-\d+)?", run_id) for run_id in ids), ids
    assert ids[0] != ids[1]
    assert f"run {ids[0]}" in first.output
    assert "no --preset or --config" not in first.output
    defaults = _run("--max-steps", "2")  # neither: the built-in defaults, and it says so
    assert defaults.exit_code == 0 and "no --preset or --config: the built-in defaults" in defaults.output


def test_a_named_run_is_created_once_and_then_only_resumed_when_asked(home: Path) -> None:
    assert _run("--preset", "cartpole", "--run", "mine", "--max-steps", "3").exit_code == 0
    again = _run("--preset", "cartpole", "--run", "mine")
    assert again.exit_code == 2 and "--resume mine" in again.output and "\n" not in again.output.strip()
    by_set = _run("--preset", "cartpole", "--set", "run_id=mine")
    assert by_set.exit_code == 2 and "--resume mine" in by_set.output
    assert [c.run_id for c in FakeLauncher.launched] == ["mine"]

    assert "rlpipe report --run mine" in _run("--resume", "mine", "--max-steps", "4").output  # what to do next
    resumed = _run("--resume", "mine", "--set", "learner.learning_rate=0.01")
    assert resumed.exit_code == 0, resumed.output
    config = FakeLauncher.launched[-1]
    assert config.run_id == "mine" and config.learner.max_steps == 4 and config.learner.learning_rate == 0.01
    alone = _run("--resume", "mine", "--producers", "0")
    assert "note: no producers" in alone.output and "rlpipe producer start --run mine" in alone.output
    assert config.env.name == "cartpole"  # the run's own configuration, not the defaults


def test_resuming_a_finished_run_says_how_to_continue(home: Path) -> None:
    assert _run("--preset", "cartpole", "--run", "done", "--max-steps", "2").exit_code == 0
    store = open_store(FakeLauncher.launched[0].store)
    tensors = {"w": torch.zeros(1)}
    CheckpointStore(store, "done").save(LearnerState(step=2, version=2), tensors, tensors, {})
    finished = _run("--resume", "done")
    assert finished.exit_code == 0, finished.output
    lines = finished.output.strip().splitlines()
    assert len(lines) == 1 and "already reached its max_steps (2)" in lines[0]
    assert "--resume done --max-steps" in lines[0] and "rlpipe run --preset" in lines[0]
    assert len(FakeLauncher.launched) == 1  # nothing started
    more = _run("--resume", "done", "--max-steps", "4")
    assert more.exit_code == 0 and FakeLauncher.launched[-1].learner.max_steps == 4


def test_a_resume_that_raised_max_steps_is_the_runs_budget_from_then_on(home: Path) -> None:
    assert _run("--preset", "cartpole", "--run", "grown", "--max-steps", "2").exit_code == 0
    store = open_store(FakeLauncher.launched[0].store)
    tensors = {"w": torch.zeros(1)}
    CheckpointStore(store, "grown").save(LearnerState(step=2, version=2), tensors, tensors, {})
    assert _run("--resume", "grown", "--max-steps", "3").exit_code == 0
    CheckpointStore(store, "grown").save(LearnerState(step=3, version=3), tensors, tensors, {})

    finished = _run("--resume", "grown")  # the budget is the 3 of the last resume, not run.json's 2
    assert finished.exit_code == 0 and "already reached its max_steps (3)" in finished.output, finished.output
    assert len(FakeLauncher.launched) == 2
    summary = summarize(store, "grown", None, log_read=False)
    assert (summary.steps, summary.max_steps, summary.status) == (3, 3, "finished")
    more = _run("--resume", "grown", "--set", "learner.learning_rate=0.01")  # raised again by a later change
    assert more.exit_code == 0 and "already reached" in more.output and len(FakeLauncher.launched) == 2


def test_resume_mistakes_are_one_line(home: Path) -> None:
    missing = _run("--resume", "nope")
    assert missing.exit_code == 2 and "no run 'nope'" in missing.output
    both = _run("--resume", "nope", "--preset", "cartpole")
    assert both.exit_code == 2 and "--set" in both.output
    named = _run("--resume", "nope", "--run", "other")
    assert named.exit_code == 2


def test_runs_n_starts_n_packed_runs_each_with_its_own_seed(home: Path) -> None:
    result = _run("--preset", "cartpole", "--run", "trio", "--runs", "3", "--max-steps", "2")
    assert result.exit_code == 0, result.output
    configs = FakeLauncher.launched
    assert [c.run_id for c in configs] == ["trio-1", "trio-2", "trio-3"]
    assert all(c.learner.max_steps == 2 and c.env.name == "cartpole" for c in configs)
    preset = RunConfig()  # cartpole keeps the default seeds
    assert [c.learner.seed for c in configs] == [preset.learner.seed, 1, 2]  # run i: recipe seed i - 1
    assert [c.sampler.seed for c in configs] == [preset.sampler.seed, 1, 2]
    assert len({c.producer.seed_start for c in configs}) == 3
    assert "rlpipe report --run trio-1 --run trio-2 --run trio-3" in result.output

    again = _run("--preset", "cartpole", "--run", "trio", "--runs", "2")
    assert again.exit_code == 2 and "trio-1, trio-2 already exist" in again.output
    assert "\n" not in again.output.strip()
    assert len(FakeLauncher.launched) == 3


def test_runs_n_takes_a_fresh_name_and_every_set(home: Path) -> None:
    result = _run("--preset", "cartpole", "--runs", "2", "--set", "learner.seed=7")
    assert result.exit_code == 0, result.output
    ids = [c.run_id for c in FakeLauncher.launched]
    assert re.fullmatch(r"cartpole-\d{8}-\d{6}-1", ids[0]) and ids[1] == ids[0][:-1] + "2", ids
    assert [c.learner.seed for c in FakeLauncher.launched] == [7, 7]  # a --set seed applies to every run


def test_runs_n_refuses_what_it_cannot_pack(home: Path) -> None:
    resumed = _run("--resume", "x", "--runs", "2")
    assert resumed.exit_code == 2 and "--runs starts new runs" in resumed.output
    value = _run("--preset", "slateq-recsim", "--runs", "2")
    assert value.exit_code == 2 and "value-based runs are not packed" in value.output
    assert FakeLauncher.launched == []


def test_several_presets_start_one_packed_run_each(home: Path) -> None:
    result = _run("--preset", "cartpole", "--preset", "acrobot", "--max-steps", "2")
    assert result.exit_code == 0, result.output
    configs = FakeLauncher.launched
    assert [c.env.name for c in configs] == ["cartpole", "acrobot"]
    ids = [c.run_id for c in configs]
    assert re.fullmatch(r"cartpole-\d{8}-\d{6}", ids[0]) and ids[1] == "acrobot" + ids[0][len("cartpole"):], ids
    assert all(c.learner.max_steps == 2 for c in configs)
    assert [c.learner.seed for c in configs] == [RunConfig().learner.seed] * 2  # each preset's own seeds
    assert f"rlpipe report --run {ids[0]} --run {ids[1]}" in result.output


def test_several_presets_with_runs_n_and_a_name(home: Path) -> None:
    result = _run("--preset", "cartpole", "--preset", "demo", "--run", "mix", "--runs", "2", "--producers", "1")
    assert result.exit_code == 0, result.output
    configs = FakeLauncher.launched
    assert [c.run_id for c in configs] == ["mix-cartpole-1", "mix-cartpole-2", "mix-demo-1", "mix-demo-2"]
    assert [c.learner.seed for c in configs][1::2] == [1, 1]  # run i of each preset: recipe seed i - 1
    assert {c.num_producers for c in configs} == {1}


def test_several_config_files_keep_their_own_run_ids(home: Path, tmp_path: Path) -> None:
    files = []
    for name, env in (("left", "cartpole"), ("right", "sokoban")):
        path = tmp_path / f"{name}.yaml"
        path.write_text(f"run_id: {name}\nenv:\n  name: {env}\nnum_producers: {2 if name == 'right' else 1}\n")
        files += ["--config", str(path)]
    result = _run(*files, "--max-steps", "3")
    assert result.exit_code == 0, result.output
    configs = FakeLauncher.launched
    assert [(c.run_id, c.env.name) for c in configs] == [("left", "cartpole"), ("right", "sokoban")]
    assert {c.num_producers for c in configs} == {2}  # producer processes serve every run: the most any asks for


def test_packed_runs_are_looked_for_each_in_its_own_store(home: Path, tmp_path: Path) -> None:
    files = []
    for name in ("left", "right"):
        path = tmp_path / f"{name}.yaml"
        path.write_text(f"run_id: {name}\nstore:\n  root: file://{tmp_path / name}-store\n")
        files += ["--config", str(path)]
    alone = _run(files[-2], files[-1], "--max-steps", "2")  # the right run, on its own, in its store
    assert alone.exit_code == 0, alone.output
    packed = _run(*files, "--max-steps", "2")
    assert packed.exit_code == 2 and "right already exist" in packed.output, packed.output
    assert [c.run_id for c in FakeLauncher.launched] == ["right"]


def test_several_kinds_are_named_by_preset_or_file_whatever_the_environment_names(
        home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLPIPE_RUN_ID", "envid")  # acts as --run NAME for every kind
    result = _run("--preset", "cartpole", "--preset", "acrobot", "--max-steps", "2")
    assert result.exit_code == 0, result.output
    assert [c.run_id for c in FakeLauncher.launched] == ["envid-cartpole", "envid-acrobot"]
    monkeypatch.delenv("RLPIPE_RUN_ID")
    files = []
    for name in ("left", "right"):
        path = tmp_path / f"{name}.yaml"
        path.write_text("learner:\n  learning_rate: 0.001\n")  # no run_id of its own
        files += ["--config", str(path)]
    result = _run("--preset", "cartpole", *files, "--run", "pair")
    assert result.exit_code == 0, result.output
    assert [c.run_id for c in FakeLauncher.launched[2:]] == ["pair-left", "pair-right"]


def test_several_presets_refuse_what_they_cannot_pack(home: Path, tmp_path: Path) -> None:
    twice = _run("--preset", "cartpole", "--preset", "cartpole")
    assert twice.exit_code == 2 and "--runs" in twice.output and "\n" not in twice.output.strip()
    value = _run("--preset", "cartpole", "--preset", "dqn-cartpole")
    assert value.exit_code == 2 and "value-based runs are not packed" in value.output
    other = tmp_path / "other.yaml"
    other.write_text("run_id: other\nmodel:\n  base_model: /models/another\n")
    mine = tmp_path / "mine.yaml"
    mine.write_text("run_id: mine\n")
    differ = _run("--config", str(mine), "--config", str(other))
    assert differ.exit_code == 2 and "model.base_model" in differ.output and "\n" not in differ.output.strip()
    both = _run("--preset", "cartpole", "--preset", "acrobot", "--config", str(mine), "--config", str(other))
    assert both.exit_code == 2 and "not both" in both.output
    resumed = _run("--resume", "x", "--preset", "cartpole", "--preset", "acrobot")
    assert resumed.exit_code == 2
    assert FakeLauncher.launched == []


def test_a_packed_launch_gives_every_producer_process_every_run(tmp_path: Path) -> None:
    args = [launcher.packed_producer_args(["a.yaml", "b.yaml"], index) for index in range(2)]
    assert args[0][:6] == ["producer", "start", "--config", "a.yaml", "--config", "b.yaml"]
    ids = [a.split("=", 1)[1] for arg in args for a in arg if a.startswith("producer.producer_id=")]
    assert ids == ["packed-p0", "packed-p1"]
    config = RunConfig()
    ranges = [config.training_seeds(producer_id) for producer_id in ids]
    assert not set(ranges[0]) & set(ranges[1])  # the ordinal keeps the processes' seeds apart


def test_resuming_a_value_run_that_reached_its_budget_says_so(home: Path) -> None:
    """A value run's budget is value.learner.max_steps: a resume past it starts nothing, as a LoRA run's."""
    assert _run("--preset", "dqn-cartpole", "--run", "vdone", "--max-steps", "2").exit_code == 0
    assert FakeLauncher.launched[0].value.learner.max_steps == 2
    store = open_store(FakeLauncher.launched[0].store)
    tensors = {"w": torch.zeros(1)}
    CheckpointStore(store, "vdone").save(LearnerState(step=2, version=2), tensors, tensors, {})
    finished = _run("--resume", "vdone")
    assert finished.exit_code == 0 and "already reached its max_steps (2)" in finished.output, finished.output
    assert len(FakeLauncher.launched) == 1
    # its fresh run is the preset it was made from (not the cartpole preset its environment is named after)
    fresh = finished.output.split("start a fresh run with `", 1)[1].split("`", 1)[0]
    assert fresh == "rlpipe run --preset dqn-cartpole --set value.learner.max_steps=2", fresh


def test_a_finished_runs_fresh_command_carries_the_options_it_was_started_with(home: Path) -> None:
    """The suggested fresh run is the recorded one under a new name: the same preset and every field its run.json
    holds apart from the preset's (the --set and --max-steps it was started with), placement and name left out."""
    import shlex

    from pipeline.runtime import config_differences

    started = _run("--preset", "cartpole", "--run", "tuned", "--max-steps", "2", "--set", "learner.learning_rate=0.01",
                   "--set", "sampler.temperature=0.5", "--producers", "2")
    assert started.exit_code == 0, started.output
    original = FakeLauncher.launched[0]
    store = open_store(original.store)
    tensors = {"w": torch.zeros(1)}
    CheckpointStore(store, "tuned").save(LearnerState(step=2, version=2), tensors, tensors, {})
    finished = _run("--resume", "tuned")
    assert finished.exit_code == 0 and len(FakeLauncher.launched) == 1, finished.output
    fresh = finished.output.split("start a fresh run with `", 1)[1].split("`", 1)[0]
    assert "learner.learning_rate=0.01" in fresh and "sampler.temperature=0.5" in fresh and "run_id" not in fresh
    words = shlex.split(fresh)
    assert words[:4] == ["rlpipe", "run", "--preset", "cartpole"], fresh
    again = _run(*words[2:])
    assert again.exit_code == 0, again.output
    copy = FakeLauncher.launched[-1]
    assert copy.run_id != "tuned"
    differences = config_differences(original.model_dump(mode="json"), copy.model_dump(mode="json"))
    assert [change.field for change in differences] == ["run_id"], differences


def test_packed_runs_whose_adapters_the_first_runs_sampling_engine_cannot_load_are_refused(home: Path,
                                                                                         tmp_path: Path) -> None:
    """The packed producers' one engine takes the first run's sampler settings: a run training at a rank above its
    sampler.max_lora_rank is refused in one line before anything starts, as the packed producer would refuse it."""
    mine, wide = tmp_path / "mine.yaml", tmp_path / "wide.yaml"
    mine.write_text("run_id: mine\n")  # learner.lora_rank 8, sampler.max_lora_rank 8
    wide.write_text("run_id: wide\nlearner:\n  lora_rank: 16\nsampler:\n  max_lora_rank: 16\n")
    refused = _run("--config", str(mine), "--config", str(wide), "--max-steps", "2")
    assert refused.exit_code == 2, refused.output
    assert "sampler.max_lora_rank 8" in refused.output and "\n" not in refused.output.strip()
    assert FakeLauncher.launched == []
    widest_first = _run("--config", str(wide), "--config", str(mine), "--max-steps", "2")
    assert widest_first.exit_code == 0, widest_first.output
    assert [c.run_id for c in FakeLauncher.launched] == ["wide", "mine"]


@pytest.mark.parametrize("change", ["env.name=acrobot", "value.num_actions=3", "value.slate.slate_size=3"])
def test_a_value_run_whose_environment_does_not_fit_its_network_is_refused_before_anything_starts(
    home: Path, change: str
) -> None:
    """The actors refuse such an environment only once started (the launcher then reports a producer exit and a
    log to read); ``rlpipe run`` refuses it first, in one line naming the fields to fix."""
    preset = "slateq-recsim" if change.startswith("value.slate") else "dqn-cartpole"
    result = _run("--preset", preset, "--set", change, "--max-steps", "2")
    assert result.exit_code != 0 and FakeLauncher.launched == [], result.output
    assert "value." in result.output and len(result.output.strip().splitlines()) == 1, result.output


def test_resuming_a_run_folder_without_run_json_says_what_it_lacks(home: Path, tmp_path: Path) -> None:
    store = open_store(RunConfig.model_validate({"store": {"root": (tmp_path / "store").as_uri()}}).store)
    store.put("runs/recorded/trajectories/date=2026-01-01/part-0.parquet", b"rows")  # as envs record leaves it
    result = _run("--resume", "recorded", "--set", f"store.root={store.root}")
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert f"run 'recorded' in {store.root} has no run.json" in result.output and "no run 'recorded'" not in result.output
    assert FakeLauncher.launched == []


def test_a_resume_that_changes_what_defines_the_run_is_refused_before_anything_starts(
        home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not after the embedded stack started and the tiny model was built: the stored configuration says it now."""
    assert _run("--preset", "cartpole", "--run", "kept", "--max-steps", "2").exit_code == 0

    class NoLaunch:
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise AssertionError("the launcher started before the change was refused")

    monkeypatch.setattr(launcher, "Launcher", NoLaunch)
    changed = _run("--resume", "kept", "--set", "env.name=sokoban")
    assert changed.exit_code == 2 and len(changed.output.strip().splitlines()) == 1, changed.output
    assert 'run kept was created with env.name="cartpole", this configuration says "sokoban"' in changed.output


def test_packed_runs_on_two_builds_of_the_tiny_model_are_refused_before_anything_starts(home: Path,
                                                                                      tmp_path: Path) -> None:
    """Two runs naming base_model 'tiny' are one base model only when their tiny_dir folders hold one build (a run
    naming no folder has the default build's): the packed learner and producer would each refuse the second run
    once started, so the pre-check refuses it first, in one line naming both builds.  The same build in another
    folder is packed."""
    from pipeline.models import MARKER_FILE
    from producers.tiny_model import default_tiny_dir

    builds = {"one": "0123456789abcdef", "two": "fedcba9876543210", "again": "0123456789abcdef"}
    files = {}
    for name, build in builds.items():
        folder = tmp_path / "models" / name  # folders not named after their build: the markers say which it is
        folder.mkdir(parents=True)
        (folder / MARKER_FILE).write_text(f'{{"spec_hash": "{build}"}}')
        files[name] = tmp_path / f"{name}.yaml"
        files[name].write_text(f"run_id: {name}\nmodel:\n  base_model: tiny\n  tiny_dir: {folder}\n")
    refused = _run("--config", str(files["one"]), "--config", str(files["two"]), "--max-steps", "2")
    assert refused.exit_code == 2, refused.output
    assert "fedcba9876543210" in refused.output and "0123456789abcdef" in refused.output, refused.output
    assert "\n" not in refused.output.strip()
    assert FakeLauncher.launched == []

    default = tmp_path / "default.yaml"  # no tiny_dir: the default build, which the launcher builds
    default.write_text("run_id: default\nmodel:\n  base_model: tiny\n")
    other_than_default = _run("--config", str(default), "--config", str(files["one"]), "--max-steps", "2")
    assert other_than_default.exit_code == 2, other_than_default.output
    assert default_tiny_dir().name.removeprefix("tiny-") in other_than_default.output
    assert FakeLauncher.launched == []

    same_build = _run("--config", str(files["one"]), "--config", str(files["again"]), "--max-steps", "2")
    assert same_build.exit_code == 0, same_build.output
    assert [c.run_id for c in FakeLauncher.launched] == ["one", "again"]


def test_a_packed_run_naming_no_tiny_folder_is_compared_with_the_learners_recorded_build_too(home: Path,
                                                                                            tmp_path: Path) -> None:
    """When the first run names its tiny_dir, the launcher builds that folder and leaves the recorded tiny model as
    it is: a run naming none is then the recorded build to the learner (the default build to the producers), so a
    recorded build other than the first run's is refused before anything starts."""
    from pipeline.models import MARKER_FILE, record_tiny_model
    from producers.tiny_model import default_tiny_dir

    first = tmp_path / "first.yaml"  # the default build, named explicitly: the producers' default for run 'plain'
    first.write_text(f"run_id: first\nmodel:\n  base_model: tiny\n  tiny_dir: {default_tiny_dir()}\n")
    plain = tmp_path / "plain.yaml"
    plain.write_text("run_id: plain\nmodel:\n  base_model: tiny\n")
    older = tmp_path / "models" / "older"
    older.mkdir(parents=True)
    (older / MARKER_FILE).write_text('{"spec_hash": "fedcba9876543210"}')
    record_tiny_model(older)  # what an earlier build recorded on this machine
    refused = _run("--config", str(first), "--config", str(plain), "--max-steps", "2")
    assert refused.exit_code == 2 and "fedcba9876543210" in refused.output, refused.output
    assert FakeLauncher.launched == []
    record_tiny_model(default_tiny_dir())
    packed = _run("--config", str(first), "--config", str(plain), "--max-steps", "2")
    assert packed.exit_code == 0, packed.output
