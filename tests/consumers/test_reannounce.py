"""consumers.reannounce without a learner: what a start announces again, what it reads to find it, and the ids."""

from __future__ import annotations

import json

import pytest

from consumers.reannounce import announce_again
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from schemas.events import AdapterPublished, LearnerCheckpointed, Payload, announcement_id

RUN = "reannounce"
FILES = {"adapter_config.json": b"{}", "adapter_model.safetensors": b"weights"}


class ListingCounter(ObjectStore):
    """A file store that counts its listings (what grows with a long run's registry)."""

    listings = 0

    def list(self, prefix: str, recursive: bool = False) -> list[str]:  # type: ignore[override]
        self.listings += 1
        return super().list(prefix, recursive=recursive)


@pytest.fixture
def store(tmp_path) -> ListingCounter:  # type: ignore[no-untyped-def]
    return ListingCounter(tmp_path.as_uri())


def published(registry: AdapterRegistry, count: int) -> None:
    for step in range(1, count + 1):
        registry.publish_files(FILES, "tiny", parent_version=step - 1, learner_step=step)


def checkpointed(version: int) -> LearnerCheckpointed:
    return LearnerCheckpointed(step=version, version=version, path=f"runs/{RUN}/checkpoints/step-{version:06d}-a",
                               offsets={}, metrics={})


def announced_again(registry: AdapterRegistry, resumed: LearnerCheckpointed | None) -> list[Payload]:
    sent: list[Payload] = []
    announce_again(sent.append, RUN, registry, resumed, lambda: False)
    return sent


def test_a_start_probes_the_versions_above_its_checkpoint_without_listing_the_registry(store) -> None:
    registry = AdapterRegistry(store, RUN)
    published(registry, 5)
    store.listings = 0
    sent = announced_again(registry, checkpointed(3))
    assert [type(p).__name__ for p in sent] == ["LearnerCheckpointed", "AdapterPublished", "AdapterPublished"]
    assert [p.version for p in sent if isinstance(p, AdapterPublished)] == [4, 5]
    assert store.listings == 0  # three probes (v4, v5, v6) and the manifests, however many versions the run has


def test_a_retired_version_is_not_announced_again(store) -> None:
    """keep_versions deleted v4's files: a producer that heard of it could not pull it."""
    registry = AdapterRegistry(store, RUN)
    published(registry, 5)
    registry.retire(4, "learner.keep_versions=1")
    sent = announced_again(registry, checkpointed(3))
    assert [p.version for p in sent if isinstance(p, AdapterPublished)] == [5]


def test_a_start_with_no_checkpoint_announces_every_version(store) -> None:
    registry = AdapterRegistry(store, RUN)
    published(registry, 2)
    assert [p.version for p in announced_again(registry, None)] == [1, 2]  # type: ignore[union-attr]


def test_a_manifest_with_a_field_this_rlpipe_does_not_know_keeps_its_id_when_announced_again(store) -> None:
    """Written by another rlpipe minor version: parsed, it re-encodes to other bytes; the announcement's digest is
    the stored bytes', at the first sending and again at a start, and is ``adapter_sha256``."""
    registry = AdapterRegistry(store, RUN)
    published(registry, 1)
    key = f"{registry.version_key(1)}/manifest.json"
    written = json.dumps({**json.loads(store.get(key)), "signed_by": "a newer minor"}).encode()
    store.delete(key)
    store.put_create(key, written)
    at_publish = registry.published_event(registry.show(1))
    [again] = announced_again(registry, None)
    assert at_publish.manifest_sha256 == again.manifest_sha256 == registry.adapter_sha256(1)  # type: ignore[union-attr]
    assert announcement_id(RUN, at_publish) == announcement_id(RUN, again)
