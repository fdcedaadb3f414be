"""Adapter hot-loading against the real broker: events arrive within seconds, and the rollout loop never waits.

The producer's adapter-event reader used to be a consumer-group member.  Before it
had joined, every ``poll_versions`` waited up to 15 s for the join (again every 75 s
until it joined; with default timings a join on the local broker took about 23 s),
so the rollout loop stalled.  These tests bound both: the time from ``open`` to an
event in hand, and the longest single ``poll_versions`` / ``refresh`` call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from pipeline.io.bus import EventPublisher
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from pipeline.runtime import Announcer
from producers.adapters import LOAD_RETRY_S, AdapterWatcher, KafkaAdapterEvents, sweep_dead_process_caches
from producers.samplers.base import AdapterHandle, SampleOutput, Sampler, SampleRequest
from schemas.config import BusConfig
from schemas.events import AdapterPublished

# Longest one poll_versions / refresh may take in the rollout loop.  The defect it guards against waited
# 15 s (a group join inside the poll); a loaded 2-core machine has shown 0.72 s for a poll that waits on
# nothing (kafka-python running its network task inline), so the bound sits well between the two.
CALL_BOUND_S = 2.0
ARRIVAL_BOUND_S = 5.0  # from publishing an event to having it in hand
OPEN_BOUND_S = 5.0  # connect and place at the end of the topic; no group join


def announce_version(publisher: EventPublisher, run_id: str, version: int) -> None:
    """An ``AdapterPublished`` event alone (no registry behind it): enough for the event path."""
    Announcer(publisher, run_id)(AdapterPublished(version=version, path=f"runs/{run_id}/adapters/v{version:06d}",
                                                  manifest_sha256="0" * 64, base_model="tiny", parent_version=0,
                                                  learner_step=version, files={}))


def poll_until_seen(events: list[KafkaAdapterEvents], timeout_s: float) -> tuple[list[list[int]], list[float]]:
    """Poll every reader as a rollout loop would until each has a version; (versions per reader, call durations)."""
    seen: list[list[int]] = [[] for _ in events]
    durations: list[float] = []
    deadline = time.monotonic() + timeout_s
    while not all(seen) and time.monotonic() < deadline:
        for versions, reader in zip(seen, events, strict=True):
            started = time.monotonic()
            versions += reader.poll_versions()
            durations.append(time.monotonic() - started)
        time.sleep(0.01)
    return seen, durations


def test_every_producer_gets_its_runs_new_version_within_seconds_without_waiting(bus_config: BusConfig) -> None:
    with EventPublisher(bus_config) as publisher:
        announce_version(publisher, "r1", 1)  # before the producers start: the registry covers it, not the topic
        opened = time.monotonic()
        readers = [KafkaAdapterEvents.open(bus_config, "r1") for _ in range(2)]  # two producers of one run
        open_s = (time.monotonic() - opened) / 2
        try:
            announce_version(publisher, "r2", 7)  # another run's version: not ours
            announce_version(publisher, "r1", 2)
            published = time.monotonic()
            seen, durations = poll_until_seen(readers, ARRIVAL_BOUND_S)
            arrival_s = time.monotonic() - published
            time.sleep(0.5)  # nothing more arrives: v1 predates the readers, v7 is r2's
            later = [reader.poll_versions() for reader in readers]
        finally:
            for reader in readers:
                reader.close()
    assert seen == [[2], [2]], f"after {arrival_s:.1f}s"
    assert later == [[], []]
    assert arrival_s < ARRIVAL_BOUND_S
    assert open_s < OPEN_BOUND_S
    assert max(durations) < CALL_BOUND_S, f"a poll took {max(durations):.2f}s"
    assert readers[0].follower.stats.skipped_other_runs == 1


class LoadRecorder(Sampler):
    """A sampler that only records which adapters it was asked to load."""

    eos_token_id, max_model_len = 0, 64

    def __init__(self) -> None:
        self.loaded: list[AdapterHandle] = []

    def generate(self, requests: list[SampleRequest], adapter: AdapterHandle | None = None, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int | None = None) -> list[SampleOutput]:
        raise AssertionError("not used here")

    def load_adapter(self, handle: AdapterHandle) -> None:
        self.loaded.append(handle)

    def unload_adapter(self, handle: AdapterHandle) -> None:
        """Nothing to free."""

    def close(self) -> None:
        """Nothing to release."""


def make_adapter(folder: Path, marker: int) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "marker": marker, "peft_type": "LORA"}))
    save_file({"lora_A": np.full((2, 4), marker, dtype=np.float32)}, str(folder / "adapter_model.safetensors"))
    return folder


def test_watcher_switches_on_the_event_and_refresh_never_waits(
    bus_config: BusConfig, memory_store: ObjectStore, tmp_path: Path
) -> None:
    registry = AdapterRegistry(memory_store, "r1")
    registry.publish(make_adapter(tmp_path / "a1", 1), base_model="tiny", parent_version=0, learner_step=0)
    sampler = LoadRecorder()
    events = KafkaAdapterEvents.open(bus_config, "r1")
    # the registry is read once (finding v1) and then not for an hour: v2 can only come through the topic
    watcher = AdapterWatcher(registry, sampler, tmp_path / "cache", max_loaded=2, events=events, registry_poll_s=3600)
    durations: list[float] = []
    try:
        with EventPublisher(bus_config) as publisher:
            watcher.refresh()
            assert [h.version for h in sampler.loaded] == [1]
            manifest = registry.publish(make_adapter(tmp_path / "a2", 2), base_model="tiny", parent_version=1,
                                        learner_step=1)
            Announcer(publisher, "r1")(registry.published_event(manifest))
            published = time.monotonic()
            while watcher.current().version < 2 and time.monotonic() - published < ARRIVAL_BOUND_S:  # type: ignore[union-attr]
                started = time.monotonic()
                watcher.refresh()
                durations.append(time.monotonic() - started)
                time.sleep(0.01)
            switch_s = time.monotonic() - published
    finally:
        events.close()
    assert [h.version for h in sampler.loaded] == [1, 2], f"after {switch_s:.1f}s"
    assert watcher.current().sha256 == registry.adapter_sha256(2)  # type: ignore[union-attr]
    assert switch_s < ARRIVAL_BOUND_S
    assert max(durations) < CALL_BOUND_S, f"a refresh took {max(durations):.2f}s"


def test_evicted_versions_leave_the_cache_and_close_removes_the_folder(memory_store: ObjectStore, tmp_path: Path) -> None:
    registry = AdapterRegistry(memory_store, "r1")
    cache = tmp_path / "adapter-cache" / "host-123"
    watcher = AdapterWatcher(registry, LoadRecorder(), cache, max_loaded=2, registry_poll_s=0.0)
    running: set[int] = {1}  # a group started on v1 is still sampling
    watcher.in_use = lambda: running
    for version in (1, 2, 3):
        registry.publish(make_adapter(tmp_path / f"a{version}", version), base_model="tiny",
                         parent_version=version - 1, learner_step=version)
        watcher.refresh()
    assert [h.version for h in watcher.loaded] == [2, 3]
    cached = lambda: sorted(p.name for p in (cache / "r1").iterdir())  # noqa: E731
    assert cached() == ["v000001", "v000002", "v000003"]  # evicted, but the running group may reload it
    running.clear()
    watcher.refresh()
    assert cached() == ["v000002", "v000003"]
    watcher.close()
    assert not cache.exists() and (tmp_path / "adapter-cache").exists()


def test_closing_one_runs_watcher_leaves_another_runs_adapters_in_a_shared_cache(memory_store: ObjectStore,
                                                                                 tmp_path: Path) -> None:
    """Packed runs with one configured producer id (``rlpipe run``'s ``packed-p0``) cache under one folder: a run
    that leaves removes its own versions only, and the folder goes with the last run."""
    cache = tmp_path / "adapter-cache" / "packed-p0"
    watchers = {}
    for run in ("r1", "r2"):
        registry = AdapterRegistry(memory_store, run)
        registry.publish(make_adapter(tmp_path / f"{run}-a1", 1), base_model="tiny", parent_version=0, learner_step=1)
        watchers[run] = AdapterWatcher(registry, LoadRecorder(), cache, max_loaded=2, registry_poll_s=0.0)
        watchers[run].refresh()
    watchers["r1"].close()
    assert not (cache / "r1").exists()
    assert (cache / "r2" / "v000001" / "adapter_config.json").is_file()  # r2 still samples with it
    watchers["r2"].close()
    assert not cache.exists()


def test_a_damaged_newest_manifest_keeps_the_loaded_version_and_is_not_retried_at_every_refresh(
    memory_store: ObjectStore, tmp_path: Path
) -> None:
    """A newest manifest that does not read (damaged, or from a newer rlpipe) raised out of every refresh,
    crash-looping every producer of the run; the producer keeps serving what it has and tries again later."""
    registry = AdapterRegistry(memory_store, "r1")
    registry.publish(make_adapter(tmp_path / "a1", 1), base_model="tiny", parent_version=0, learner_step=0)
    sampler = LoadRecorder()
    watcher = AdapterWatcher(registry, sampler, tmp_path / "cache", max_loaded=2, registry_poll_s=3600)
    watcher.refresh()
    memory_store.put("runs/r1/adapters/v000002/manifest.json", b'{"truncated": ')
    watcher.last_registry_poll = float("-inf")  # the poll interval has passed
    for _ in range(5):
        watcher.refresh()
    assert watcher.current().version == 1 and watcher.newest_published() == 2  # type: ignore[union-attr]
    assert watcher.load_failures == 1  # tried again after LOAD_RETRY_S, not at every refresh
    registry.publish(make_adapter(tmp_path / "a3", 3), base_model="tiny", parent_version=1, learner_step=3)
    watcher.last_registry_poll = float("-inf")
    watcher.refresh()
    assert [h.version for h in sampler.loaded] == [1, 3]


def test_the_sweep_removes_only_folders_of_dead_processes_of_this_host(tmp_path: Path) -> None:
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                              check=True)
    dead_pid = int(finished.stdout)
    names = [f"node-a_{dead_pid}", f"node-a_{os.getpid()}", f"node-b_{dead_pid}", "producer-0", "node-a_x"]
    for name in names:
        (tmp_path / name / "r1").mkdir(parents=True)
    removed = sweep_dead_process_caches(tmp_path, "node-a")
    assert [p.name for p in removed] == [f"node-a_{dead_pid}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])


def test_the_sweep_removes_the_per_run_folders_of_a_dead_packed_producer(tmp_path: Path) -> None:
    """A packed producer's default id in each run is ``<host>_<pid>-<run>``: its folders go with its process."""
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                              check=True)
    dead_pid = int(finished.stdout)
    names = [f"node-a_{dead_pid}-exp-1", f"node-a_{dead_pid}-exp-2", f"node-a_{os.getpid()}-exp-1", "node-a_x-1"]
    for name in names:
        (tmp_path / name / "exp-1").mkdir(parents=True)
    removed = sweep_dead_process_caches(tmp_path, "node-a")
    assert sorted(p.name for p in removed) == sorted(names[:2])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])


def test_the_sweep_leaves_the_folders_of_a_host_whose_name_extends_this_ones(tmp_path: Path) -> None:
    """Hosts ``node`` and ``node-<n>`` sharing one $RLPIPE_HOME: ``node``'s sweep must not read ``node-<n>``'s
    folders as its own with pid ``<n>`` (dead here), whatever that host's live producers are."""
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                              check=True)
    dead_pid = int(finished.stdout)
    other_host = f"node-{dead_pid}"
    names = [f"{other_host}_{os.getpid()}", f"{other_host}_{os.getpid()}-exp-1", f"node-{dead_pid}-exp-1"]
    for name in names:
        (tmp_path / name / "exp-1").mkdir(parents=True)
    assert sweep_dead_process_caches(tmp_path, "node") == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)


def test_a_default_producer_id_ends_its_host_at_the_only_underscore(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep reads the host as what comes before the first ``_``: a host name's own ``_`` becomes ``-``."""
    import socket

    from producers.service import default_producer_id

    monkeypatch.setattr(socket, "gethostname", lambda: "lab_node 7")
    assert default_producer_id() == f"lab-node-7_{os.getpid()}"
    with pytest.raises(ValueError, match="replace it by '-'"):
        sweep_dead_process_caches(".", "lab_node")

def test_an_evicted_version_a_running_group_reloaded_is_unloaded_once_no_group_uses_it(
    memory_store: ObjectStore, tmp_path: Path, tiny_trained_dir: Path, lora_adapters: tuple[AdapterHandle, ...]
) -> None:
    """A group still sampling on an evicted version makes the sampler load it again; once that group is done the
    version leaves the sampler with its cached folder, or every such version stays loaded for the rest of the run."""
    from producers.samplers.hf_sampler import TransformersSampler
    from tests.fixtures.vllm import save_random_lora

    registry = AdapterRegistry(memory_store, "r1")
    folders = [Path(h.path) for h in lora_adapters] + [save_random_lora(tiny_trained_dir, tmp_path / "v3", seed=3)]
    sampler = TransformersSampler(str(tiny_trained_dir))
    watcher = AdapterWatcher(registry, sampler, tmp_path / "cache", max_loaded=2, registry_poll_s=0.0)
    running: set[int] = {1}  # a group started on v1 is still sampling
    watcher.in_use = lambda: running
    registry.publish(folders[0], base_model="tiny", parent_version=0, learner_step=1)
    watcher.refresh()
    v1 = watcher.current()
    for version in (2, 3):
        registry.publish(folders[version - 1], base_model="tiny", parent_version=version - 1, learner_step=version)
        watcher.refresh()
    assert [h.version for h in watcher.loaded] == [2, 3] and v1.name not in sampler._handles  # type: ignore[union-attr]
    sampler.generate([SampleRequest([1, 2, 3], 2)], v1, seed=0)  # the running group's next turn reloads v1
    assert v1.name in sampler._handles  # type: ignore[union-attr]
    running.clear()
    watcher.refresh()
    assert sorted(sampler._handles) == sorted(h.name for h in watcher.loaded)
    assert not Path(v1.path).exists()  # type: ignore[union-attr]
    sampler.close()


class RefusingRecorder(LoadRecorder):
    """A sampler that refuses the adapter folders named in ``refused`` as vLLM or peft refuses bad weights."""

    def __init__(self, refused: set[int]) -> None:
        super().__init__()
        self.refused = refused

    def load_adapter(self, handle: AdapterHandle) -> None:
        if handle.version in self.refused:
            raise ValueError(f"vLLM refused adapter {handle.name} from {handle.path}: shapes do not match")
        super().load_adapter(handle)


def publish_versions(registry: AdapterRegistry, tmp_path: Path, base_models: list[str]) -> None:
    for version, base_model in enumerate(base_models, start=1):
        registry.publish(make_adapter(tmp_path / f"a{version}", version), base_model=base_model,
                         parent_version=version - 1, learner_step=version)


def refresh_now(watcher: AdapterWatcher) -> None:
    watcher.last_registry_poll = float("-inf")  # the poll interval has passed
    watcher.refresh()


def test_a_version_the_sampler_refuses_keeps_the_loaded_one_serving(memory_store: ObjectStore, tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    registry = AdapterRegistry(memory_store, "r1")
    publish_versions(registry, tmp_path, ["tiny"])
    sampler = RefusingRecorder(refused={2})
    watcher = AdapterWatcher(registry, sampler, tmp_path / "cache", max_loaded=2, registry_poll_s=3600,
                             base_models={"tiny"})
    refresh_now(watcher)
    registry.publish(make_adapter(tmp_path / "a2", 2), base_model="tiny", parent_version=1, learner_step=2)
    with caplog.at_level("WARNING", logger="rlpipe.producer"):
        for _ in range(3):
            refresh_now(watcher)
    assert watcher.current().version == 1 and watcher.load_failures == 1  # type: ignore[union-attr]
    assert [h.version for h in sampler.loaded] == [1]
    refusal = [r.getMessage() for r in caplog.records if "v2" in r.getMessage()]
    assert len(refusal) == 1 and "shapes do not match" in refusal[0] and "\n" not in refusal[0]
    assert not (tmp_path / "cache" / "r1" / "v000002").exists()  # a refused version leaves no folder behind


class FailingOnceRecorder(LoadRecorder):
    """A sampler whose first load of each version fails with ``error`` (short of memory, a folder gone missing)."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error, self.tried = error, set()

    def load_adapter(self, handle: AdapterHandle) -> None:
        if handle.version not in self.tried:
            self.tried.add(handle.version)
            raise self.error
        super().load_adapter(handle)


@pytest.mark.parametrize("error", [RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"),
                                   FileNotFoundError("no adapter_config.json in the cache folder")])
def test_a_version_the_sampler_failed_to_load_for_a_passing_reason_is_tried_again(
    memory_store: ObjectStore, tmp_path: Path, caplog: pytest.LogCaptureFixture, error: Exception
) -> None:
    """Only a refusal of the weights (ValueError) is for good: a load that failed for want of memory or a file is
    tried again after ``LOAD_RETRY_S``, with one warning, and then serves."""
    registry = AdapterRegistry(memory_store, "r1")
    publish_versions(registry, tmp_path, ["tiny"])
    sampler = FailingOnceRecorder(error)
    watcher = AdapterWatcher(registry, sampler, tmp_path / "cache", max_loaded=2, registry_poll_s=3600,
                             base_models={"tiny"})
    with caplog.at_level("WARNING", logger="rlpipe.producer"):
        refresh_now(watcher)
        refresh_now(watcher)  # before LOAD_RETRY_S: not tried again
    assert watcher.current() is None and watcher.load_failures == 1
    assert len([r for r in caplog.records if "v1" in r.getMessage() and str(error) in r.getMessage()]) == 1
    watcher.failed_at[1] -= LOAD_RETRY_S  # the retry interval has passed
    refresh_now(watcher)
    assert watcher.current().version == 1 and [h.version for h in sampler.loaded] == [1]  # type: ignore[union-attr]


def test_a_version_of_another_base_model_is_refused_before_it_is_pulled(memory_store: ObjectStore, tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    registry = AdapterRegistry(memory_store, "r1")
    publish_versions(registry, tmp_path, ["tiny", "Qwen/Qwen3-8B"])
    registry.publish_files({"value_network.safetensors": b"x", "value_config.json": b"{}"}, base_model="tiny",
                           parent_version=2, learner_step=3, kind="value-network")
    sampler = LoadRecorder()
    watcher = AdapterWatcher(registry, sampler, tmp_path / "cache", max_loaded=2, registry_poll_s=3600,
                             base_models={"tiny", "/models/tiny"})
    watcher.load(1)
    with caplog.at_level("WARNING", logger="rlpipe.producer"):
        watcher.load(2)
        watcher.load(3)
    assert [h.version for h in sampler.loaded] == [1] and watcher.current().version == 1  # type: ignore[union-attr]
    assert watcher.load_failures == 2
    messages = [r.getMessage() for r in caplog.records]
    assert any("v2" in m and "Qwen/Qwen3-8B" in m and "model.base_model" in m for m in messages), messages
    assert any("v3" in m and "value-network" in m for m in messages), messages
    assert sorted(p.name for p in (tmp_path / "cache" / "r1").iterdir()) == ["v000001"]


def test_a_tiny_model_version_is_served_by_its_build_not_by_the_folder_the_learner_kept_it_in(
    memory_store: ObjectStore, tmp_path: Path
) -> None:
    """The learner records the tiny model's folder under its own RLPIPE_HOME (or its tiny_dir): the producer
    serves it when its own tiny model is the same build (the spec hash of its marker, or of a default folder's
    name ``tiny-<hash>``), and refuses another build's."""
    from producers.tiny_model import MARKER_FILE

    ours = tmp_path / "producer-home" / "models" / "my-tiny"  # a configured tiny_dir, built here
    ours.mkdir(parents=True)
    (ours / MARKER_FILE).write_text(json.dumps({"spec_hash": "0123456789abcdef"}))
    other_build = tmp_path / "other" / "tiny-model"  # readable here, built from other parameters
    other_build.mkdir(parents=True)
    (other_build / MARKER_FILE).write_text(json.dumps({"spec_hash": "fedcba9876543210"}))
    registry = AdapterRegistry(memory_store, "r1")
    publish_versions(registry, tmp_path, ["/learner-home/models/tiny-0123456789abcdef",  # same build, elsewhere
                                          "/learner-home/models/tiny-fedcba9876543210", str(other_build),
                                          "/learner-home/models/Qwen3-8B"])
    sampler = LoadRecorder()
    watcher = AdapterWatcher(registry, sampler, tmp_path / "cache", max_loaded=4, registry_poll_s=3600,
                             base_models={"tiny", str(ours)})
    for version in (1, 2, 3, 4):
        watcher.load(version)
    assert [h.version for h in sampler.loaded] == [1] and watcher.load_failures == 3


@pytest.mark.parametrize("damage", ["missing file", "other bytes"])
def test_a_version_with_damaged_files_keeps_the_loaded_one_serving(memory_store: ObjectStore, tmp_path: Path,
                                                                   damage: str) -> None:
    registry = AdapterRegistry(memory_store, "r1")
    publish_versions(registry, tmp_path, ["tiny", "tiny"])
    stored = next(k for k in memory_store.list("runs/r1/adapters/v000002", recursive=True)
                  if k.endswith("adapter_model.safetensors"))
    if damage == "missing file":
        memory_store.delete(stored)
    else:
        memory_store.put(stored, b"not the published weights")
    sampler = LoadRecorder()
    watcher = AdapterWatcher(registry, sampler, tmp_path / "cache", max_loaded=2, registry_poll_s=3600,
                             base_models={"tiny"})
    watcher.load(1)
    assert watcher.load(2) is None
    assert [h.version for h in sampler.loaded] == [1] and watcher.load_failures == 1
    assert sorted(p.name for p in (tmp_path / "cache" / "r1").iterdir()) == ["v000001"]


def test_versions_only_go_forward_and_one_published_before_the_start_is_loaded_at_once(
    memory_store: ObjectStore, tmp_path: Path
) -> None:
    registry = AdapterRegistry(memory_store, "r1")
    publish_versions(registry, tmp_path, ["tiny", "tiny", "tiny"])  # while the producer was down

    class LateEvents:
        def __init__(self) -> None:
            self.pending: list[int] = []

        def poll_versions(self) -> list[int]:
            out, self.pending = self.pending, []
            return out

    events = LateEvents()
    sampler = LoadRecorder()
    watcher = AdapterWatcher(registry, sampler, tmp_path / "cache", max_loaded=2, events=events,
                             registry_poll_s=3600, base_models={"tiny"})
    watcher.refresh()  # the first refresh reads the registry: the newest version, not the first
    assert [h.version for h in sampler.loaded] == [3]
    events.pending = [2, 1]  # announced late
    watcher.refresh()
    assert [h.version for h in sampler.loaded] == [3] and watcher.newest_published() == 3


def test_the_record_of_failed_versions_keeps_only_those_not_yet_passed(memory_store: ObjectStore,
                                                                       tmp_path: Path) -> None:
    """A producer that can serve none of a run's versions (another base model) is told of each one for days: its
    record of failed loads keeps only versions it may still load (those not below the newest it tried)."""
    registry = AdapterRegistry(memory_store, "r1")
    watcher = AdapterWatcher(registry, LoadRecorder(), tmp_path / "cache", max_loaded=2, registry_poll_s=3600,
                             base_models={"tiny"})
    for version in range(1, 9):
        registry.publish(make_adapter(tmp_path / f"a{version}", version), base_model="Qwen/Qwen3-8B",
                         parent_version=version - 1, learner_step=version)
        refresh_now(watcher)
    assert watcher.load_failures == 8 and watcher.current() is None
    assert list(watcher.failed_at) == [8]
    registry.publish(make_adapter(tmp_path / "a9", 9), base_model="tiny", parent_version=8, learner_step=9)
    refresh_now(watcher)  # a version it serves: no failed one is left behind it
    assert watcher.current().version == 9 and watcher.failed_at == {}  # type: ignore[union-attr]


def test_the_registry_poll_lists_the_versions_once_and_then_probes_only_the_next(memory_store: ObjectStore,
                                                                                 tmp_path: Path) -> None:
    """A producer polls the registry every ``registry_poll_s`` for days: a listing of every version (one more per
    learner step, so a poll that grows with the run) only at its first poll, then a look at the next number."""
    registry = AdapterRegistry(memory_store, "r1")
    publish_versions(registry, tmp_path, ["tiny"] * 3)  # before the producer started
    listed: list[str] = []
    listing = memory_store.list
    memory_store.list = lambda prefix="", recursive=False: listed.append(prefix) or listing(prefix, recursive)  # type: ignore[method-assign]
    sampler = LoadRecorder()
    watcher = AdapterWatcher(registry, sampler, tmp_path / "cache", max_loaded=2, registry_poll_s=3600,
                             base_models={"tiny"})
    refresh_now(watcher)
    assert watcher.current().version == 3 and len(listed) == 1  # type: ignore[union-attr]
    for version in range(4, 9):
        refresh_now(watcher)  # nothing new
        memory_store.list = listing  # type: ignore[method-assign]
        registry.publish(make_adapter(tmp_path / f"a{version}", version), base_model="tiny",
                         parent_version=version - 1, learner_step=version)
        memory_store.list = lambda prefix="", recursive=False: listed.append(prefix) or listing(prefix, recursive)  # type: ignore[method-assign]
        refresh_now(watcher)
        assert watcher.current().version == version  # type: ignore[union-attr]
    assert len(listed) == 1, listed
