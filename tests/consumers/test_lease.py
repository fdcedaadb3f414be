"""One learner per run: the newest learner takes the lease, an older one is fenced out before it commits."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from consumers.checkpoint import CheckpointStore
from consumers.lease import LearnerLease, LeaseLostError
from consumers.service import build_learner
from consumers.sources import ReplaySource
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.registry import AdapterRegistry
from pipeline.io.steplog import StepLog
from pipeline.io.store import ObjectStore
from schemas.config import LearnerConfig, ModelConfig, RunConfig, StoreConfig
from tests.consumers import test_learner
from tests.consumers.test_learner import RUN, write_batches

store, setup = test_learner.store, test_learner.setup  # the same fixtures: a file store, the tiny model's prompt


def learner_of(store: ObjectStore, setup: dict, holder: str):
    """The learner ``rlpipe learner start`` builds (lease and fenced store included), named ``holder``."""
    config = RunConfig(run_id=RUN, model=ModelConfig(base_model=setup["model_dir"]), store=StoreConfig(root=store.root),
                       learner=LearnerConfig(lora_rank=4, lora_alpha=8, learning_rate=2e-2, batch_rows=16,
                                             max_staleness=1000))
    learner = build_learner(config, store, ReplaySource(TrajectoryArchive(store), RUN), lambda payload: None,
                            base_model=setup["model_dir"])
    learner.lease.holder = holder
    return learner


def one_step(learner) -> dict:
    learner.ingest(learner.source.poll(0))
    return learner.step()


def test_the_highest_epoch_holds_the_lease(tmp_path):
    store = ObjectStore(tmp_path.as_uri())
    first, second = LearnerLease(store, RUN, holder="pod-a"), LearnerLease(store, RUN, holder="pod-b")
    assert first.acquire() == 1
    first.check()
    assert second.acquire() == 2
    second.check()
    with pytest.raises(LeaseLostError) as lost:
        first.check()
    message = str(lost.value)
    assert "\n" not in message and "pod-b (epoch 2" in message and "pod-a, epoch 1" in message
    assert store.list(f"runs/{RUN}/learner-lease") == [f"runs/{RUN}/learner-lease/epoch-00000{n}.json" for n in (1, 2)]


def test_a_create_conflict_on_our_own_epoch_still_takes_the_lease(tmp_path, monkeypatch):
    """A retried create that reports a conflict for the object it wrote itself."""
    store = ObjectStore(tmp_path.as_uri())
    real_put_create = store.put_create

    def written_then_conflict(key: str, data: bytes) -> str:
        real_put_create(key, data)
        raise FileExistsError(key)

    monkeypatch.setattr(store, "put_create", written_then_conflict)
    lease = LearnerLease(store, RUN, holder="pod-a")
    assert lease.acquire() == 1
    lease.check()


def test_a_second_learner_takes_over_and_the_first_is_refused_before_committing(store, setup):
    write_batches(TrajectoryArchive(store), setup, 3, np.random.default_rng(0))
    registry, checkpoints = AdapterRegistry(store, RUN), CheckpointStore(store, RUN)
    old = learner_of(store, setup, "pod-a")
    old.resume()
    one_step(old)
    assert registry.versions() == [1]

    new = learner_of(store, setup, "pod-b")
    assert new.resume() and new.state.step == 1  # resumes from the old learner's checkpoint

    with pytest.raises(LeaseLostError) as lost:
        one_step(old)  # its publish is refused before the version's manifest
    message = str(lost.value)
    assert "\n" not in message and "pod-b" in message and f"run {RUN} has a newer learner" in message
    assert registry.versions() == [1] and checkpoints.complete()[0][0] == 1
    with pytest.raises(LeaseLostError):
        old.checkpoint()  # and so is its checkpoint
    assert checkpoints.complete()[0][0] == 1

    new.run(poll_timeout_s=0)
    assert new.state.step == 3 and registry.versions() == [1, 2, 3]
    assert sorted(new.state.trained.values()) == [1, 2, 3]

    # the fenced learner cannot replace a step object of the history the holder's checkpoints cover
    history = StepLog(store, RUN).read(upto=3)
    with pytest.raises(LeaseLostError):
        StepLog(old.checkpoints.store, RUN).write({**history[1], "batch_ids": ["not-trained"]})
    assert StepLog(store, RUN).read(upto=3) == history
    # nor create a manifest with several files at once; files without one are only unnamed orphans
    fenced = old.checkpoints.store
    with pytest.raises(LeaseLostError):
        fenced.put_create_many({"runs/x/a.bin": b"a", "runs/x/manifest.json": b"{}"})
    assert not store.exists("runs/x/manifest.json")
    assert fenced.put_create_many({"runs/x/b.bin": b"b"}) and store.exists("runs/x/b.bin")


def test_a_restarted_learner_resumes_under_a_new_epoch(store, setup):
    write_batches(TrajectoryArchive(store), setup, 2, np.random.default_rng(1))
    crashed = learner_of(store, setup, "learner-0")
    crashed.resume()
    one_step(crashed)  # then the process dies
    restarted = learner_of(store, setup, "learner-0")
    assert restarted.resume() and restarted.state.step == 1
    assert restarted.lease.epoch == 2
    restarted.run(poll_timeout_s=0)
    assert restarted.state.step == 2 and AdapterRegistry(store, RUN).versions() == [1, 2]


def test_a_fenced_learner_exits_with_one_line(monkeypatch):
    from consumers import cli, service

    def fenced(*args, **kwargs):
        raise LeaseLostError(f"run {RUN} has a newer learner: pod-b (epoch 2, since 2026-01-01T00:00:00+00:00); "
                             "this learner (pod-a, epoch 1) stops without committing; run one learner per run")

    monkeypatch.setattr(service, "run_learner", fenced)
    result = CliRunner().invoke(cli.app, ["--set", f"run_id={RUN}"])  # the group's only command
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [f"error: run {RUN} has a newer learner: pod-b (epoch 2, since "
                                                  "2026-01-01T00:00:00+00:00); this learner (pod-a, epoch 1) stops "
                                                  "without committing; run one learner per run"]
