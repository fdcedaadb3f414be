"""Packed learning when a run fails (its lease taken, a step or a write failing) or cannot be packed (settings of the
shared model, a warm start of another LoRA shape, another tiny build): it leaves, the others train on."""

from __future__ import annotations

import logging

import pytest
import torch

from consumers.checkpoint import CheckpointStore
from consumers.engine import TrainingEngine
from consumers.engine_data import EngineError
from consumers.engine_policy import EnginePolicy
from consumers.learner import Learner
from consumers.lease import FencedStore, LearnerLease, LeaseLostError
from consumers.packed import PackedLearner
from consumers.policy import LoraPolicy
from consumers.sources import ReplaySource
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from schemas.config import LearnerConfig
from tests.consumers.packed_runs import (
    SOURCES,
    adapter_of,
    batches,  # noqa: F401  # the fixture: runs a and b's batches in a store
    config,
    learner_of,
)
from tests.consumers.test_learner import setup  # noqa: F401  # the module fixture: tiny model, prompt, answers


def fenced_learner(store: ObjectStore, run: str, policy: LoraPolicy, cfg: LearnerConfig) -> Learner:
    """``learner_of`` with the run's lease taken on resume and checked at every commit point."""
    archive, lease = TrajectoryArchive(store), LearnerLease(store, run, holder=f"packed-{run}")
    fenced = FencedStore(store, lease)
    return Learner(run_id=run, base_model="tiny", config=cfg, policy=policy, archive=archive,
                   registry=AdapterRegistry(fenced, run), checkpoints=CheckpointStore(fenced, run),
                   source=ReplaySource(archive, f"src-{run}"), lease=lease)


def test_a_run_that_fails_leaves_and_the_others_train_on(batches, setup):  # noqa: F811
    """b's lease is taken by a learner elsewhere mid-run: b leaves the packed learner (its adapter deleted, reported
    to ``on_failure``), and a trains to its max_steps as if alone."""
    engine = TrainingEngine(setup["model_dir"], device="cpu")
    a, b = (fenced_learner(batches, run, EnginePolicy(engine, run, config(run)), config(run)) for run in SOURCES)
    packed = PackedLearner(engine, [a, b])
    packed.resume()
    failures: list[tuple[str, Exception]] = []
    taken: list[int] = []

    def between_rounds(packed: PackedLearner) -> None:
        if a.state.step >= 1 and not taken:
            taken.append(LearnerLease(batches, "b", holder="elsewhere").acquire())

    packed.run(on_step=lambda run, metrics: None, poll_timeout_s=0, between_rounds=between_rounds,
               on_failure=lambda run, exc: failures.append((run, exc)))
    assert [(run, type(exc)) for run, exc in failures] == [("b", LeaseLostError)]
    assert [run.run_id for run in packed.runs] == ["a"] and engine.adapters() == ["a"]
    assert a.state.step == 4 and CheckpointStore(batches, "a").latest().state.step == 4
    alone = learner_of(batches, "a-alone", "src-a", LoraPolicy(setup["model_dir"], config("a")), config("a"))
    alone.run(poll_timeout_s=0)
    ours, theirs = adapter_of(batches, "a"), adapter_of(batches, "a-alone")
    assert max(float((ours[k] - theirs[k]).abs().max()) for k in ours) <= 1e-6


def test_a_run_whose_step_failed_comes_back_from_its_checkpoint_and_trains_each_batch_once(batches, setup):  # noqa: F811
    """A storage error in b's third step: b leaves, comes back (as the packed process brings it back) from its
    step-2 checkpoint, and ends with the weights of b alone; a is not disturbed."""
    engine = TrainingEngine(setup["model_dir"], device="cpu")
    a, b = (learner_of(batches, run, f"src-{run}", EnginePolicy(engine, run, config(run)), config(run))
            for run in SOURCES)
    train_step, calls = b.policy.train_step, []

    def fails_once(*args, **kwargs):
        calls.append(len(calls))
        if len(calls) == 3:
            raise OSError("the bucket is unreachable")
        return train_step(*args, **kwargs)

    b.policy.train_step = fails_once
    packed = PackedLearner(engine, [a, b])
    packed.resume()
    failed: list[str] = []

    def between_rounds(packed: PackedLearner) -> None:
        if failed and "b" not in {run.run_id for run in packed.runs}:
            again = learner_of(batches, "b", "src-b", EnginePolicy(engine, "b", config("b")), config("b"))
            again.source.already_trained = lambda batch_id: batch_id in again.state.trained
            packed.add(again)

    packed.run(poll_timeout_s=0, between_rounds=between_rounds, on_failure=lambda run, exc: failed.append(run))
    assert failed == ["b"] and sorted(run.run_id for run in packed.runs) == ["a", "b"]
    for run in SOURCES:
        alone = learner_of(batches, f"{run}-alone", f"src-{run}", LoraPolicy(setup["model_dir"], config(run)),
                           config(run))
        alone.run(poll_timeout_s=0)
        ours, theirs = adapter_of(batches, run), adapter_of(batches, f"{run}-alone")
        assert CheckpointStore(batches, run).latest().state.step == 4
        assert max(float((ours[k] - theirs[k]).abs().max()) for k in ours) <= 1e-6, run


def test_a_run_that_left_is_not_reported_failed_when_its_adapter_cannot_be_deleted(batches, setup, caplog):  # noqa: F811
    """a is asked to leave after its first step and settles (its final checkpoint, step 1, written and committed);
    deleting its adapter then fails.  a left all the same (``on_left`` told, an error line logged) and is not
    reported as a failed run, which would bring it back; b trains to its max_steps."""
    engine = TrainingEngine(setup["model_dir"], device="cpu")
    a, b = (learner_of(batches, run, f"src-{run}", EnginePolicy(engine, run, config(run)), config(run))
            for run in SOURCES)
    delete_adapter = engine.delete_adapter

    def failing_for_a(name: str) -> None:
        if name == "a":
            raise EngineError("adapter 'a': its slot could not be freed")
        delete_adapter(name)

    engine.delete_adapter = failing_for_a  # type: ignore[method-assign]
    packed = PackedLearner(engine, [a, b])
    packed.resume()
    left: list[Learner] = []
    failures: list[tuple[str, Exception]] = []
    asked: list[str] = []

    def between_rounds(packed: PackedLearner) -> None:
        if a.state.step >= 1 and not asked:
            packed.leave("a", left.append)
            asked.append("a")

    with caplog.at_level(logging.ERROR, logger="rlpipe.learner"):
        packed.run(poll_timeout_s=0, between_rounds=between_rounds,
                   on_failure=lambda run, exc: failures.append((run, exc)))
    assert left == [a] and failures == [] and [run.run_id for run in packed.runs] == ["b"]
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR] == [
        "run a left, but deleting its adapter failed (EngineError: adapter 'a': its slot could not be freed)"]
    assert CheckpointStore(batches, "a").latest().state.step == a.state.step == 1
    assert CheckpointStore(batches, "b").latest().state.step == 4


def test_settings_of_the_shared_model_must_agree_and_gradient_checkpointing_reaches_it(batches, setup):  # noqa: F811
    """Gradient checkpointing belongs to the process's one model: packed runs must agree on it, and a run that asks
    for it (to fit its memory) gets it on the shared model.  torch's thread count is the process's too: the first
    run sets it, and a run joining later does not change it under the others."""
    from consumers.packed_service import check_packable
    from schemas.config import RunConfig

    with pytest.raises(ValueError, match=r"learner\.gradient_checkpointing"):
        check_packable([RunConfig(run_id="a"), RunConfig(run_id="b", learner={"gradient_checkpointing": True})])
    threads = torch.get_num_threads()
    EnginePolicy(TrainingEngine(setup["model_dir"], device="cpu"), "t", config("t", torch_threads=threads + 1))
    assert torch.get_num_threads() == threads
    engine = TrainingEngine(setup["model_dir"], device="cpu")
    assert not engine.base.is_gradient_checkpointing
    cfg = config("a", gradient_checkpointing=True, max_steps=1)
    learner = learner_of(batches, "a", "src-a", EnginePolicy(engine, "a", cfg), cfg)
    assert engine.base.is_gradient_checkpointing
    packed = PackedLearner(engine, [learner])
    packed.resume()
    packed.run(poll_timeout_s=0)
    assert learner.state.step == 1


@pytest.mark.parametrize("differs", [{"lora_alpha": 32}, {"target_modules": ["q_proj", "v_proj"]}])
def test_a_packed_run_refuses_a_warm_start_adapter_of_another_lora_shape(tmp_path, setup, differs):  # noqa: F811
    """As a lone learner does: loading it would keep some of its weights (or scale them otherwise)."""
    folder = LoraPolicy(setup["model_dir"], config("x", **differs)).save_adapter(tmp_path / "other")
    engine = TrainingEngine(setup["model_dir"], device="cpu")
    policy = EnginePolicy(engine, "a", config("a"))
    with engine.holding("a"), pytest.raises(ValueError, match=next(iter(differs))):
        policy.load_adapter_folder(folder)
    same = LoraPolicy(setup["model_dir"], config("y")).save_adapter(tmp_path / "same")
    with engine.holding("a"):
        policy.load_adapter_folder(same)  # the same shape loads


def test_a_run_whose_last_write_fails_on_a_stop_is_dropped_and_the_others_still_write_their_checkpoints(batches, setup):  # noqa: F811
    """A stop comes while a's publish is still being written and that write fails: a is reported and dropped, as a
    failure in a turn is, and b's final checkpoint is still written (``finish_all``)."""
    engine = TrainingEngine(setup["model_dir"], device="cpu")
    cfgs = {run: config(run, checkpoint_every=10) for run in SOURCES}
    a, b = (learner_of(batches, run, f"src-{run}", EnginePolicy(engine, run, cfgs[run]), cfgs[run]) for run in SOURCES)

    def failing_write(*args, **kwargs):
        raise OSError("the bucket is unreachable")

    a.outputs.write_step = failing_write
    packed = PackedLearner(engine, [a, b])
    packed.resume()
    failures: list[tuple[str, type]] = []

    def on_failure(run: str, exc: Exception) -> None:
        failures.append((run, type(exc)))

    packed.run(should_stop=lambda: b.state.step >= 1, poll_timeout_s=0, on_failure=on_failure)
    packed.finish_all(on_failure=on_failure)
    assert failures == [("a", OSError)] and [run.run_id for run in packed.runs] == ["b"]
    assert engine.adapters() == ["b"]
    assert CheckpointStore(batches, "b").latest().state.step == 1


def test_a_run_on_another_tiny_build_than_the_engines_is_refused_at_start_and_as_it_joins(tmp_path, caplog,
                                                                                             monkeypatch):
    """Runs naming model.base_model 'tiny' differ in which tiny model when their model.tiny_dir folders (or, without
    one, the tiny model recorded on this machine) hold two builds: the engine trains on the first run's, so a run on
    another build is refused in one line naming both builds and the fix (a learner per base model); at start the
    process refuses to start, and a run joining later is skipped while the others go on.  The same build in
    another folder, as a run created on another machine records it, is packed."""
    from consumers.packed_service import check_packable
    from pipeline.membership import RunMembership
    from pipeline.models import MARKER_FILE, record_tiny_model
    from tests.pipeline.test_membership import Feed, joined_and_warnings, started
    from tests.pipeline.test_membership import config as run_config

    engine_dir = tmp_path / "models" / "engine-tiny"
    engine_dir.mkdir(parents=True)
    (engine_dir / MARKER_FILE).write_text('{"spec_hash": "0123456789abcdef"}')
    elsewhere = "/home/someone/.rlpipe/models/tiny-0123456789abcdef"  # the same build, on the machine that made it
    other = "/home/someone/.rlpipe/models/tiny-fedcba9876543210"  # a build of other parameters
    store = ObjectStore(tmp_path.as_uri())
    engine = run_config("base", model={"tiny_dir": str(engine_dir)}, store={"root": store.root})
    with pytest.raises(ValueError, match="fedcba9876543210") as refused:
        check_packable([engine, run_config("b", model={"tiny_dir": other})])
    message = str(refused.value)
    assert "0123456789abcdef" in message and "learner per base model" in message and "\n" not in message
    check_packable([engine, run_config("c", model={"tiny_dir": elsewhere})])

    recorded = tmp_path / "home" / "models" / "built-here"  # the default tiny model this machine built
    recorded.mkdir(parents=True)
    (recorded / MARKER_FILE).write_text('{"spec_hash": "fedcba9876543210"}')
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    record_tiny_model(recorded)
    with pytest.raises(ValueError, match="fedcba9876543210"):
        check_packable([engine, run_config("d")])  # no tiny_dir: the recorded build, not the engine's

    feed = Feed()
    membership = RunMembership("exp-*", engine, store, check_packable, follower=feed)
    feed.put("exp-1", started(store, run_config("exp-1", model={"tiny_dir": other})))
    feed.put("exp-2", started(store, run_config("exp-2", model={"tiny_dir": elsewhere})))
    joined, warnings = joined_and_warnings(membership, caplog)
    assert joined == ["exp-2"]
    assert "run exp-1 cannot join" in warnings and "fedcba9876543210" in warnings and "0123456789abcdef" in warnings
    assert all("\n" not in record.getMessage() for record in caplog.records)
