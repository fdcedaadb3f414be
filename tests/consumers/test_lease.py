"""One learner per run: the newest learner takes the lease, an older one is fenced out before it commits."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from consumers.checkpoint import CheckpointStore
from consumers.learner import Learner
from consumers.lease import FencedStore, LearnerLease, LeaseLostError
from consumers.policy import LoraPolicy
from consumers.service import build_learner
from consumers.sources import BatchRef, ReplaySource
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


def test_a_fenced_learner_exits_with_one_line(monkeypatch, tmp_path):
    from consumers import cli, service
    from pipeline.runtime import create_run

    stored = ObjectStore((tmp_path / "store").as_uri())
    create_run(stored, RunConfig(run_id=RUN), "tiny")  # a stored run's start says nothing before the error

    def fenced(*args, **kwargs):
        raise LeaseLostError(f"run {RUN} has a newer learner: pod-b (epoch 2, since 2026-01-01T00:00:00+00:00); "
                             "this learner (pod-a, epoch 1) stops without committing; run one learner per run")

    monkeypatch.setattr(service, "run_learner", fenced)
    monkeypatch.setenv("RLPIPE_STORE__ROOT", stored.root)
    result = CliRunner().invoke(cli.app, ["--set", f"run_id={RUN}"])  # the group's only command
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [f"error: run {RUN} has a newer learner: pod-b (epoch 2, since "
                                                  "2026-01-01T00:00:00+00:00); this learner (pod-a, epoch 1) stops "
                                                  "without committing; run one learner per run"]


class TwoPartitions:
    """A Kafka-like log of two partitions holding the stored batches, two each; ``first`` names the partition a
    poll serves while it has batches (consumers of one log get its partitions in different orders)."""

    def __init__(self, store: ObjectStore, first: str) -> None:
        commits = TrajectoryArchive(store).commits(RUN)
        self.logs = {"t:0": commits[:2], "t:1": commits[2:]}
        self.order = [first, *(key for key in self.logs if key != first)]
        self.next = dict.fromkeys(self.logs, 0)

    def poll(self, timeout_s: float) -> list[BatchRef]:
        for key in self.order:
            if self.next[key] < len(self.logs[key]):
                commit = self.logs[key][self.next[key]]
                self.next[key] += 1
                return [BatchRef(commit.batch_id, commit.key, commit.sha256, {key: self.next[key]})]
        return []

    def seek(self, positions: dict[str, int]) -> None:
        self.next = {key: positions.get(key, 0) for key in self.logs}

    def commit(self, positions: dict[str, int]) -> None:
        """Nothing to commit: positions come from the checkpoint."""

    def keep_alive(self) -> None:
        """Nothing to keep alive."""

    def exhausted(self) -> bool:
        return all(self.next[key] == len(log) for key, log in self.logs.items())


class BeforeCheckpointManifest:
    """``store``, running ``action`` once just before the manifest of a checkpoint of ``step`` is created: under a
    ``FencedStore``, after the lease check passed."""

    def __init__(self, store: ObjectStore, step: int, action: Callable[[], None]) -> None:
        self._store, self.step, self.action = store, step, action

    def put_create_once(self, key: str, data: bytes) -> str:
        if f"/checkpoints/step-{self.step:06d}-" in key and key.endswith("/manifest.json") and self.action:
            action, self.action = self.action, None
            action()
        return self._store.put_create_once(key, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


class Killed(Exception):
    """The learner process dying."""


def fenced_learner(store: ObjectStore, setup: dict, holder: str, first: str, hooked: Any = None,
                   keep: int | None = None) -> Learner:
    """A learner built as ``build_learner`` builds one (lease, fenced registry and checkpoints, ``keep`` of them),
    fed by ``TwoPartitions``; ``hooked`` wraps ``store`` under the fence."""
    cfg = LearnerConfig(lora_rank=4, lora_alpha=8, learning_rate=2e-2, batch_rows=16, max_staleness=1000)
    lease = LearnerLease(store, RUN, holder=holder)
    fenced: Any = FencedStore(hooked or store, lease)
    return Learner(run_id=RUN, base_model=setup["model_dir"], config=cfg, policy=LoraPolicy(setup["model_dir"], cfg),
                   archive=TrajectoryArchive(store), registry=AdapterRegistry(fenced, RUN),
                   checkpoints=CheckpointStore(fenced, RUN, keep=keep), source=TwoPartitions(store, first),
                   lease=lease)


def test_a_checkpoint_committed_after_a_takeover_is_not_resumed_once_its_steps_were_rewritten(setup):
    """The lease check and the manifest write are two calls.  Learner A passes the check for its step-2
    checkpoint; learner B takes the lease and resumes from step 1 (A's step 2 is not committed yet); A's
    manifest lands.  B reads the partitions in another order, so its step 2 trains another batch and rewrites
    the step-2 object; B dies before its own checkpoint.  Learner C must not resume from A's step 2 with B's
    step-2 object as its history: it would skip B's batch, which A's weights never trained (lost), and never
    skip A's, which they did (trained twice if announced again)."""
    store = ObjectStore(f"memory://rlpipe-test-{uuid.uuid4().hex}/prefix")
    write_batches(TrajectoryArchive(store), setup, 4, np.random.default_rng(3))
    learners: dict[str, Learner] = {}
    trained: dict[str, list[list[str]]] = {"a": [], "b": [], "c": []}  # per learner: each step's batch ids

    def take_over() -> None:
        learners["b"] = fenced_learner(store, setup, "pod-b", first="t:1",
                                       hooked=BeforeCheckpointManifest(store, 2, crash))
        assert learners["b"].resume() and learners["b"].state.step == 1

    def crash() -> None:
        raise Killed("pod-b dies before its step-2 checkpoint")

    a = fenced_learner(store, setup, "pod-a", first="t:0", hooked=BeforeCheckpointManifest(store, 2, take_over))
    a.resume()
    for _ in range(2):
        trained["a"].append(one_step(a)["batch_ids"])  # step 2's manifest lands after pod-b resumed from step 1
    assert CheckpointStore(store, RUN).complete()[0][0] == 2
    with pytest.raises(Killed):
        one_step(learners["b"])  # trains another batch as step 2 and rewrites the step-2 object
    assert StepLog(store, RUN).read(upto=2)[1]["batch_ids"] != trained["a"][1]

    c = fenced_learner(store, setup, "pod-c", first="t:0")
    assert c.resume()
    resumed_from = [batch for step in trained["a"][:c.state.step] for batch in step]  # pod-a wrote every checkpoint
    assert sorted(c.state.trained) == sorted(resumed_from)  # the dedup set is what the weights trained
    c.run(poll_timeout_s=0, on_step=lambda metrics: trained["c"].append(metrics["batch_ids"]))
    in_the_weights = resumed_from + [batch for step in trained["c"] for batch in step]
    every_batch = [commit.batch_id for commit in TrajectoryArchive(store).commits(RUN)]
    assert sorted(in_the_weights) == sorted(every_batch)  # each batch trained once: none lost, none twice
    history = StepLog(store, RUN).read(upto=c.state.step)
    assert sorted(batch for entry in history for batch in entry["batch_ids"]) == sorted(every_batch)


def test_a_learner_fenced_out_after_its_late_checkpoint_deletes_no_older_checkpoint(setup):
    """The takeover above with ``keep_checkpoints: 1``: A's step-2 manifest lands after B resumed from step 1,
    then A would prune step 1 as older than its newest.  Once B rewrote the step-2 object, step 1 is the
    checkpoint the next learner must fall back to; deleted, C would start from scratch and the run's training
    would be lost.  A holds no lease when it prunes, so it deletes nothing and stops."""
    store = ObjectStore(f"memory://rlpipe-test-{uuid.uuid4().hex}/prefix")
    write_batches(TrajectoryArchive(store), setup, 4, np.random.default_rng(3))
    learners: dict[str, Learner] = {}

    def take_over() -> None:
        learners["b"] = fenced_learner(store, setup, "pod-b", first="t:1", keep=1,
                                       hooked=BeforeCheckpointManifest(store, 2, crash))
        assert learners["b"].resume() and learners["b"].state.step == 1

    def crash() -> None:
        raise Killed("pod-b dies before its step-2 checkpoint")

    a = fenced_learner(store, setup, "pod-a", first="t:0", keep=1,
                       hooked=BeforeCheckpointManifest(store, 2, take_over))
    a.resume()
    step_1 = one_step(a)["batch_ids"]
    with pytest.raises(LeaseLostError, match="pod-b"):
        one_step(a)  # its step-2 manifest lands after the takeover; its pruning is refused
    assert [step for step, _ in CheckpointStore(store, RUN).complete()] == [2, 1]
    with pytest.raises(Killed):
        one_step(learners["b"])  # rewrites the step-2 object, so A's step-2 checkpoint is forked

    c = fenced_learner(store, setup, "pod-c", first="t:0", keep=1)
    assert c.resume() and c.state.step == 1 and sorted(c.state.trained) == sorted(step_1)
    c.run(poll_timeout_s=0)
    every_batch = [commit.batch_id for commit in TrajectoryArchive(store).commits(RUN)]
    history = StepLog(store, RUN).read(upto=c.state.step)
    assert sorted(batch for entry in history for batch in entry["batch_ids"]) == sorted(every_batch)
    assert [step for step, _ in CheckpointStore(store, RUN).complete()] == [c.state.step]  # C prunes as it holds
