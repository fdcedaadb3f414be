"""``rlpipe replay --train`` for a value run: the value learner fed by the stored steps batches, no broker."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from consumers.cli import replay_app
from consumers.value.service import replay_train_value
from pipeline.config import load_preset
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from producers.envs.classic import CartPole
from producers.value_actor import ValueActor, ValueNetworkWatcher
from schemas.config import RunConfig
from schemas.value import ValueActorConfig

BATCHES = 4


def actors_batches(tmp_path: Path, run_id: str) -> tuple[ObjectStore, dict]:
    """BATCHES steps batches of CartPole under run "actors", and the dqn-cartpole preset for ``run_id`` on that store."""
    store = ObjectStore((tmp_path / "store").as_uri())
    actor = ValueActor(run_id="actors", actor_id="a0", env=CartPole(), archive=TrajectoryArchive(store),
                       watcher=ValueNetworkWatcher(AdapterRegistry(store, "actors"), tmp_path / "cache"),
                       config=ValueActorConfig(steps_per_batch=50))
    for _ in range(BATCHES):
        actor.write_batch()
    raw = load_preset("dqn-cartpole")
    raw["run_id"] = run_id
    raw["store"] = {"root": (tmp_path / "store").as_uri()}
    return store, raw


def test_replay_train_trains_a_value_run_from_the_stored_batches_once(tmp_path: Path) -> None:
    _, raw = actors_batches(tmp_path, "offline-dqn")
    raw["value"]["learner"].update(min_replay_size=32, batch_size=16, checkpoint_every=3, publish_every=3)
    config = RunConfig.model_validate(raw)
    learner = replay_train_value(config, "actors")
    assert learner.state.step == BATCHES and learner.agent.training_steps > 0
    assert learner.registry.latest().learner_step == BATCHES  # the tail after the last publish_every is published
    again = replay_train_value(config, "actors")  # resumes from the checkpoint: nothing left to train
    assert again.state.step == BATCHES and again.agent.training_steps == learner.agent.training_steps


def test_a_resumed_value_replay_announces_nothing_again_having_no_broker(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A replay's learner sends its events nowhere: a resumed replay neither announces its checkpoint and
    versions again nor logs that it did."""
    _, raw = actors_batches(tmp_path, "offline-dqn")
    raw["value"]["learner"].update(min_replay_size=32, batch_size=16, checkpoint_every=3, publish_every=3)
    config = RunConfig.model_validate(raw)
    replay_train_value(config, "actors")
    with caplog.at_level(logging.INFO, logger="rlpipe.learner"):
        again = replay_train_value(config, "actors")
    assert again.state.step == BATCHES and again.checkpoints.latest() is not None
    assert "announced again" not in caplog.text


def test_a_replay_stops_at_a_batch_that_cannot_train_naming_it_and_how_to_leave_it_out(tmp_path: Path) -> None:
    from schemas.steps import steps_to_table

    store = ObjectStore((tmp_path / "store").as_uri())
    rows = [dict(episode_id="e", step=t, is_first=t == 0, is_last=t == 9, is_terminal=t == 9, observation=[0.1] * 4,
                 action=[0.0], reward=float("nan") if t == 5 else 1.0, discount=0.0 if t == 9 else 1.0)
            for t in range(10)]
    TrajectoryArchive(store).write_steps("runs/actors/env-steps/date=2026-12-04/s-nan.parquet", steps_to_table(rows))
    raw = load_preset("dqn-cartpole")
    raw.update(run_id="offline-dqn", store={"root": (tmp_path / "store").as_uri()})
    try:
        replay_train_value(RunConfig.model_validate(raw), "actors")
    except ValueError as exc:
        message = str(exc)
    else:
        raise AssertionError("a replay trained past a batch holding a NaN reward")
    assert "steps batch s-nan of run actors cannot be trained" in message and "NaN" in message
    assert "--date-from/--date-to" in message and "\n" not in message


def test_replay_train_refuses_a_value_run_without_discrete_actions() -> None:
    result = CliRunner().invoke(replay_app, ["--run", "hvac", "--train", "--preset", "dqn-cartpole",
                                             "--set", "run_id=hvac-cql", "--set", "env.name=building-hvac"])
    assert result.exit_code == 2
    assert "--preset cql-building" in result.output and len(result.output.strip().splitlines()) == 1


def test_a_replay_refused_on_the_batches_content_leaves_no_run_behind(tmp_path: Path) -> None:
    import pytest

    store = ObjectStore((tmp_path / "store").as_uri())
    actor = ValueActor(run_id="actors", actor_id="a0", env=CartPole(), archive=TrajectoryArchive(store),
                       watcher=ValueNetworkWatcher(AdapterRegistry(store, "actors"), tmp_path / "cache"),
                       config=ValueActorConfig(steps_per_batch=50))
    actor.write_batch()
    raw = load_preset("slateq-recsim")  # a slate agent on CartPole's steps: no click_position feature
    raw["run_id"] = "wrong-agent"
    raw["store"] = {"root": (tmp_path / "store").as_uri()}
    with pytest.raises(ValueError, match="click_position"):
        replay_train_value(RunConfig.model_validate(raw), "actors")
    assert store.list("runs/wrong-agent", recursive=True) == []


def test_the_version_a_replay_publishes_at_its_end_is_in_its_last_checkpoint(tmp_path: Path) -> None:
    from consumers.checkpoint import CheckpointStore

    store, raw = actors_batches(tmp_path, "offline-dqn")
    # 4 steps: v1 at step 3, a checkpoint at step 4 (before the tail's version), then v2 for step 4
    raw["value"]["learner"].update(min_replay_size=32, batch_size=16, checkpoint_every=4, publish_every=3)
    config = RunConfig.model_validate(raw)
    learner = replay_train_value(config, "actors")
    newest = learner.registry.latest()
    assert (newest.version, newest.learner_step) == (2, BATCHES)
    checkpoint = CheckpointStore(store, "offline-dqn").latest()
    assert (checkpoint.state.step, checkpoint.state.version) == (BATCHES, 2)
    again = replay_train_value(config, "actors")  # resumes knowing the version it published last
    assert (again.state.step, again.state.version) == (BATCHES, 2)


def test_a_value_learner_reaching_max_steps_between_publish_steps_publishes_its_last_step(tmp_path: Path) -> None:
    """As the LoRA learner does: the run's newest version holds every step it trained, and the step's checkpoint
    records it (the source still had batches: an online learner's never runs dry)."""
    from consumers.checkpoint import CheckpointStore
    from consumers.value.service import StepsReplaySource, build_value_learner

    store, raw = actors_batches(tmp_path, "online-dqn")
    raw["value"]["learner"].update(min_replay_size=32, batch_size=16, checkpoint_every=2, publish_every=3,
                                   max_steps=2)
    config = RunConfig.model_validate(raw)
    learner = build_value_learner(config, store, StepsReplaySource(store, "actors"), lambda payload: None)
    learner.resume()
    learner.run(poll_timeout_s=0.0)
    assert learner.state.step == 2 and not learner.source.exhausted()
    assert [learner.registry.show(v).learner_step for v in learner.registry.versions()] == [2]
    assert CheckpointStore(store, "online-dqn").latest().state.version == 1


def test_a_truncated_steps_batch_stops_the_replay_in_one_line_naming_its_file(tmp_path: Path) -> None:
    store, raw = actors_batches(tmp_path, "offline-dqn")
    key = TrajectoryArchive(store).list_steps("actors")[1]
    store.put(key, store.get(key)[:-100])  # cut short, as by an interrupted copy
    with pytest.raises(ValueError) as info:  # not trained past it
        replay_train_value(RunConfig.model_validate(raw), "actors")
    message = str(info.value)
    assert store.url(key) in message and "not a readable Parquet file" in message and "\n" not in message


def test_a_replay_into_a_run_with_another_network_or_memory_shape_is_refused_in_one_line(tmp_path: Path) -> None:
    """The run's checkpoint holds tensors of its network's shape and its replay memory is rebuilt at its capacity: a
    restart that changes either is refused up front, naming the field, not at the checkpoint's load."""
    _, raw = actors_batches(tmp_path, "offline-shape")
    raw["value"]["learner"].update(min_replay_size=32, batch_size=16, checkpoint_every=2, hidden_sizes=[16])
    replay_train_value(RunConfig.model_validate(raw), "actors")
    for field, value in (("hidden_sizes", [32]), ("replay_capacity", 10_000)):
        changed = {**raw, "value": {**raw["value"], "learner": {**raw["value"]["learner"], field: value}}}
        try:
            replay_train_value(RunConfig.model_validate(changed), "actors")
        except ValueError as exc:
            message = str(exc)
        else:
            raise AssertionError(f"a restart with another value.learner.{field} was not refused")
        assert f"value.learner.{field}" in message and "new run_id" in message and "\n" not in message


def test_a_replay_trains_the_batches_in_the_order_the_source_runs_learner_trained_them(tmp_path: Path) -> None:
    """Steps batch ids are random (``s-<uuid>``), so their keys' order is not the order the run's learner consumed
    them in (the announcements', several actors interleaved).  The replay follows the source run's step log: with
    the same configuration it trains the same steps and reaches the online learner's weights exactly."""
    from consumers.sources import BatchRef
    from consumers.value.service import build_value_learner
    from pipeline.io.steplog import StepLog
    from tests.consumers.value.test_learner import ListSource

    store, raw = actors_batches(tmp_path, "actors")
    raw["value"]["learner"].update(min_replay_size=32, batch_size=16, checkpoint_every=2, publish_every=2)
    keys = TrajectoryArchive(store).list_steps("actors")
    announced = list(reversed(keys))  # the order the online learner read them in: not the keys'
    refs = [BatchRef(key.rsplit("/", 1)[-1].removesuffix(".parquet"), key, None, {"mem:0": index + 1})
            for index, key in enumerate(announced)]
    online = build_value_learner(RunConfig.model_validate(raw), store, ListSource(refs), lambda payload: None)
    online.resume()
    online.run(poll_timeout_s=0.0)
    assert online.state.step == BATCHES and online.agent.training_steps > 0

    offline = replay_train_value(RunConfig.model_validate({**raw, "run_id": "offline-dqn"}), "actors")
    trained = [entry["batches"][0]["path"] for entry in StepLog(store, "offline-dqn").read()]
    assert trained == announced
    online_weights, offline_weights = online.agent.online.state_dict(), offline.agent.online.state_dict()
    assert all(torch.equal(online_weights[name], offline_weights[name]) for name in online_weights)


def test_steps_batches_the_source_run_never_trained_follow_those_it_did_in_key_order() -> None:
    from consumers.value.service import StepsReplaySource
    from pipeline.io.steplog import StepLog
    from schemas.steps import steps_to_table

    store = ObjectStore("memory://steps-order")
    rows = [dict(episode_id="e", step=t, is_first=t == 0, is_last=t == 2, is_terminal=t == 2, observation=[0.1] * 4,
                 action=[0.0], reward=1.0, discount=0.0 if t == 2 else 1.0) for t in range(3)]
    folder = "runs/actors/env-steps/date=2026-12-04"
    for name in ("s-a", "s-b", "s-c", "s-d"):
        TrajectoryArchive(store).write_steps(f"{folder}/{name}.parquet", steps_to_table(rows))
    for step, name in enumerate(("s-c", "s-a"), start=1):  # the run's learner trained s-c, then s-a; then stopped
        StepLog(store, "actors").write({"step": step, "batch_ids": [name]})
    source = StepsReplaySource(store, "actors")
    assert [ref.batch_id for _ in range(4) for ref in source.poll(0.0)] == ["s-c", "s-a", "s-b", "s-d"]
