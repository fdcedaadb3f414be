"""What the packed-learner tests share: two runs (a, b) over test_learner's batches, each run's learner settings,
a learner of a run reading its batches from the store, and the adapter a run checkpointed last."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from consumers.checkpoint import CheckpointStore
from consumers.learner import Learner
from consumers.policy import LoraPolicy
from consumers.sources import ReplaySource
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from schemas.config import LearnerConfig
from tests.consumers import test_learner
from tests.consumers.test_learner import setup  # noqa: F401  # the module fixture: tiny model, prompt, answers

SOURCES = {"a": 0, "b": 1}  # run -> seed of its batches' answers


def config(run: str, **overrides) -> LearnerConfig:
    values = {"lora_rank": 4, "lora_alpha": 8, "learning_rate": 2e-2, "batch_rows": 16, "publish_every": 1,
              "checkpoint_every": 2, "max_staleness": 1000, "device": "cpu",
              # the runs differ in more than their data: schedule, KL penalty, seed
              "seed": 3 if run == "b" else 0, "kl_coef": 0.05 if run == "b" else 0.0,
              "lr_schedule": "cosine", "max_steps": 4, **overrides}
    return LearnerConfig(**values)


def learner_of(store: ObjectStore, run: str, source_run: str, policy: LoraPolicy, cfg: LearnerConfig) -> Learner:
    archive = TrajectoryArchive(store)
    return Learner(run_id=run, base_model="tiny", config=cfg, policy=policy, archive=archive,
                   registry=AdapterRegistry(store, run), checkpoints=CheckpointStore(store, run),
                   source=ReplaySource(archive, source_run))


@pytest.fixture
def batches(tmp_path, setup, monkeypatch):  # noqa: F811
    store = ObjectStore(tmp_path.as_uri())
    for run, seed in SOURCES.items():  # test_learner's batches, under run src-<run>
        monkeypatch.setattr(test_learner, "RUN", f"src-{run}")
        test_learner.write_batches(TrajectoryArchive(store), setup, 4, np.random.default_rng(seed))
    return store


def adapter_of(store: ObjectStore, run: str) -> dict[str, torch.Tensor]:
    checkpoint = CheckpointStore(store, run).latest()
    assert checkpoint is not None
    return checkpoint.adapter
