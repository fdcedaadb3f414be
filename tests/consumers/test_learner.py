"""The learner loop on a real (tiny) model: it learns, drops stale rows, checkpoints, resumes, replays."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from datetime import UTC, datetime
from tempfile import TemporaryDirectory

import numpy as np
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from consumers.advantages import with_discounted_returns
from consumers.checkpoint import CheckpointStore
from consumers.learner import Learner
from consumers.policy import LoraPolicy
from consumers.sources import ReplaySource
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.registry import AdapterRegistry
from pipeline.io.steplog import StepLog
from pipeline.io.store import ObjectStore
from schemas.config import LearnerConfig
from schemas.trajectory import NO_ADAPTER_SHA

RUN = "learn"


@pytest.fixture
def store(tmp_path):
    return ObjectStore(tmp_path.as_uri())


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tiny_tokenizer):
    prompt = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say L or R."}], tokenize=True, add_generation_prompt=True, return_dict=False)
    good, bad = tiny_tokenizer.encode("L", add_special_tokens=False)[0], tiny_tokenizer.encode("R",
                                                                                            add_special_tokens=False)[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)
    return {"prompt": list(prompt), "good": good, "bad": bad, "logp": logp, "model_dir": tiny_model_dir}


def probability_of(model_dir, adapter_dir, prompt, token) -> float:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    with torch.no_grad():
        return float(torch.softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)[token])


def write_batches(archive, setup, n_batches, rng, version=0, groups=2, group_size=8, first=0):
    """Rows answering with one token each: reward 1 for the good token, 0 for the bad one (sampled 50/50)."""
    for b in range(first, first + n_batches):
        batch_id = f"b{b:03d}-{uuid.uuid4().hex[:6]}"
        rows = []
        for g in range(groups):
            for _ in range(group_size):
                token = setup["good"] if rng.random() < 0.5 else setup["bad"]
                rows.append(dict(
                    run_id=RUN, batch_id=batch_id, episode_id=uuid.uuid4().hex, group_id=f"{batch_id}-g{g}",
                    env="toy", env_seed=g, producer_id="p", policy_version=version, adapter_sha256=NO_ADAPTER_SHA,
                    tokens=setup["prompt"] + [token], loss_mask=[0] * len(setup["prompt"]) + [1],
                    logprobs=[0.0] * len(setup["prompt"]) + [float(setup["logp"][token])],
                    turn_rewards=[float(token == setup["good"])], reward=float(token == setup["good"]),
                    num_turns=1, success=token == setup["good"], terminated=True, truncated=False,
                    created_at=datetime(2026, 1, 1, tzinfo=UTC),
                ))
        archive.write_batch(RUN, rows, batch_id=batch_id, created=datetime(2026, 1, 1, tzinfo=UTC))


def make_learner(store, setup, **overrides):
    cfg = LearnerConfig(**{"lora_rank": 4, "lora_alpha": 8, "learning_rate": 2e-2, "batch_rows": 16,
                           "publish_every": 1, "checkpoint_every": 1, "max_staleness": 1000, **overrides})
    archive = TrajectoryArchive(store)
    announced = []
    learner = Learner(
        run_id=RUN, base_model=setup["model_dir"], config=cfg, policy=LoraPolicy(setup["model_dir"], cfg),
        archive=archive, registry=AdapterRegistry(store, RUN), checkpoints=CheckpointStore(store, RUN),
        source=ReplaySource(archive, RUN), announce=announced.append,
    )
    return learner, announced


def test_probability_of_the_rewarded_token_rises_across_versions(store, setup, tmp_path):
    write_batches(TrajectoryArchive(store), setup, 6, np.random.default_rng(0))
    learner, announced = make_learner(store, setup)
    learner.run(poll_timeout_s=0)
    registry = AdapterRegistry(store, RUN)
    assert registry.versions() == list(range(1, 7))
    probs = [probability_of(setup["model_dir"], None, setup["prompt"], setup["good"])]
    for version in registry.versions():
        folder = registry.pull(version, tmp_path / "cache")
        probs.append(probability_of(setup["model_dir"], folder, setup["prompt"], setup["good"]))
    # The first step moves towards the reward, and later versions keep a large gain.  The gain levels off
    # after a few versions (the rows come from the base model, and their importance weights are truncated at
    # is_cap), where each step moves it up or down by noise: an order of the versions is not asserted.
    assert probs[1] > probs[0], probs
    assert np.median(probs[4:]) > 5 * probs[0] and probs[-1] > 3 * probs[0], probs
    kinds = [type(p).__name__ for p in announced]
    assert kinds.count("AdapterPublished") == 6 and kinds.count("LearnerCheckpointed") == 6


def test_on_policy_rows_have_ratio_one(store, setup):
    write_batches(TrajectoryArchive(store), setup, 1, np.random.default_rng(1))
    learner, _ = make_learner(store, setup)
    metrics = learner.step() if learner.ingest(learner.source.poll(0)) is None and learner.pending else None
    assert metrics is not None
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["effective_sample_size"] == pytest.approx(1.0, abs=1e-4)


def test_stale_rows_never_reach_a_gradient(store, setup):
    archive = TrajectoryArchive(store)
    write_batches(archive, setup, 3, np.random.default_rng(2), version=0)
    learner, _ = make_learner(store, setup, max_staleness=1)
    learner.run(poll_timeout_s=0)
    log = StepLog(store, RUN).read()
    # versions 0 and 1 may train version-0 rows (staleness <= 1); from version 2 on they are all dropped
    assert [m["version_trained_from"] for m in log] == [0, 1, 2]
    assert log[2]["rows"] == 0 and log[2]["dropped_stale_rows"] == 16
    assert log[2]["staleness_histogram"] == {"2": 16}
    assert learner.state.dropped_stale_rows == 16
    assert all(m["rows"] == 16 for m in log[:2])
    assert AdapterRegistry(store, RUN).versions() == [1, 2]  # the step that trained nothing published nothing


def test_a_step_of_stale_rows_is_ready_so_it_can_be_committed(store, setup):
    """Producers wait while a step's worth of rows is unconsumed: those rows must be consumable when stale."""
    write_batches(TrajectoryArchive(store), setup, 1, np.random.default_rng(4), version=0)
    learner, _ = make_learner(store, setup, max_staleness=1)
    learner.state.version = 3
    learner.ingest(learner.source.poll(0))
    assert learner.pending[0].table.num_rows == 0 and learner.pending[0].dropped == 16
    assert learner.ready()
    metrics = learner.step()
    assert metrics["skipped"] and metrics["dropped_stale_rows"] == 16
    assert learner.state.positions and AdapterRegistry(store, RUN).versions() == []
    assert CheckpointStore(store, RUN).latest().state.positions == learner.state.positions


def test_resume_continues_without_retraining(store, setup):
    archive = TrajectoryArchive(store)
    write_batches(archive, setup, 4, np.random.default_rng(3))
    first, _ = make_learner(store, setup, max_steps=2)
    first.run(poll_timeout_s=0)
    assert first.state.step == 2
    second, _ = make_learner(store, setup)
    assert second.resume()
    assert second.state.step == 2 and second.source.cursor == first.state.positions[second.source.position_key]
    before = {k: v.clone() for k, v in second.policy.adapter_tensors().items()}
    after_first = first.policy.adapter_tensors()
    assert all(torch.equal(before[k], after_first[k]) for k in before)
    second.run(poll_timeout_s=0)
    trained = second.state.trained
    assert len(trained) == 4 and sorted(trained.values()) == [1, 2, 3, 4]
    assert AdapterRegistry(store, RUN).versions() == [1, 2, 3, 4]


def test_batches_delivered_again_after_restarts_are_skipped_via_the_step_log(store, setup):
    """Trained ids come back from the step objects up to the checkpoint; a step logged past it is retrained."""
    write_batches(TrajectoryArchive(store), setup, 3, np.random.default_rng(5))
    first, _ = make_learner(store, setup, max_steps=3, checkpoint_every=2)
    first.run(poll_timeout_s=0)  # steps 1-3 logged, checkpoint at 2 only: step 3 is provisional
    second, _ = make_learner(store, setup, checkpoint_every=2)
    assert second.resume() and second.state.step == 2 and sorted(second.state.trained.values()) == [1, 2]
    second.run(poll_timeout_s=0)  # retrains the third batch as step 3 and logs it over the provisional entry
    second.checkpoint()
    third, _ = make_learner(store, setup)
    assert third.resume() and third.state.step == 3
    third.source.seek({})  # every batch delivered again
    third.run(poll_timeout_s=0)
    assert third.duplicates_skipped == 3 and third.state.step == 3
    log = StepLog(store, RUN).read(upto=3)
    assert sorted(b for entry in log for b in entry["batch_ids"]) == sorted(third.state.trained) and len(log) == 3
    assert CheckpointStore(store, RUN).latest().state.trained == third.state.trained


def test_replaying_the_same_batches_gives_bitwise_the_same_weights(tmp_path, setup):
    weights = []
    for attempt in range(2):
        store = ObjectStore((tmp_path / f"s{attempt}").as_uri())
        write_batches(TrajectoryArchive(store), setup, 3, np.random.default_rng(4))
        learner, _ = make_learner(store, setup)
        learner.run(poll_timeout_s=0)
        weights.append(learner.policy.adapter_tensors())
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_a_replay_of_a_run_reaches_its_weights_when_it_trained_its_batches_out_of_commit_order(tmp_path, setup):
    """The run's learner read its batches last-committed first (as it reads a batch whose producer announced it
    late); replaying its stored batches follows its step log, so the replay trains the same steps."""
    from consumers.service import replay_train
    from consumers.sources import BatchRef
    from tests.consumers.value.test_learner import ListSource

    store = ObjectStore(tmp_path.as_uri())
    archive = TrajectoryArchive(store)
    write_batches(archive, setup, 3, np.random.default_rng(5))
    announced = list(reversed(archive.commits(RUN)))  # one batch of batch_rows rows per step
    online, _ = make_learner(store, setup)
    online.source = ListSource([BatchRef(c.batch_id, c.key, c.sha256, {"mem:0": i + 1})
                                for i, c in enumerate(announced)])
    online.run(poll_timeout_s=0)
    assert [e["batch_ids"] for e in StepLog(store, RUN).read()] == [[c.batch_id] for c in announced]

    config = replay_config(tmp_path, setup, run_id="offline")
    config.learner = online.cfg
    offline = replay_train(config, RUN)
    assert [e["batch_ids"] for e in StepLog(store, "offline").read()] == [[c.batch_id] for c in announced]
    online_weights, offline_weights = online.policy.adapter_tensors(), offline.policy.adapter_tensors()
    assert all(torch.equal(online_weights[name], offline_weights[name]) for name in online_weights)


def test_generated_logprobs_equal_full_logits_path(setup):
    from consumers.batching import micro_batches
    from consumers.losses import token_logprobs

    policy = LoraPolicy(setup["model_dir"], LearnerConfig(lora_rank=4))
    with torch.no_grad():  # make the adapter non-trivial so LoRA is exercised
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    prompt = setup["prompt"]
    rows = [prompt + [setup["good"], 5, 7], prompt[:-3] + [setup["bad"]]]
    masks = [[0] * len(prompt) + [1, 1, 1], [0] * (len(prompt) - 3) + [1]]
    batch = micro_batches(rows, masks, [[0.0] * len(r) for r in rows], [1.0, -1.0], 100_000)[0]
    with torch.no_grad():
        fast = policy.generated_logprobs(batch.tokens_BT, batch.loss_mask_BT)
        full = token_logprobs(policy.logits(batch.tokens_BT), batch.tokens_BT) * (batch.loss_mask_BT > 0)
    assert fast.shape == full.shape
    assert torch.allclose(fast, full, atol=1e-5)
    assert int((fast != 0).sum()) == 4


def test_discount_recomputes_return_to_go_per_episode_at_ingest(store):
    archive = TrajectoryArchive(store)
    rows = [dict(
        run_id=RUN, batch_id="d0", episode_id="e", group_id="g", env="toy", env_seed=0, producer_id="p",
        policy_version=0, adapter_sha256=NO_ADAPTER_SHA, tokens=[1, 2, 3], loss_mask=[0, 0, 1], logprobs=[0.0, 0.0, -1.0],
        turn_rewards=[1.0], reward=3.0, num_turns=3, turn=turn, return_to_go=float(3 - turn), success=True,
        terminated=True, truncated=False, created_at=datetime(2026, 1, 1, tzinfo=UTC),
    ) for turn in (2, 0, 1)]
    info = archive.write_batch(RUN, rows, batch_id="d0", created=datetime(2026, 1, 1, tzinfo=UTC))
    table = archive.read_batch(info.path, info.sha256)
    discounted = with_discounted_returns(table, 0.5)
    assert discounted.column("return_to_go").to_pylist() == [1.0, 1.75, 1.5]
    assert discounted.drop_columns(["return_to_go"]).equals(table.drop_columns(["return_to_go"]))
    with pytest.raises(ValueError, match="not whole"):
        with_discounted_returns(table.slice(0, 2), 0.5)


def test_warm_start_publishes_the_source_adapter_as_v1_once(store, setup, tmp_path):
    write_batches(TrajectoryArchive(store), setup, 2, np.random.default_rng(7))
    source, _ = make_learner(store, setup)
    source.run(poll_timeout_s=0)  # run "learn": v1, v2

    def warm_learner(init_from):
        cfg = LearnerConfig(lora_rank=4, lora_alpha=8, learning_rate=2e-2, batch_rows=16, max_staleness=1000,
                            init_from=init_from)
        archive = TrajectoryArchive(store)
        return Learner(run_id="warm", base_model=setup["model_dir"], config=cfg,
                       policy=LoraPolicy(setup["model_dir"], cfg), archive=archive,
                       registry=AdapterRegistry(store, "warm"), checkpoints=CheckpointStore(store, "warm"),
                       source=ReplaySource(archive, "warm"))

    learner = warm_learner(f"{RUN}@latest")
    assert learner.resume() is False
    warm = AdapterRegistry(store, "warm")
    assert warm.versions() == [1] and learner.state.version == 1
    assert warm.show(1).metrics["warm_start_version"] == 2
    p_source = probability_of(setup["model_dir"], AdapterRegistry(store, RUN).pull(2, tmp_path / "a"),
                              setup["prompt"], setup["good"])
    p_warm = probability_of(setup["model_dir"], warm.pull(1, tmp_path / "b"), setup["prompt"], setup["good"])
    assert p_warm == pytest.approx(p_source, rel=1e-5)
    assert p_warm > 1.5 * probability_of(setup["model_dir"], None, setup["prompt"], setup["good"])
    again = warm_learner(f"{RUN}@latest")
    assert again.resume() is True and warm.versions() == [1]  # the step-0 checkpoint: no second warm start

    with pytest.raises(ValueError, match="has no published adapter"):
        Learner.warm_start(warm_learner("nosuchrun"), "nosuchrun")


def test_replay_publishes_the_last_step_even_between_publish_steps(tmp_path, setup):
    from consumers.service import replay_train
    from schemas.config import ModelConfig, RunConfig, StoreConfig

    store = ObjectStore(tmp_path.as_uri())
    write_batches(TrajectoryArchive(store), setup, 3, np.random.default_rng(11))
    config = RunConfig(run_id="sft", model=ModelConfig(base_model=setup["model_dir"]),
                       store=StoreConfig(root=tmp_path.as_uri()),
                       learner=LearnerConfig(loss="cross_entropy", advantage="raw", lora_rank=4, lora_alpha=8,
                                             batch_rows=16, publish_every=2, checkpoint_every=2,
                                             max_staleness=1000))
    learner = replay_train(config, RUN)
    registry = AdapterRegistry(store, "sft")
    assert learner.state.step == 3
    assert [registry.show(v).learner_step for v in registry.versions()] == [2, 3]
    assert CheckpointStore(store, "sft").latest().state.version == 2  # the checkpoint knows the last publish


def replay_config(tmp_path, setup, run_id="sft"):
    from schemas.config import ModelConfig, RunConfig, StoreConfig

    return RunConfig(run_id=run_id, model=ModelConfig(base_model=setup["model_dir"]),
                     store=StoreConfig(root=tmp_path.as_uri()),
                     learner=LearnerConfig(lora_rank=4, lora_alpha=8, batch_rows=16, max_staleness=1000))


def test_replay_refuses_a_rewritten_batch_before_training_anything(tmp_path, setup):
    """No broker, no dead-letter topic: training the other batches would train on part of the data silently."""
    from consumers.service import replay_train
    from pipeline.io.archive import parquet_bytes
    from pipeline.io.store import ChecksumError

    store = ObjectStore(tmp_path.as_uri())
    archive = TrajectoryArchive(store)
    write_batches(archive, setup, 3, np.random.default_rng(14))
    last = archive.commits(RUN)[-1]
    table = archive.read_batch(last.key)
    store.put(last.key, parquet_bytes(table.slice(1)))  # a valid Parquet file, one row short; its record kept
    with pytest.raises(ChecksumError, match=rf"batch {last.batch_id} of run {RUN} .*rlpipe runs delete --run {RUN}"):
        replay_train(replay_config(tmp_path, setup), RUN)
    assert store.list("runs") == [f"runs/{RUN}"]  # nothing trained, not even the run created


def test_a_resumed_replay_checks_the_batches_stored_since_before_training_any(tmp_path, setup):
    """A resumed replay lists its source again; a batch stored since, damaged, refuses the replay before it
    trains another step, as a damaged batch refuses a fresh replay."""
    from consumers.service import replay_train
    from pipeline.io.archive import parquet_bytes
    from pipeline.io.store import ChecksumError

    store = ObjectStore(tmp_path.as_uri())
    archive = TrajectoryArchive(store)
    write_batches(archive, setup, 2, np.random.default_rng(16))
    config = replay_config(tmp_path, setup)
    assert replay_train(config, RUN).state.step == 2
    write_batches(archive, setup, 2, np.random.default_rng(17), first=2)
    last = archive.commits(RUN)[-1]
    store.put(last.key, parquet_bytes(archive.read_batch(last.key).slice(1)))  # rewritten after its commit
    with pytest.raises(ChecksumError, match=rf"batch {last.batch_id} of run {RUN} "):
        replay_train(config, RUN)
    assert CheckpointStore(store, "sft").latest().state.step == 2  # nothing trained from the new batches


def test_replay_stops_at_a_batch_it_cannot_read_instead_of_skipping_it(tmp_path, setup):
    """A batch whose recorded digest matches but that the learner cannot read (a writer's bad bytes) would be
    dead-lettered by a live learner; replay has no dead-letter topic, so it stops, naming the batch."""
    from consumers.service import replay_train
    from pipeline.io.archive import BatchCommit
    from pipeline.io.archive_layout import commit_record_key
    from pipeline.io.store import sha256_hex

    store = ObjectStore(tmp_path.as_uri())
    archive = TrajectoryArchive(store)
    write_batches(archive, setup, 2, np.random.default_rng(15))
    bad = archive.commits(RUN)[-1]
    garbage = b"PAR1 this is not a parquet file"
    store.put(bad.key, garbage)
    store.put(commit_record_key(bad.key), bad.model_copy(update={"sha256": sha256_hex(garbage)}).model_dump_json()
              .encode())
    assert BatchCommit.model_validate_json(store.get(commit_record_key(bad.key))).sha256 == sha256_hex(garbage)
    with pytest.raises(ValueError, match=rf"replay stopped at trajectory batch {bad.batch_id} of run {RUN}: "
                                         r"\S+ is not a readable Parquet file"):
        replay_train(replay_config(tmp_path, setup), RUN)


def tensorboard_scalars(folder) -> dict[str, dict[int, float]]:
    """tag -> step -> value, read back the way TensorBoard reads a log folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert all(len({step for step, _ in points}) == len(points) for points in scalars.values()), "a step shown twice"
    return {tag: dict(points) for tag, points in scalars.items()}


def test_each_step_metrics_reach_tensorboard_and_a_retrained_step_replaces_the_crashed_one(store, setup, tmp_path):
    from consumers.tracking import TensorBoardLogger, step_scalars

    write_batches(TrajectoryArchive(store), setup, 4, np.random.default_rng(12), version=0)
    crashed, _ = make_learner(store, setup, max_steps=3, checkpoint_every=2)
    crashed.metric_logger = TensorBoardLogger(tmp_path / "tb")
    crashed.run(poll_timeout_s=0)  # step 3 is logged but never checkpointed: as if the process died there
    crashed.metric_logger.close()
    assert crashed.state.step == 3 and CheckpointStore(store, RUN).latest().state.step == 2

    resumed, _ = make_learner(store, setup)
    resumed.metric_logger = TensorBoardLogger(tmp_path / "tb")
    assert resumed.resume()
    resumed.run(poll_timeout_s=0)
    resumed.metric_logger.close()

    log = StepLog(store, RUN).read(upto=4)  # steps 1-2 from the first process, 3-4 trained after the resume
    assert [m["step"] for m in log] == [1, 2, 3, 4]
    scalars = tensorboard_scalars(tmp_path / "tb")
    expected: dict[str, dict[int, float]] = {}
    for metrics in log:
        step, values = step_scalars(metrics)
        for tag, value in values.items():
            expected.setdefault(tag, {})[step] = value
    assert {"loss", "reward_mean", "ratio_mean", "effective_sample_size", "tokens_per_s",
            "staleness_histogram/0", "staleness_mean"} <= scalars.keys()  # fmt: skip
    assert scalars.keys() == expected.keys()
    for tag, by_step in expected.items():
        assert scalars[tag] == pytest.approx(by_step), tag
    # the crashed process's step 3 differs in wall-clock throughput: only the retrained one is shown
    assert scalars["tokens_per_s"][3] == pytest.approx(log[2]["tokens_per_s"])
    assert crashed.last_metrics["step"] == 3 and log[2]["tokens_per_s"] != crashed.last_metrics["tokens_per_s"]


def test_replay_training_writes_tensorboard_event_files_under_the_run(tmp_path, setup):
    from consumers.service import replay_train
    from schemas.config import ModelConfig, RunConfig, StoreConfig

    store = ObjectStore(tmp_path.as_uri())
    write_batches(TrajectoryArchive(store), setup, 2, np.random.default_rng(13))
    config = RunConfig(run_id="tracked", model=ModelConfig(base_model=setup["model_dir"]),
                       store=StoreConfig(root=tmp_path.as_uri()),
                       learner=LearnerConfig(lora_rank=4, lora_alpha=8, batch_rows=16, max_staleness=1000))
    learner = replay_train(config, RUN)
    scalars = tensorboard_scalars(tmp_path / "runs" / "tracked" / "tensorboard")
    steps = StepLog(store, "tracked").read(upto=learner.state.step)
    assert scalars["loss"] == pytest.approx({m["step"]: m["loss"] for m in steps})
    assert sorted(scalars["reward_mean"]) == [1, 2]
class AlwaysGood:
    """A stand-in random generator under which every sample answers the rewarded token: a collapsed policy."""

    def random(self) -> float:
        return 0.0


def test_a_collapsed_step_shows_its_signs_in_the_metrics_and_warns_once(store, setup, caplog):
    archive = TrajectoryArchive(store)
    write_batches(archive, setup, 1, np.random.default_rng(3))
    write_batches(archive, setup, 2, AlwaysGood(), first=1)  # batches replay in batch-id order
    learner, _ = make_learner(store, setup)
    caplog.set_level(logging.WARNING, logger="rlpipe.learner")
    steps = []
    learner.run(poll_timeout_s=0, on_step=steps.append)
    assert len(steps) == 3
    healthy, collapsed = steps[0], steps[1]
    assert healthy["identical_group_share"] == 0.0 and healthy["zero_advantage_share"] < 0.5
    assert healthy["reward_spread"] > 0.3 and healthy["entropy_mean"] > 0
    assert collapsed["identical_group_share"] == 1.0 and collapsed["zero_advantage_share"] == 1.0
    assert collapsed["reward_spread"] == 0.0 and collapsed["loss"] == 0.0
    warned = [r.getMessage() for r in caplog.records if "signs of collapse" in r.getMessage()]
    # identical groups and zero advantages warn once, at step 2; the spread once its 3-step baseline is in
    assert [m.split(":")[0] for m in warned] == ["signs of collapse at step 2"] * 2 + ["signs of collapse at step 3"]
    assert "identical answers" in warned[0] and "advantage 0" in warned[1] and "reward spread" in warned[2]
    logged = StepLog(store, RUN).read()
    assert [entry["identical_group_share"] for entry in logged] == [0.0, 1.0, 1.0]


def test_keep_uncertain_groups_trains_only_the_groups_with_spread(store, setup):
    archive = TrajectoryArchive(store)
    write_batches(archive, setup, 1, AlwaysGood(), groups=1)  # one group, no spread
    write_batches(archive, setup, 1, np.random.default_rng(4), groups=1)  # one group with spread
    learner, _ = make_learner(store, setup, keep_uncertain_groups=0.5, batch_rows=16)
    steps = []
    learner.run(poll_timeout_s=0, on_step=steps.append)
    assert steps[0]["rows"] == 8 and steps[0]["identical_group_share"] == 0.5  # signs count every group


def test_a_steps_metrics_and_log_line_carry_the_trust_regions_measure(store, setup):
    from consumers.service import progress_line

    write_batches(TrajectoryArchive(store), setup, 1, np.random.default_rng(4))
    learner, _ = make_learner(store, setup, batch_rows=16, max_step_kl=1e-4)  # lr 2e-2: the step is beyond it
    steps = []
    learner.run(poll_timeout_s=0, on_step=steps.append)
    step = steps[0]
    assert step["full_step_kl"] > 1e-4 >= step["step_kl"] and step["step_scale"] < 1.0
    assert f"x{step['step_scale']:g}" in progress_line({"step": 1, **step})


def test_a_resumed_warm_start_keeps_its_kl_reference(store, setup):
    write_batches(TrajectoryArchive(store), setup, 1, np.random.default_rng(5))
    source, _ = make_learner(store, setup)
    source.run(poll_timeout_s=0)  # run "learn": v1

    def warm_learner():
        cfg = LearnerConfig(lora_rank=4, lora_alpha=8, learning_rate=2e-2, batch_rows=16, max_staleness=1000,
                            init_from=f"{RUN}@1", kl_coef=0.1)
        archive = TrajectoryArchive(store)
        return Learner(run_id="warmkl", base_model=setup["model_dir"], config=cfg,
                       policy=LoraPolicy(setup["model_dir"], cfg), archive=archive,
                       registry=AdapterRegistry(store, "warmkl"), checkpoints=CheckpointStore(store, "warmkl"),
                       source=ReplaySource(archive, "warmkl"))

    first = warm_learner()
    assert first.resume() is False
    warm = {name: t.clone() for name, t in first.policy.reference.items()}
    assert all(torch.equal(warm[name], t) for name, t in first.policy.adapter_tensors().items())
    write_batches(TrajectoryArchive(store), setup, 1, np.random.default_rng(6))
    learn_registry = AdapterRegistry(store, RUN)
    with pytest.MonkeyPatch.context() as patch:  # train the warm run on the batch written for "learn"
        patch.setattr(first, "source", ReplaySource(TrajectoryArchive(store), RUN))
        first.run(poll_timeout_s=0)
    trained = {name: t.clone() for name, t in first.policy.adapter_tensors().items()}
    assert first.state.step >= 1 and learn_registry.versions() == [1]  # "learn" itself untouched
    assert not all(torch.equal(warm[name], t) for name, t in trained.items())
    again = warm_learner()
    assert again.resume() is True
    assert again.policy.reference.keys() == warm.keys()
    assert all(torch.equal(warm[name], t) for name, t in again.policy.reference.items())
    assert all(torch.equal(trained[name], t) for name, t in again.policy.adapter_tensors().items())  # weights kept


def test_a_steps_writes_run_beside_the_next_steps_training_in_the_synchronous_order(tmp_path, setup):
    """run() publishes and checkpoints in a background thread, one step in flight; the store ends up the same."""
    results = {}
    for mode in ("run", "step by step"):
        store = ObjectStore((tmp_path / mode.replace(" ", "-")).as_uri())
        write_batches(TrajectoryArchive(store), setup, 4, np.random.default_rng(6))
        learner, announced = make_learner(store, setup)
        events: list[tuple[str, int, str]] = []  # (what, step, thread)
        train, publish = learner.train, learner.registry.publish_files

        def traced_train(rows, learner=learner, events=events, train=train):
            events.append(("train starts", learner.state.step + 1, threading.current_thread().name))
            return train(rows)

        def traced_publish(*args, events=events, publish=publish, **kwargs):
            events.append(("publish starts", kwargs["learner_step"], threading.current_thread().name))
            time.sleep(0.3)  # a slow store: the next step's training must not wait for it
            manifest = publish(*args, **kwargs)
            events.append(("publish ends", kwargs["learner_step"], threading.current_thread().name))
            return manifest

        learner.train, learner.registry.publish_files = traced_train, traced_publish
        if mode == "run":
            learner.run(poll_timeout_s=0)
        else:
            while refs := learner.source.poll(0):
                learner.ingest(refs)
                learner.step()
        assert not learner.outputs.writer.busy
        registry = AdapterRegistry(store, RUN)
        results[mode] = {
            "versions": [(v, registry.show(v).learner_step, registry.adapter_sha256(v)) for v in registry.versions()],
            "weights": learner.policy.adapter_tensors(),
            "announced": [(type(p).__name__, getattr(p, "version", None), getattr(p, "step", None)) for p in announced
                          if type(p).__name__ in ("AdapterPublished", "LearnerCheckpointed")],
            "checkpoint": (lambda c: (c.state.step, c.state.version))(CheckpointStore(store, RUN).latest()),
            "events": events,
        }
    pipelined, synchronous = results["run"], results["step by step"]
    assert [v for v, _, _ in pipelined["versions"]] == [1, 2, 3, 4]
    assert [(v, s) for v, s, _ in pipelined["versions"]] == [(v, s) for v, s, _ in synchronous["versions"]]
    assert all(torch.equal(pipelined["weights"][k], synchronous["weights"][k]) for k in pipelined["weights"])
    assert pipelined["announced"] == synchronous["announced"]  # publish, checkpoint, publish, ... in step order
    assert pipelined["checkpoint"] == synchronous["checkpoint"] == (4, 4)
    main = threading.main_thread().name
    events = pipelined["events"]
    assert all(thread != main for what, _, thread in events if what.startswith("publish"))
    for step in (1, 2, 3):  # step N + 1 trained while step N was being published
        assert events.index(("train starts", step + 1, main)) < next(
            i for i, e in enumerate(events) if e[:2] == ("publish ends", step))
    sync_events = [e[:2] for e in synchronous["events"]]
    for step in (1, 2, 3):  # step() alone returns with its writes done
        assert sync_events.index(("publish ends", step)) < sync_events.index(("train starts", step + 1))


def test_a_failed_background_write_stops_the_learner_before_its_checkpoint_and_commit(store, setup):
    write_batches(TrajectoryArchive(store), setup, 3, np.random.default_rng(7))
    learner, announced = make_learner(store, setup)
    publish = learner.registry.publish_files

    def failing_publish(*args, **kwargs):
        if kwargs["learner_step"] == 2:
            raise OSError("the store is unreachable")
        return publish(*args, **kwargs)

    learner.registry.publish_files = failing_publish
    with pytest.raises(OSError, match="unreachable"):
        learner.run(poll_timeout_s=0)
    latest = CheckpointStore(store, RUN).latest()
    assert (latest.state.step, latest.state.version) == (1, 1)  # step 2 left no checkpoint behind
    assert [type(p).__name__ for p in announced if type(p).__name__ != "LearnerProgress"] == [
        "AdapterPublished", "LearnerCheckpointed"]
    assert AdapterRegistry(store, RUN).versions() == [1]
    resumed, _ = make_learner(store, setup)  # a restart trains step 2 again and publishes it as v2
    resumed.resume()
    resumed.run(poll_timeout_s=0)
    assert AdapterRegistry(store, RUN).versions() == [1, 2, 3] and resumed.state.step == 3


def write_turn_batches(archive, setup, n_batches, rng, episodes=8, longest=4):
    """Per-turn episodes: each turn answers with one token; the bad one ends the episode (a fall), the good one
    moves the state on; 1 per turn survived, so good answers lead to longer episodes."""
    for b in range(n_batches):
        batch_id = f"t{b:03d}-{uuid.uuid4().hex[:6]}"
        rows = []
        for e in range(episodes):
            tokens = []
            while len(tokens) < longest and (not tokens or tokens[-1] == setup["good"]):
                tokens.append(setup["good"] if rng.random() < 0.5 else setup["bad"])
            fell = tokens[-1] == setup["bad"]
            for turn, token in enumerate(tokens):
                rows.append(dict(
                    run_id=RUN, batch_id=batch_id, episode_id=f"{batch_id}-e{e}", group_id=f"{batch_id}-g",
                    env="toy", env_seed=e, producer_id="p", policy_version=0, adapter_sha256=NO_ADAPTER_SHA,
                    tokens=setup["prompt"] + [token], loss_mask=[0] * len(setup["prompt"]) + [1],
                    logprobs=[0.0] * len(setup["prompt"]) + [float(setup["logp"][token])],
                    turn_rewards=[0.0 if token == setup["bad"] else 1.0], reward=float(len(tokens) - fell),
                    num_turns=len(tokens), turn=turn, return_to_go=float(sum(t == setup["good"] for t in tokens[turn:])),
                    success=not fell, terminated=fell, truncated=not fell, state=[float(turn), float(b % 3)],
                    created_at=datetime(2026, 1, 1, tzinfo=UTC),
                ))
        archive.write_batch(RUN, rows, batch_id=batch_id, created=datetime(2026, 1, 1, tzinfo=UTC))


def test_gae_advantages_from_the_rows_state_raise_the_answer_that_keeps_the_episode_going(store, setup, tmp_path):
    write_turn_batches(TrajectoryArchive(store), setup, 4, np.random.default_rng(7))
    learner, _ = make_learner(store, setup, advantage="gae", normalize_advantage_std=True, discount=0.9,
                              batch_rows=12)
    steps = []
    learner.run(poll_timeout_s=0, on_step=steps.append)
    assert steps and all(np.isfinite(s["loss"]) for s in steps)
    registry = AdapterRegistry(store, RUN)
    folder = registry.pull(registry.versions()[-1], tmp_path / "cache")
    before = probability_of(setup["model_dir"], None, setup["prompt"], setup["good"])
    assert probability_of(setup["model_dir"], folder, setup["prompt"], setup["good"]) > 1.5 * before


def test_gae_refuses_rows_without_a_state_naming_the_fix(store, setup):
    write_batches(TrajectoryArchive(store), setup, 1, np.random.default_rng(8))
    learner, _ = make_learner(store, setup, advantage="gae")
    with pytest.raises(ValueError, match="use advantage"):
        learner.run(poll_timeout_s=0)


def test_the_next_batches_are_read_while_a_step_trains(store, setup):
    write_batches(TrajectoryArchive(store), setup, 4, np.random.default_rng(7))
    learner, _ = make_learner(store, setup)  # 16 rows a step: one batch each
    readers, read = [], learner.archive.read_batch

    def recording(*args, **kwargs):
        readers.append(threading.current_thread().name)
        return read(*args, **kwargs)

    learner.archive.read_batch = recording
    learner.run(poll_timeout_s=0)
    assert learner.state.step == 4 and len(readers) == 4  # each batch read once
    # the first before any step; every later one on the read-ahead thread while an earlier step trained
    assert readers[0] == threading.current_thread().name
    assert all(name.startswith("rlpipe-read-ahead") for name in readers[1:]), readers


def test_a_replay_whose_rows_are_all_too_stale_publishes_no_version(setup, tmp_path):
    """Steps that trained nothing (every row older than max_staleness) leave the run's versions as they were."""
    from consumers.service import replay_train
    from schemas.config import RunConfig

    store = ObjectStore(tmp_path.as_uri())
    rng = np.random.default_rng(5)
    write_batches(TrajectoryArchive(store), setup, 3, rng)

    def config(max_staleness: int) -> RunConfig:
        return RunConfig.model_validate({
            "run_id": "off", "model": {"base_model": setup["model_dir"]}, "store": {"root": store.root},
            "learner": {"lora_rank": 4, "lora_alpha": 8, "batch_rows": 16, "publish_every": 2, "checkpoint_every": 2,
                        "max_staleness": max_staleness, "torch_threads": 1, "device": "cpu"},
            "producer": {"max_staleness": 1}})

    first = replay_train(config(1000), RUN)
    published = AdapterRegistry(store, "off").latest()
    assert first.state.step == 3 and published is not None and published.learner_step == 3  # the last, odd step too
    write_batches(TrajectoryArchive(store), setup, 2, rng, first=3)  # version 0 rows: too stale for max_staleness 1
    again = replay_train(config(1), RUN)
    assert again.state.step == 5 and again.state.dropped_stale_rows == 2 * 16
    assert AdapterRegistry(store, "off").latest() == published


def test_a_learner_reaching_max_steps_between_publish_steps_publishes_its_last_step_once(store, setup):
    """The run's last version holds every step it trained, and the final checkpoint records that version."""
    from consumers.service import finish

    write_batches(TrajectoryArchive(store), setup, 5, np.random.default_rng(9))
    learner, _ = make_learner(store, setup, max_steps=4, publish_every=3, checkpoint_every=3)
    learner.run(poll_timeout_s=0)
    finish(learner, lambda metrics: None)
    registry = AdapterRegistry(store, RUN)
    assert [registry.show(v).learner_step for v in registry.versions()] == [3, 4]
    with TemporaryDirectory() as cache:
        published = load_file(str(registry.pull(2, cache) / "adapter_model.safetensors"))
    trained = learner.policy.adapter_snapshot().weights
    assert published.keys() == trained.keys() and all(torch.equal(published[k], trained[k]) for k in trained)
    latest = CheckpointStore(store, RUN).latest()
    assert (latest.state.step, latest.state.version) == (4, 2)
    again, _ = make_learner(store, setup, max_steps=4, publish_every=3, checkpoint_every=3)
    assert again.resume()
    again.run(poll_timeout_s=0)  # the budget is reached already: nothing to train, nothing new to publish
    finish(again, lambda metrics: None)
    assert registry.versions() == [1, 2] and again.state.step == 4


def test_a_batch_read_ahead_and_then_skipped_as_a_duplicate_is_not_kept_in_memory(store, setup):
    from tests.consumers.value.test_learner import ListSource  # announcements from a list, one per poll

    write_batches(TrajectoryArchive(store), setup, 3, np.random.default_rng(10))
    refs = ReplaySource(TrajectoryArchive(store), RUN, batches_per_poll=3).poll(0)
    learner, _ = make_learner(store, setup)  # one batch a step
    learner.source = ListSource([refs[0], refs[0], refs[1], refs[2]])  # the first one announced twice in a row
    held = []
    learner.run(poll_timeout_s=0, on_step=lambda metrics: held.append(sorted(learner.reader.reads)))
    assert learner.duplicates_skipped == 1 and learner.state.step == 3
    # after step 2 only the third batch, read ahead for step 3, is held; nothing after the last step
    assert held[1:] == [[(refs[2].path, refs[2].sha256)], []]


@pytest.mark.parametrize("differs", [{"lora_alpha": 32}, {"target_modules": ["q_proj", "v_proj"]}])
def test_a_warm_start_from_an_adapter_of_another_lora_shape_is_refused_before_publishing(store, setup, differs):
    """Loading it would keep some of its weights (or scale them otherwise) and publish that as 'unchanged' v1."""
    write_batches(TrajectoryArchive(store), setup, 1, np.random.default_rng(11))
    source, _ = make_learner(store, setup, **differs)
    source.run(poll_timeout_s=0)  # run "learn": v1
    cfg = LearnerConfig(lora_rank=4, lora_alpha=8, batch_rows=16, init_from=f"{RUN}@1")
    archive = TrajectoryArchive(store)
    warm = Learner(run_id="warm", base_model=setup["model_dir"], config=cfg, policy=LoraPolicy(setup["model_dir"], cfg),
                   archive=archive, registry=AdapterRegistry(store, "warm"), checkpoints=CheckpointStore(store, "warm"),
                   source=ReplaySource(archive, "warm"))
    with pytest.raises(ValueError, match=next(iter(differs))):
        warm.resume()
    assert AdapterRegistry(store, "warm").versions() == []


def test_a_run_resumed_with_another_max_steps_and_learning_rate_trains_on_at_the_new_schedules_rate(store, setup):
    """Both are changes a restart may make (run.json records them): the step after the resume follows them."""
    write_batches(TrajectoryArchive(store), setup, 3, np.random.default_rng(12))
    first, _ = make_learner(store, setup, max_steps=2, lr_schedule="linear")
    first.run(poll_timeout_s=0)
    resumed, _ = make_learner(store, setup, max_steps=4, lr_schedule="linear", learning_rate=1e-2)
    assert resumed.resume()
    steps = []
    resumed.run(poll_timeout_s=0, on_step=steps.append)
    assert [m["step"] for m in steps] == [3]
    # linear decay over 4 steps, 2 taken: half of the new rate (not the old schedule's 0 at its own end)
    assert steps[0]["learning_rate"] == pytest.approx(1e-2 * (1 - 2 / 4))


def test_a_run_stopped_and_resumed_ends_with_the_weights_of_one_that_was_not(tmp_path, setup):
    """Dropout draws from the restored RNG, AdamW and the schedule from the restored state: bit for bit the same."""
    settings = {"lora_dropout": 0.3, "lr_schedule": "cosine", "warmup_steps": 1, "max_steps": 4}
    weights = []
    for stopped in (False, True):
        store = ObjectStore((tmp_path / f"stopped-{stopped}").as_uri())
        write_batches(TrajectoryArchive(store), setup, 4, np.random.default_rng(13))
        learner, _ = make_learner(store, setup, **settings)
        if stopped:
            learner.run(poll_timeout_s=0, should_stop=lambda learner=learner: learner.state.step >= 2)
            learner, _ = make_learner(store, setup, **settings)
            assert learner.resume() and learner.state.step == 2
        learner.run(poll_timeout_s=0)
        assert learner.state.step == 4
        weights.append(learner.policy.adapter_tensors())
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])


def test_a_decaying_schedule_without_max_steps_is_named_in_a_warning(store, setup, caplog):
    """It runs at a constant rate (there is nothing to decay over); the configuration cannot refuse it, since
    `rlpipe run --max-steps` sets the budget after the configuration is read."""
    import logging

    with caplog.at_level(logging.WARNING, logger="rlpipe.learner"):
        make_learner(store, setup, lr_schedule="cosine", max_steps=None)
    assert "learner.lr_schedule=cosine decays over learner.max_steps, which is not set" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlpipe.learner"):
        make_learner(store, setup, lr_schedule="cosine", max_steps=10)
    assert "lr_schedule" not in caplog.text


def test_a_resumed_replay_announces_nothing_again_having_no_broker(tmp_path, setup, caplog):
    """A replay's learner sends its events nowhere: a resumed replay neither announces its checkpoint and
    versions again nor logs that it did."""
    from consumers.service import replay_train

    store = ObjectStore(tmp_path.as_uri())
    write_batches(TrajectoryArchive(store), setup, 2, np.random.default_rng(18))
    config = replay_config(tmp_path, setup)
    assert replay_train(config, RUN).state.step == 2
    with caplog.at_level(logging.INFO, logger="rlpipe.learner"):
        again = replay_train(config, RUN)
    assert again.state.step == 2 and "resumed from" in caplog.text
    assert "announced again" not in caplog.text


def test_pipelining_sets_the_write_flags_inside_and_puts_them_back_on_leaving_even_on_an_error():
    """``Learner.pipelining`` (``run``, a packed run's ``step_beside``): the flags a step reads, restored as they were,
    nested or not, so a step that raised leaves no later ``step`` returning before its writes are done."""
    learner = Learner.__new__(Learner)  # only the two flags are read
    learner.pipelined, learner.letters_beside = False, False
    with learner.pipelining(letters_beside=True):
        assert (learner.pipelined, learner.letters_beside) == (True, True)
        with learner.pipelining():
            assert (learner.pipelined, learner.letters_beside) == (True, False)
        assert (learner.pipelined, learner.letters_beside) == (True, True)
    assert (learner.pipelined, learner.letters_beside) == (False, False)
    with pytest.raises(RuntimeError, match="step failed"), learner.pipelining(letters_beside=True):
        raise RuntimeError("step failed")
    assert (learner.pipelined, learner.letters_beside) == (False, False)
