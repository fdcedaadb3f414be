"""CheckpointStore: which checkpoint a resume loads, and what a storage error means."""

from __future__ import annotations

import json

import pytest
import torch

from consumers.checkpoint import CheckpointStore, LearnerState
from pipeline.store import ObjectStore

RUN = "ckpt"


class FlakyStore(ObjectStore):
    """A file store whose ``get`` raises ``error`` for keys containing ``fail_on`` (a transient outage)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.fail_on: str | None = None
        self.error: Exception = OSError("connection reset by peer")

    def get(self, key: str, sha256: str | None = None) -> bytes:
        if self.fail_on is not None and self.fail_on in key:
            raise self.error
        return super().get(key, sha256)


@pytest.fixture
def store(tmp_path) -> FlakyStore:
    return FlakyStore(tmp_path.as_uri())


def save_step(checkpoints: CheckpointStore, step: int) -> str:
    state = LearnerState(step=step, version=step, positions={"t:0": step})
    return checkpoints.save(state, {"lora_A": torch.full((2, 2), float(step))}, {"exp_avg": torch.zeros(2)}, {})


@pytest.mark.parametrize("error", [OSError("connection reset by peer"), TimeoutError("read timed out"),
                                   PermissionError("403 Forbidden")])
def test_a_transient_error_on_the_newest_checkpoint_is_raised_not_skipped(store: FlakyStore, error) -> None:
    checkpoints = CheckpointStore(store, RUN)
    save_step(checkpoints, 1)
    newest = save_step(checkpoints, 2)
    store.fail_on, store.error = newest, error
    with pytest.raises(type(error)):
        checkpoints.latest()  # an older checkpoint (or a fresh start) would drop trained steps


def test_a_corrupt_or_missing_file_falls_back_to_the_previous_checkpoint(store: FlakyStore) -> None:
    checkpoints = CheckpointStore(store, RUN)
    save_step(checkpoints, 1)
    second = save_step(checkpoints, 2)
    third = save_step(checkpoints, 3)
    store.put(f"{third}/adapter.safetensors", b"not the bytes the manifest names")  # checksum mismatch
    store.delete(f"{second}/optimizer.safetensors")  # a missing file
    latest = checkpoints.latest()
    assert latest is not None and latest.state.step == 1
    assert torch.equal(latest.adapter["lora_A"], torch.full((2, 2), 1.0))


def test_an_unreadable_manifest_is_raised(store: FlakyStore) -> None:
    checkpoints = CheckpointStore(store, RUN)
    save_step(checkpoints, 1)
    newest = save_step(checkpoints, 2)
    store.put(f"{newest}/manifest.json", json.dumps({"step": 2}).encode())  # no "files": not a storage fault
    with pytest.raises(KeyError):
        checkpoints.latest()


class RetriedCreateStore(ObjectStore):
    """Every create lands and then reports ``FileExistsError`` (a retried GCS upload that lost its answer)."""

    def put_create(self, key: str, data: bytes) -> str:
        super().put_create(key, data)
        raise FileExistsError(f"{self.url(key)} already exists")


def test_a_create_conflict_on_our_own_checkpoint_files_is_not_a_failure(tmp_path) -> None:
    checkpoints = CheckpointStore(RetriedCreateStore(tmp_path.as_uri()), RUN)
    key = save_step(checkpoints, 4)
    latest = checkpoints.latest()
    assert latest is not None and latest.key == key and latest.state.step == 4
