"""The checkpoint contract: folder names, the listing of complete checkpoints, the manifest and the state."""

from __future__ import annotations

import pytest

from schemas.checkpoint import (
    CHECKPOINT_SCHEMA_VERSION,
    CheckpointFolder,
    CheckpointManifest,
    LearnerState,
    checkpoint_prefix,
    complete_folders,
)

PREFIX = checkpoint_prefix("run-1")


def test_a_folder_name_round_trips():
    folder = CheckpointFolder(PREFIX, 120, "a1b2c3d4")
    assert folder.key == "runs/run-1/checkpoints/step-000120-a1b2c3d4"
    assert CheckpointFolder.parse(folder.key) == folder


@pytest.mark.parametrize("name", ["step-000120", "step-12x-abc", "step-1-a-b", "stp-1-abc", "step--abc",
                                  "step-1-", "step-1-a.b", "step-\u0661-abc", "manifest.json"])  # fmt: skip
def test_a_name_of_another_shape_is_not_a_checkpoint(name: str):
    assert CheckpointFolder.parse(f"{PREFIX}/{name}") is None


def test_complete_folders_are_those_with_a_manifest_newest_step_first():
    keys = [
        f"{PREFIX}/step-000003-aaaa/manifest.json", f"{PREFIX}/step-000003-aaaa/state.json",
        f"{PREFIX}/step-000012-bbbb/state.json",  # no manifest: still being written, or crashed
        f"{PREFIX}/step-000010-cccc/manifest.json", f"{PREFIX}/odd/manifest.json",
    ]  # fmt: skip
    unexpected: list[str] = []
    found = complete_folders(keys, on_unexpected=unexpected.append)
    assert [(f.step, f.attempt) for f in found] == [(10, "cccc"), (3, "aaaa")]
    assert unexpected == [f"{PREFIX}/odd"]


def test_the_manifest_round_trips_and_names_its_schema_version():
    manifest = CheckpointManifest(step=6, version=2, files={"state.json": "0" * 64}, created_at="2023-11-14T22:13:20")
    data = manifest.to_json()
    assert data["schema_version"] == CHECKPOINT_SCHEMA_VERSION
    assert CheckpointManifest.from_json(data) == manifest


def test_a_manifest_without_files_is_refused():
    with pytest.raises(KeyError):
        CheckpointManifest.from_json({"step": 1, "version": 0})


def test_the_state_of_the_old_layout_keeps_its_inline_step_log():
    old = LearnerState.from_json({"step": 2, "version": 1, "positions": {}, "trained": {"b": 1}, "step_log": []})
    new = LearnerState.from_json(LearnerState(step=2, version=1).to_json())
    assert old.legacy_layout and old.trained == {"b": 1}
    assert not new.legacy_layout and "legacy_layout" not in new.to_json()
