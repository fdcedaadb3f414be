"""AdapterRegistry: dense versions under racing publishers, manifests as commit points, verified pulls."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from pipeline.io.registry import AdapterNotFoundError, AdapterRegistry, RegistryError, read_adapter_folder
from pipeline.io.store import ChecksumError, ObjectStore
from schemas.registry import AdapterManifest, ManifestError, manifest_from_bytes, manifest_to_bytes
from schemas.versions import SchemaVersionError


def make_adapter(folder: Path, marker: int) -> dict[str, bytes]:
    """A tiny PEFT-like folder whose bytes depend on ``marker``; returns name -> bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "marker": marker, "peft_type": "LORA"}))
    save_file({"lora_A": np.full((2, 4), marker, dtype=np.float32)}, str(folder / "adapter_model.safetensors"))
    (folder / "README.md").write_text(f"adapter {marker}\n")
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_publish_commits_dense_versions_with_digests(any_store: ObjectStore, tmp_path: Path) -> None:
    registry = AdapterRegistry(any_store, "run1")
    assert registry.latest() is None and registry.versions() == []
    files = make_adapter(tmp_path / "a", marker=1)
    first = registry.publish(tmp_path / "a", "tiny", parent_version=0, learner_step=10, metrics={"loss": 0.5})
    second = registry.publish(tmp_path / "a", "tiny", parent_version=1, learner_step=20)
    assert (first.version, second.version) == (1, 2)
    assert registry.versions() == [1, 2]
    assert registry.latest() == second
    shown = registry.show(1)
    assert shown == first
    assert (shown.base_model, shown.parent_version, shown.learner_step, shown.metrics) == ("tiny", 0, 10, {"loss": 0.5})
    assert {name: entry.sha256 for name, entry in shown.files.items()} == {
        name: hashlib.sha256(data).hexdigest() for name, data in files.items()
    }
    for name, entry in shown.files.items():  # the stored objects are the folder's bytes
        assert any_store.get(f"runs/run1/adapters/v000001/{entry.path}", entry.sha256) == files[name]


def test_adapter_sha256_is_the_manifest_digest(any_store: ObjectStore, tmp_path: Path) -> None:
    make_adapter(tmp_path / "a", marker=3)
    registry = AdapterRegistry(any_store, "run1")
    manifest = registry.publish(tmp_path / "a", "tiny", 0, 1)
    stored = any_store.get("runs/run1/adapters/v000001/manifest.json")
    assert registry.adapter_sha256(1) == hashlib.sha256(stored).hexdigest()
    event = registry.published_event(manifest)
    assert event.manifest_sha256 == registry.adapter_sha256(1)
    assert event.path == "runs/run1/adapters/v000001" and event.version == 1
    assert event.files == {name: entry.sha256 for name, entry in manifest.files.items()}
    assert manifest_to_bytes(manifest_from_bytes(stored)) == stored  # canonical: re-encoding is stable


def test_missing_version_is_a_clear_error(memory_store: ObjectStore) -> None:
    with pytest.raises(AdapterNotFoundError, match="has no adapter version 4"):
        AdapterRegistry(memory_store, "run1").show(4)


@pytest.mark.parametrize("store_fixture", ["gcs_store", "file_store"])
def test_twenty_racing_publishers_get_versions_one_to_twenty(
    store_fixture: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    store: ObjectStore = request.getfixturevalue(store_fixture)
    registry = AdapterRegistry(store, "race")
    folders = {marker: make_adapter(tmp_path / f"p{marker}", marker) for marker in range(20)}
    results: dict[int, AdapterManifest] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(20)

    def publish(marker: int) -> None:
        try:
            barrier.wait()
            results[marker] = registry.publish(tmp_path / f"p{marker}", "tiny", 0, marker, {"marker": float(marker)})
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=publish, args=(m,)) for m in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sorted(m.version for m in results.values()) == list(range(1, 21))
    assert registry.versions() == list(range(1, 21))
    for marker, manifest in results.items():
        stored = registry.show(manifest.version)  # intact and exactly what that publisher committed
        assert stored == manifest and stored.metrics == {"marker": float(marker)}
        for name, entry in stored.files.items():
            data = store.get(f"{registry.version_key(stored.version)}/{entry.path}", entry.sha256)
            assert data == folders[marker][name]
        staged = {key.split("/")[4] for key in store.list(registry.version_key(stored.version), recursive=True)}
        assert staged == {"manifest.json", next(iter(stored.files.values())).path.split("/")[0]}  # losers cleaned up


def test_a_stale_publisher_loses_the_race_without_touching_the_winner(file_store: ObjectStore, tmp_path: Path) -> None:
    winner_files = make_adapter(tmp_path / "w", marker=1)
    make_adapter(tmp_path / "l", marker=2)
    winner = AdapterRegistry(file_store, "run1").publish(tmp_path / "w", "tiny", 0, 1)
    stale = AdapterRegistry(file_store, "run1")
    seen = iter([1])  # the loser's first listing predates the winner's manifest
    original = stale._next_version
    stale._next_version = lambda: next(seen, None) or original()  # type: ignore[method-assign]
    loser = stale.publish(tmp_path / "l", "tiny", 0, 2)
    assert (winner.version, loser.version) == (1, 2)
    v1 = stale.show(1)
    assert v1 == winner
    assert {
        name: file_store.get(f"runs/run1/adapters/v000001/{e.path}") for name, e in v1.files.items()
    } == winner_files
    assert len({key.split("/")[4] for key in file_store.list("runs/run1/adapters/v000001", recursive=True)}) == 2


def test_orphan_staging_does_not_block_or_leak_into_a_version(memory_store: ObjectStore, tmp_path: Path) -> None:
    registry = AdapterRegistry(memory_store, "run1")
    make_adapter(tmp_path / "a", marker=1)
    registry.publish(tmp_path / "a", "tiny", 0, 1)
    # A publisher crashed after staging files for v2 but before its manifest.
    memory_store.put_create("runs/run1/adapters/v000002/deadbeef/adapter_model.safetensors", b"junk")
    manifest = registry.publish(tmp_path / "a", "tiny", 1, 2)
    assert manifest.version == 2
    assert all(not entry.path.startswith("deadbeef/") for entry in manifest.files.values())
    assert registry.versions() == [1, 2]


def test_pull_verifies_and_reuses_the_cache(any_store: ObjectStore, tmp_path: Path) -> None:
    files = make_adapter(tmp_path / "a", marker=7)
    registry = AdapterRegistry(any_store, "run1")
    registry.publish(tmp_path / "a", "tiny", 0, 1)
    cache = tmp_path / "cache"
    folder = registry.pull(1, cache)
    assert folder == cache / "run1" / "v000001"
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.name != "manifest.json"} == files
    (folder / "adapter_model.safetensors").write_bytes(b"locally damaged")
    again = registry.pull(1, cache)  # the damaged cache is noticed and fetched afresh
    assert (again / "adapter_model.safetensors").read_bytes() == files["adapter_model.safetensors"]


def test_pull_refuses_a_tampered_file_and_leaves_nothing(any_store: ObjectStore, tmp_path: Path) -> None:
    make_adapter(tmp_path / "a", marker=7)
    registry = AdapterRegistry(any_store, "run1")
    manifest = registry.publish(tmp_path / "a", "tiny", 0, 1)
    key = f"runs/run1/adapters/v000001/{manifest.files['adapter_model.safetensors'].path}"
    data = bytearray(any_store.get(key))
    data[-1] ^= 0x01
    any_store.put(key, bytes(data))
    cache = tmp_path / "cache"
    with pytest.raises(ChecksumError, match=r"adapter_model\.safetensors"):
        registry.pull(1, cache)
    assert list((cache / "run1").iterdir()) == []  # no partial or final folder


def test_publish_refuses_bad_folders(memory_store: ObjectStore, tmp_path: Path) -> None:
    registry = AdapterRegistry(memory_store, "run1")
    with pytest.raises(RegistryError, match="does not exist"):
        registry.publish(tmp_path / "missing", "tiny", 0, 1)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "adapter_config.json").write_text("{}")
    with pytest.raises(RegistryError, match=r"lacks adapter_model\.safetensors"):
        read_adapter_folder(tmp_path / "half")
    make_adapter(tmp_path / "pickled", marker=1)
    (tmp_path / "pickled" / "optimizer.pt").write_bytes(b"\x80\x04")
    with pytest.raises(RegistryError, match=r"refusing pickled file optimizer\.pt"):
        registry.publish(tmp_path / "pickled", "tiny", 0, 1)
    make_adapter(tmp_path / "ok", marker=1)
    with pytest.raises(ValueError, match="parent_version 1 must be below version 1"):
        registry.publish(tmp_path / "ok", "tiny", 1, 1)
    with pytest.raises(ValueError, match="finite"):
        registry.publish(tmp_path / "ok", "tiny", 0, 1, {"loss": float("nan")})
    assert memory_store.list("runs", recursive=True) == []  # nothing was uploaded by the refused calls


def test_manifest_versions_and_garbage(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="not JSON"):
        manifest_from_bytes(b"\xff{")
    with pytest.raises(SchemaVersionError, match="upgrade rlpipe"):
        manifest_from_bytes(json.dumps({"schema_version": "2.0"}).encode())
    with pytest.raises(ManifestError, match="files"):
        manifest_from_bytes(
            json.dumps(
                {"run_id": "r", "version": 1, "base_model": "t", "parent_version": 0, "learner_step": 0, "files": {}}
            ).encode()
        )


def test_a_manifest_copied_to_another_version_is_refused(memory_store: ObjectStore, tmp_path: Path) -> None:
    make_adapter(tmp_path / "a", marker=1)
    registry = AdapterRegistry(memory_store, "run1")
    registry.publish(tmp_path / "a", "tiny", 0, 1)
    memory_store.put_create("runs/run1/adapters/v000002/manifest.json", registry.manifest_bytes(1))
    with pytest.raises(ManifestError, match="claims run 'run1' version 1"):
        registry.show(2)


class RetriedCreateStore(ObjectStore):
    """A file store whose create of a key ending in one of ``ghost_suffixes`` succeeds and then reports
    ``FileExistsError``: a retried GCS upload whose first attempt landed but whose answer was lost."""

    def __init__(self, root: str, ghost_suffixes: tuple[str, ...]) -> None:
        super().__init__(root)
        self.ghost_suffixes, self.ghosts = ghost_suffixes, 0

    def _local_write(self, path: str, data: bytes, replace: bool, sync_folder: bool = True) -> list[Path]:
        changed = super()._local_write(path, data, replace, sync_folder)  # every create on local disk ends here
        if not replace and path.endswith(self.ghost_suffixes):
            self.ghosts += 1
            raise FileExistsError(f"{path} already exists")
        return changed


@pytest.mark.parametrize("ghost", ["manifest.json", "adapter_model.safetensors"])
def test_a_create_conflict_on_our_own_write_keeps_the_committed_version(tmp_path: Path, ghost: str) -> None:
    store = RetriedCreateStore((tmp_path / "store").as_uri(), (ghost,))
    files = make_adapter(tmp_path / "a", marker=5)
    registry = AdapterRegistry(store, "run1")
    manifest = registry.publish(tmp_path / "a", "tiny", 0, 1)
    assert store.ghosts == 1 and manifest.version == 1 and registry.versions() == [1]
    assert registry.show(1) == manifest
    folder = registry.pull(1, tmp_path / "cache")  # every file the manifest names is still there
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.name != "manifest.json"} == files


def test_a_create_conflict_with_another_publisher_still_moves_on(file_store: ObjectStore, tmp_path: Path) -> None:
    make_adapter(tmp_path / "w", marker=1)
    make_adapter(tmp_path / "l", marker=2)
    winner = AdapterRegistry(file_store, "run1").publish(tmp_path / "w", "tiny", 0, 1)
    stale = AdapterRegistry(file_store, "run1")
    stale._next_version = lambda: 1  # type: ignore[method-assign]  # always tries v1 first
    loser = stale.publish(tmp_path / "l", "tiny", 0, 2)
    assert (winner.version, loser.version) == (1, 2) and stale.show(1) == winner
    stages = {key.split("/")[4] for key in file_store.list("runs/run1/adapters/v000001", recursive=True)}
    assert stages == {"manifest.json", next(iter(winner.files.values())).path.split("/")[0]}  # loser's stage removed


# ---- artifact kinds: value-network weights share the registry with LoRA adapters ----------------------------


def value_network_files(marker: int) -> dict[str, bytes]:
    """What the value learner publishes: the online network's tensors and the JSON that rebuilds its shape."""
    from safetensors.numpy import save

    config = {"agent": "dqn", "hidden_sizes": [4], "observation_size": 4, "num_actions": 2, "marker": marker}
    return {
        "value_config.json": json.dumps(config, sort_keys=True).encode(),
        "value_network.safetensors": save({"layers.0.weight": np.full((4, 4), marker, dtype=np.float32)}),
    }


def test_value_network_versions_keep_the_registry_guarantees(any_store: ObjectStore, tmp_path: Path) -> None:
    registry = AdapterRegistry(any_store, "run1")
    files = value_network_files(marker=2)
    first = registry.publish_files(files, "dqn:cartpole", parent_version=0, learner_step=5, kind="value-network")
    make_adapter(tmp_path / "a", marker=1)
    second = registry.publish(tmp_path / "a", "tiny", parent_version=1, learner_step=6)
    assert (first.version, first.kind, second.version, second.kind) == (1, "value-network", 2, "lora")
    assert registry.show(1) == first and registry.show(1).kind == "value-network"
    assert registry.adapter_sha256(1) == hashlib.sha256(any_store.get("runs/run1/adapters/v000001/manifest.json")).hexdigest()
    assert registry.published_event(first).manifest_sha256 == registry.adapter_sha256(1)
    folder = registry.pull(1, tmp_path / "cache", kind="value-network")
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.name != "manifest.json"} == files
    with pytest.raises(RegistryError, match="is a value-network, not a lora"):
        registry.pull(1, tmp_path / "cache", kind="lora")
    with pytest.raises(FileExistsError):  # create-once: a version's manifest is never replaced
        any_store.put_create_once("runs/run1/adapters/v000001/manifest.json", registry.manifest_bytes(2))


def test_publish_refuses_a_value_network_without_its_files_or_with_pickles(memory_store: ObjectStore) -> None:
    registry = AdapterRegistry(memory_store, "run1")
    files = value_network_files(marker=1)
    with pytest.raises(RegistryError, match=r"lacks value_network\.safetensors"):
        registry.publish_files({"value_config.json": files["value_config.json"]}, "dqn", 0, 1, kind="value-network")
    with pytest.raises(RegistryError, match=r"refusing pickled file net\.pt"):
        registry.publish_files({**files, "net.pt": b"x"}, "dqn", 0, 1, kind="value-network")
    with pytest.raises(RegistryError, match="unknown artifact kind 'keras'"):
        registry.publish_files(files, "dqn", 0, 1, kind="keras")  # type: ignore[arg-type]
    assert registry.versions() == []



def test_publish_refuses_a_file_named_like_the_pulled_manifest(memory_store: ObjectStore, tmp_path: Path) -> None:
    """A pull writes the version's manifest beside its files as manifest.json: a file of that name would be
    replaced by it, and the pulled folder would never match its manifest."""
    registry = AdapterRegistry(memory_store, "run1")
    files = make_adapter(tmp_path / "a", marker=1)
    with pytest.raises(RegistryError, match=r"manifest\.json.*rename it"):
        registry.publish_files({**files, "manifest.json": b'{"mine": 1}'}, "tiny", 0, 1)
    (tmp_path / "a" / "manifest.json").write_bytes(b'{"mine": 1}')
    with pytest.raises(RegistryError, match=r"manifest\.json.*rename it"):
        registry.publish(tmp_path / "a", "tiny", 0, 1)
    assert registry.versions() == []

def test_a_manifest_without_a_kind_reads_as_a_lora_adapter() -> None:
    old = {
        "schema_version": "1.0", "run_id": "r", "version": 1, "base_model": "tiny", "parent_version": 0,
        "learner_step": 3, "files": {"adapter_model.safetensors": {"path": "a/adapter_model.safetensors",
                                                                   "sha256": "0" * 64, "size": 1}},
    }
    assert manifest_from_bytes(json.dumps(old).encode()).kind == "lora"


def test_a_version_on_local_disk_makes_its_files_durable_before_its_manifest(file_store: ObjectStore,
                                                                             fsyncs: list[str]) -> None:
    """Each file's bytes, their new attempt folder once with the new version folder and the adapters folder
    that name them, then the manifest and its folder: seven fsyncs for two files."""
    files = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"weights"}
    registry = AdapterRegistry(file_store, "run1")
    registry.publish_files(files, "tiny", parent_version=0, learner_step=1)
    fsyncs.clear()
    registry.publish_files(files, "tiny", parent_version=1, learner_step=2)
    assert fsyncs == ["file", "file", "folder", "folder", "folder", "file", "folder"]


class ListingCountStore(ObjectStore):
    """A file store that counts its listings."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.listings = 0

    def list(self, prefix: str = "", recursive: bool = False) -> list[str]:
        self.listings += 1
        return super().list(prefix, recursive)


def test_a_publisher_that_knows_its_next_version_does_not_list_the_registry(tmp_path: Path) -> None:
    """A learner publishing every step names the version it expects: one probe of the version below it instead
    of a listing of every version, whose cost grows with the run."""
    store = ListingCountStore((tmp_path / "store").as_uri())
    registry = AdapterRegistry(store, "run1")
    files = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"w"}
    assert registry.publish_files(files, "tiny", 0, 1).version == 1  # no hint: lists
    store.listings = 0
    for expected in (2, 3, 4):
        published = registry.publish_files(files, "tiny", expected - 1, expected, expected_version=expected)
        assert published.version == expected
    assert store.listings == 0
    assert registry.versions() == [1, 2, 3, 4]


@pytest.mark.parametrize("expected", [7, 2])
def test_a_wrong_expected_version_never_leaves_a_gap_or_takes_a_committed_one(tmp_path: Path, expected: int) -> None:
    """7: the version below is not committed (a gap); 2: another publisher committed it. Both publish as 3."""
    store = ListingCountStore((tmp_path / "store").as_uri())
    registry = AdapterRegistry(store, "run1")
    files = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"w"}
    registry.publish_files(files, "tiny", 0, 1)
    registry.publish_files(files, "tiny", 1, 2)
    assert registry.publish_files(files, "tiny", 1, 3, expected_version=expected).version == 3
    assert registry.versions() == [1, 2, 3]


def test_a_retired_version_keeps_its_number_and_a_pull_of_it_names_why(any_store: ObjectStore, tmp_path: Path) -> None:
    make_adapter(tmp_path / "a", marker=1)
    registry = AdapterRegistry(any_store, "run1")
    for step in (1, 2, 3):
        registry.publish(tmp_path / "a", "tiny", 0, step)
    registry.pull(2, tmp_path / "warm")  # a cached copy elsewhere is no way back to the files
    assert registry.retire(2, "its session ended")
    assert not registry.retire(2, "another reason")  # again: nothing left to do, and the first reason stays
    assert registry.versions() == [1, 2, 3] and registry.next_version() == 4  # the number is never reused
    assert sorted(any_store.list("runs/run1/adapters/v000002")) == [  # the files are gone, the why is noted
        "runs/run1/adapters/v000002/manifest.json", "runs/run1/adapters/v000002/retired.json"]
    with pytest.raises(AdapterNotFoundError, match="run 'run1' version 2 was deleted: its session ended"):
        registry.pull(2, tmp_path / "cache")
    assert not (tmp_path / "cache" / "run1" / "v000002").exists()
    assert registry.pull(3, tmp_path / "cache").is_dir()  # the others are untouched
    with pytest.raises(AdapterNotFoundError, match="has no adapter version 9"):
        registry.retire(9, "never published")


@pytest.mark.parametrize("pickled", ["adapter_model.bin", "adapter_model.pt"])
def test_pull_refuses_a_committed_manifest_that_names_pickled_weights(memory_store: ObjectStore, tmp_path: Path,
                                                                     pickled: str) -> None:
    """A manifest written past ``publish`` (by hand, another tool, a tampered store) naming pickled weights and no
    safetensors: peft and vLLM would torch.load them, so a pull refuses it before downloading anything."""
    config = json.dumps({"r": 8, "peft_type": "LORA"}).encode()
    files = {"adapter_config.json": config, pickled: b"\x80\x04K\x01."}  # a pickle of the int 1
    for name, data in files.items():
        memory_store.put(f"runs/run1/adapters/v000001/x/{name}", data)
    manifest = AdapterManifest(run_id="run1", version=1, base_model="tiny", parent_version=0, learner_step=1, files={
        name: {"path": f"x/{name}", "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        for name, data in files.items()})
    memory_store.put_create("runs/run1/adapters/v000001/manifest.json", manifest_to_bytes(manifest))
    cache = tmp_path / "cache"
    with pytest.raises(RegistryError, match=rf"{pickled}.*safetensors"):
        AdapterRegistry(memory_store, "run1").pull(1, cache)
    assert not (cache / "run1" / "v000001").exists()
