"""learner.keep_versions: a long run's registry keeps the newest versions' files, not every version's."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from consumers.checkpoint import CheckpointStore
from consumers.faults import FaultInjector
from consumers.step_writer import StepOutputs
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.registry import AdapterRegistry, RetiredAdapterError
from pipeline.io.store import ObjectStore
from schemas.config import LearnerConfig
from tests.consumers import test_learner
from tests.consumers.test_learner import RUN, make_learner, write_batches

FILES = {"adapter_config.json": b"{}", "adapter_model.safetensors": b"weights"}


setup = test_learner.setup  # the tiny model's prompt and tokens (a module-scoped fixture)


@pytest.fixture
def store(tmp_path):
    return ObjectStore(tmp_path.as_uri())


def stored_files(store: ObjectStore, registry: AdapterRegistry, version: int) -> set[str]:
    """The names stored under a version's folder (its manifest, retired.json, its attempt folder's files)."""
    folder = registry.version_key(version)
    return {key.removeprefix(folder + "/").split("/")[-1] for key in store.list(folder, recursive=True)}


def publish(registry: AdapterRegistry, count: int) -> None:
    for _ in range(count):
        registry.publish_files(FILES, "tiny", parent_version=0, learner_step=1)


def outputs(store: ObjectStore, registry: AdapterRegistry, keep: int | None, keep_also=frozenset()) -> StepOutputs:
    return StepOutputs(RUN, "tiny", registry, CheckpointStore(store, RUN), lambda payload: None,
                       FaultInjector.from_env(), keep_versions=keep, keep_also=keep_also)


def test_a_learner_with_keep_versions_deletes_the_files_of_older_versions_and_keeps_their_numbers(store, setup,
                                                                                                tmp_path):
    for batch in range(6):  # each sampled with the version the learner is at when it reads it: none stale
        write_batches(TrajectoryArchive(store), setup, 1, np.random.default_rng(batch), version=batch, first=batch)
    learner, _ = make_learner(store, setup, keep_versions=3, max_staleness=2)
    learner.run(poll_timeout_s=0)
    registry = AdapterRegistry(store, RUN)
    assert registry.versions() == [1, 2, 3, 4, 5, 6]  # the numbers stay taken: versions stay dense
    for version in (1, 2, 3):
        assert stored_files(store, registry, version) == {"manifest.json", "retired.json"}
        with pytest.raises(RetiredAdapterError, match=r"learner\.keep_versions=3"):
            registry.pull(version, tmp_path / "cache")
    for version in (4, 5, 6):
        assert {"adapter_config.json", "adapter_model.safetensors"} <= stored_files(store, registry, version)


def test_without_keep_versions_every_version_keeps_its_files(store):
    registry = AdapterRegistry(store, RUN)
    publish(registry, 5)
    assert outputs(store, registry, keep=None).retire_old_versions(5) == 0
    assert all("adapter_model.safetensors" in stored_files(store, registry, v) for v in range(1, 6))


def test_a_learner_that_sets_keep_versions_later_retires_every_older_version_once(store):
    registry = AdapterRegistry(store, RUN)
    publish(registry, 8)  # published by a learner that kept every version
    writer = outputs(store, registry, keep=2)
    assert writer.retire_old_versions(8) == 6  # one listing finds v1-v6
    publish(registry, 1)
    assert writer.retire_old_versions(9) == 1  # then one version per publish: v7
    assert [v for v in range(1, 10) if "adapter_model.safetensors" in stored_files(store, registry, v)] == [8, 9]


def test_the_warm_start_v1_is_kept_when_the_learner_restores_its_kl_reference_from_it(store):
    registry = AdapterRegistry(store, RUN)
    publish(registry, 6)
    outputs(store, registry, keep=2, keep_also=frozenset({1})).retire_old_versions(6)
    kept = [v for v in range(1, 7) if "adapter_model.safetensors" in stored_files(store, registry, v)]
    assert kept == [1, 5, 6]


def test_keep_versions_below_what_the_staleness_bound_samples_is_refused_naming_the_fix():
    with pytest.raises(ValidationError, match=r"learner\.keep_versions 2 .* learner\.max_staleness 2.*at least 3"):
        LearnerConfig(keep_versions=2, max_staleness=2)
    assert LearnerConfig(keep_versions=3, max_staleness=2).keep_versions == 3
    assert LearnerConfig().keep_versions is None  # every version kept unless asked
