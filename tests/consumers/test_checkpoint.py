"""CheckpointStore: which checkpoint a resume loads, and what a storage error means."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as save_tensors

from consumers.checkpoint import CheckpointManifestError, CheckpointStore
from pipeline.io.steplog import StepLog, StepLogError, StepLogForkedError, StepLogGapError
from pipeline.io.store import ObjectStore
from schemas.checkpoint import LearnerState, checkpoint_prefix
from schemas.names import InvalidNameError
from schemas.versions import NewerSchemaError

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
    for logged in range(1, step + 1):
        checkpoints.record_step({"step": logged, "batch_ids": [f"b{logged}"]})
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


@pytest.mark.parametrize("manifest", [
    json.dumps({"step": 2}).encode(),  # no "files"
    b'{"step": 2, "files": {"state.js',  # not JSON
    json.dumps({"step": 2, "version": 2, "files": {"state.json": "0" * 64}}).encode(),  # names no tensors
    b"[2]",  # not an object
], ids=["no-files", "not-json", "no-tensors", "not-an-object"])
def test_an_unreadable_manifest_is_raised_in_one_line_naming_it(store: FlakyStore, manifest: bytes) -> None:
    """Not skipped: an older checkpoint would drop the steps trained since; the error names the file."""
    checkpoints = CheckpointStore(store, RUN)
    save_step(checkpoints, 1)
    newest = save_step(checkpoints, 2)
    store.put(f"{newest}/manifest.json", manifest)
    with pytest.raises(CheckpointManifestError, match=rf"{newest}/manifest.json .*delete the folder") as caught:
        checkpoints.latest()
    assert "\n" not in str(caught.value)


def test_a_manifest_of_a_newer_schema_is_refused_not_misread(store: FlakyStore) -> None:
    checkpoints = CheckpointStore(store, RUN)
    newest = save_step(checkpoints, 1)
    manifest = json.loads(store.get(f"{newest}/manifest.json"))
    store.put(f"{newest}/manifest.json", json.dumps({**manifest, "schema_version": "2.0"}).encode())
    with pytest.raises(NewerSchemaError, match=r"checkpoint manifest has schema version 2\.0.*upgrade rlpipe"):
        checkpoints.latest()


class RetriedCreateStore(ObjectStore):
    """Every create lands and then reports ``FileExistsError`` (a retried GCS upload that lost its answer)."""

    ghosts = 0

    def _local_write(self, path: str, data: bytes, replace: bool, sync_folder: bool = True) -> list[Path]:
        changed = super()._local_write(path, data, replace, sync_folder)  # every create on local disk ends here
        if not replace:
            self.ghosts += 1
            raise FileExistsError(f"{path} already exists")
        return changed


def test_a_create_conflict_on_our_own_checkpoint_files_is_not_a_failure(tmp_path) -> None:
    store = RetriedCreateStore(tmp_path.as_uri())
    checkpoints = CheckpointStore(store, RUN)
    key = save_step(checkpoints, 4)
    assert store.ghosts == 4 + 4  # four step objects, then the checkpoint's three files and its manifest
    latest = checkpoints.latest()
    assert latest is not None and latest.key == key and latest.state.step == 4


# ---- size and retention ------------------------------------------------------------------------------------------

ADAPTER = {f"layer{i}.lora_{ab}": torch.zeros(8, 64) for i in range(4) for ab in "AB"}


def run_steps(checkpoints: CheckpointStore, state: LearnerState, until: int, batches_per_step: int = 2) -> None:
    """What ``Learner.step`` does to the state and the step log, without training."""
    while state.step < until:
        state.step += 1
        ids = [f"producer-{state.step % 3}-b{state.step:06d}-{k}" for k in range(batches_per_step)]
        state.trained.update({batch_id: state.step for batch_id in ids})
        state.positions["rlpipe.trajectories:0"] = state.step * batches_per_step
        checkpoints.record_step(checkpoints.link_step(state, {"step": state.step, "batch_ids": ids, "rows": 16,
                                                              "loss": 0.5, "staleness_histogram": {"0": 16},
                                                              "version": state.version}))


def checkpoint_bytes(store: ObjectStore, key: str) -> int:
    return sum(len(store.get(k)) for k in store.list(key, recursive=True))


def test_checkpoint_bytes_do_not_grow_with_the_steps(store: FlakyStore) -> None:
    checkpoints, state = CheckpointStore(store, RUN), LearnerState()
    run_steps(checkpoints, state, 10)
    early = checkpoint_bytes(store, checkpoints.save(state, ADAPTER, {}, {}))
    run_steps(checkpoints, state, 300)
    late = checkpoint_bytes(store, checkpoints.save(state, ADAPTER, {}, {}))
    assert late - early < 200, (early, late)  # a few digits more in the step and the offsets, nothing per step
    loaded = checkpoints.latest()
    assert loaded is not None and loaded.state.trained == state.trained and len(state.trained) == 600


def test_of_two_checkpoints_of_one_step_the_later_one_is_the_latest(tmp_path) -> None:
    """A replay ending between two publish steps checkpoints its last step again after publishing it: the second
    checkpoint, with the newer version, is the one to resume from (every time, not by the folders' random names)."""
    store = ObjectStore(tmp_path.as_uri())
    for attempt in range(12):
        checkpoints = CheckpointStore(store, f"{RUN}{attempt}")
        checkpoints.record_step({"step": 1, "batch_ids": ["b1"]})
        checkpoints.save(LearnerState(step=1, version=0), ADAPTER, {}, {})
        second = checkpoints.save(LearnerState(step=1, version=1), ADAPTER, {}, {})
        assert checkpoints.complete()[0] == (1, second)
        assert checkpoints.latest().state.version == 1


def test_a_checkpoint_written_now_is_later_than_one_of_the_same_step_with_an_older_random_name(tmp_path) -> None:
    """Attempt names were 8 random hex digits before they began with the write time: at one step, a folder
    named the old way was written before any named the new way, whatever its digits."""
    store = ObjectStore(tmp_path.as_uri())
    checkpoints = CheckpointStore(store, RUN)
    checkpoints.record_step({"step": 1, "batch_ids": ["b1"]})
    old = checkpoints.save(LearnerState(step=1, version=0), ADAPTER, {}, {})
    renamed = f"{checkpoints.prefix}/step-000001-ffffffff"  # the largest old-style name
    for key in store.list(old, recursive=True):
        store.put(key.replace(old, renamed), store.get(key))
    store.delete(old, recursive=True)
    new = checkpoints.save(LearnerState(step=1, version=1), ADAPTER, {}, {})
    assert [key for _, key in checkpoints.complete()] == [new, renamed]
    assert checkpoints.latest().state.version == 1


def test_only_the_newest_checkpoints_are_kept(store: FlakyStore) -> None:
    checkpoints, state = CheckpointStore(store, RUN, keep=2), LearnerState()
    store.put_create(f"{checkpoints.prefix}/step-000002-deadbeef/adapter.safetensors", b"a crashed attempt")
    store.put_create(f"{checkpoints.prefix}/step-000009-feedface/adapter.safetensors", b"above the newest")
    for step in range(1, 6):
        run_steps(checkpoints, state, step)
        newest = checkpoints.save(state, ADAPTER, {}, {})
    assert [step for step, _ in checkpoints.complete()] == [5, 4]
    assert checkpoints.complete()[0][1] == newest
    folders = [key.rsplit("/", 1)[-1] for key in store.list(checkpoints.prefix)]
    assert len(folders) == 3 and "step-000009-feedface" in folders  # the crashed attempt below is gone
    assert checkpoints.steps.steps() == [1, 2, 3, 4, 5]  # the step log is history: never pruned
    assert checkpoints.latest().state.trained == state.trained


def test_a_prune_leaves_an_unfinished_attempt_of_its_own_step_alone(store: FlakyStore) -> None:
    """Two learners of one run may write the same step at once (one fenced out by the lease a moment later, and
    the one that took over); the first to finish must not delete the other's folder half-written.  An unfinished
    attempt below the newest step is a dead one, and goes."""
    checkpoints, state = CheckpointStore(store, RUN, keep=2), LearnerState()
    run_steps(checkpoints, state, 3)
    store.put_create(f"{checkpoints.prefix}/step-000003-0another/adapter.safetensors", b"being written")
    store.put_create(f"{checkpoints.prefix}/step-000002-deadbeef/adapter.safetensors", b"a crashed attempt")
    checkpoints.save(state, ADAPTER, {}, {})
    folders = [key.rsplit("/", 1)[-1] for key in store.list(checkpoints.prefix)]
    assert "step-000003-0another" in folders and "step-000002-deadbeef" not in folders


def test_keep_one_never_deletes_the_checkpoint_just_written(store: FlakyStore) -> None:
    checkpoints, state = CheckpointStore(store, RUN, keep=1), LearnerState()
    run_steps(checkpoints, state, 3)
    checkpoints.save(state, ADAPTER, {}, {})
    run_steps(checkpoints, state, 4)
    newest = checkpoints.save(state, ADAPTER, {}, {})
    assert checkpoints.complete() == [(4, newest)]


def test_a_provisional_step_above_the_checkpoint_is_not_trained_and_is_replaced(store: FlakyStore) -> None:
    checkpoints, state = CheckpointStore(store, RUN), LearnerState()
    run_steps(checkpoints, state, 3)
    checkpoints.save(state, ADAPTER, {}, {})
    run_steps(checkpoints, state, 4)  # step 4 logged, then the learner died before checkpointing it
    resumed = checkpoints.latest().state
    assert resumed.step == 3 and not any(step == 4 for step in resumed.trained.values())
    checkpoints.record_step({"step": 4, "batch_ids": ["retrained"], "rows": 16})  # the retrained step 4
    assert checkpoints.steps.read(upto=4)[-1]["batch_ids"] == ["retrained"]


def test_missing_step_objects_are_an_error_not_a_fresh_start(store: FlakyStore) -> None:
    checkpoints, state = CheckpointStore(store, RUN), LearnerState()
    run_steps(checkpoints, state, 3)
    checkpoints.save(state, ADAPTER, {}, {})
    store.delete(checkpoints.steps.key(2))
    with pytest.raises(StepLogGapError, match="step 2"):
        checkpoints.latest()



@pytest.mark.parametrize("entry", [b'{"step": 2, "batch_ids": ["b', b'["b2"]', b'{"step": 5, "batch_ids": ["b2"]}'],
                         ids=["not-json", "not-an-object", "another-step"])
def test_a_damaged_step_object_is_an_error_naming_it(store: FlakyStore, entry: bytes) -> None:
    """The learner's dedup of batch ids reads these: one line naming the object, not a bare JSON error."""
    checkpoints, state = CheckpointStore(store, RUN), LearnerState()
    run_steps(checkpoints, state, 3)
    checkpoints.save(state, ADAPTER, {}, {})
    store.put(checkpoints.steps.key(2), entry)
    with pytest.raises(StepLogError, match=r"step-000002\.json .*restore it from a backup") as caught:
        checkpoints.latest()
    assert "\n" not in str(caught.value)

def test_a_checkpoint_whose_steps_a_newer_learner_rewrote_is_skipped_for_the_one_before_it(store: FlakyStore) -> None:
    """A learner fenced out a moment late commits its step-4 checkpoint after a newer learner resumed from step 2;
    the newer one rewrites step 3 (other batches: it reads the partitions in another order) and dies.  Step 4's
    object is still the old learner's, but the chain through step 3 is broken: the resume takes step 2."""
    checkpoints, old = CheckpointStore(store, RUN), LearnerState()
    run_steps(checkpoints, old, 2)
    kept = checkpoints.save(old, ADAPTER, {}, {})
    newer = checkpoints.latest().state  # the newer learner resumes before the old one's next manifest lands
    run_steps(checkpoints, old, 4)
    late = checkpoints.save(old, ADAPTER, {}, {})
    assert checkpoints.latest().key == late  # nothing rewritten yet: the late checkpoint is the run's history
    run_steps(checkpoints, newer, 3, batches_per_step=1)  # rewrites step 3, then dies
    assert checkpoints.complete()[0] == (4, late)
    with pytest.raises(StepLogForkedError, match=r"step-000003\.json is not the one the checkpoint at step 4") as forked:
        checkpoints.load(late)
    assert "\n" not in str(forked.value)
    resumed = checkpoints.latest()
    assert resumed.key == kept and resumed.state.step == 2
    assert sorted(resumed.state.trained.values()) == [1, 1, 2, 2]
    run_steps(checkpoints, resumed.state, 4, batches_per_step=1)  # the resumed learner's own steps 3 and 4
    newest = checkpoints.save(resumed.state, ADAPTER, {}, {})
    assert checkpoints.latest().key == newest


def write_old_layout_checkpoint(store: ObjectStore, step: int) -> dict[str, int]:
    """A checkpoint as written before the step log: ``trained`` and ``step_log`` inside state.json."""
    trained = {f"b{s}": s for s in range(1, step + 1)} | {"empty-batch": 2}
    log = [{"step": s, "batch_ids": [f"b{s}"], "rows": 16} for s in range(1, step + 1)]
    state = {"step": step, "version": step, "positions": {"t:0": step}, "trained": trained, "step_log": log,
             "dropped_stale_rows": 0}
    key = f"runs/{RUN}/checkpoints/step-{step:06d}-0ld1ay0u"
    files = {"adapter.safetensors": save_tensors(ADAPTER), "optimizer.safetensors": save_tensors({}),
             "state.json": json.dumps({"state": state, "scalars": {}, "rng": {}}).encode()}
    digests = {name: store.put_create(f"{key}/{name}", data) for name, data in files.items()}
    store.put_create(f"{key}/manifest.json", json.dumps({"step": step, "version": step, "files": digests}).encode())
    return trained


def test_an_old_layout_checkpoint_loads_and_its_log_moves_to_step_objects(store: FlakyStore) -> None:
    trained = write_old_layout_checkpoint(store, 3)
    checkpoints = CheckpointStore(store, RUN, keep=1)
    state = checkpoints.latest().state
    assert state.step == 3 and state.trained == trained
    run_steps(checkpoints, state, 4)
    checkpoints.save(state, ADAPTER, {}, {})  # the old checkpoint is pruned: the step objects replace it
    assert [step for step, _ in checkpoints.complete()] == [4]
    assert [e["step"] for e in checkpoints.steps.read(upto=4)] == [1, 2, 3, 4]
    assert checkpoints.latest().state.trained == state.trained and "empty-batch" in state.trained


def test_a_checkpoint_on_local_disk_costs_seven_fsyncs(store: FlakyStore, fsyncs: list[str]) -> None:
    """Its three files' bytes, their new folder once and the checkpoints folder that now names it, then the
    manifest and its folder again: the manifest is linked only after the files it names are durable."""
    checkpoints = CheckpointStore(store, RUN)
    save_step(checkpoints, 1)
    checkpoints.record_step({"step": 2, "batch_ids": ["b2"]})
    fsyncs.clear()
    checkpoints.save(LearnerState(step=2, version=2, positions={"t:0": 2}), {"lora_A": torch.ones(2, 2)},
                     {"exp_avg": torch.zeros(2)}, {})
    assert fsyncs == ["file"] * 3 + ["folder"] * 2 + ["file", "folder"]


def test_pruning_after_a_save_lists_the_checkpoints_once(store: FlakyStore, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoints = CheckpointStore(store, RUN, keep=2)
    for step in (1, 2):
        save_step(checkpoints, step)
    listed: list[str] = []
    real_list = store.list

    def counted_list(prefix: str = "", recursive: bool = False) -> list[str]:
        listed.append(prefix)
        return real_list(prefix, recursive)

    monkeypatch.setattr(store, "list", counted_list)
    save_step(checkpoints, 3)
    assert listed == [checkpoints.prefix]
    assert [step for step, _ in checkpoints.complete()] == [3, 2]


def test_the_rng_states_include_the_gpus_where_one_is_in_use(monkeypatch) -> None:
    """Dropout on a GPU draws from the GPU's generator: a resumed step must draw the same masks."""
    from consumers import checkpoint

    set_to: list[torch.Tensor] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *args, **kwargs: torch.tensor([7, 7, 7], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, *args, **kwargs: set_to.append(state))
    tensors, states = checkpoint.capture_rng()
    assert torch.equal(tensors["rng.cuda"], torch.tensor([7, 7, 7], dtype=torch.uint8))
    checkpoint.restore_rng(tensors, states)
    assert len(set_to) == 1 and torch.equal(set_to[0], tensors["rng.cuda"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # resumed on a machine without one: CPU only
    checkpoint.restore_rng(tensors, states)
    assert len(set_to) == 1 and "rng.cuda" not in checkpoint.capture_rng()[0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # a GPU the learner never used: left alone
    assert "rng.cuda" not in checkpoint.capture_rng()[0]


@pytest.mark.parametrize("run_id", ["a/b", "a/checkpoints", ".hidden", ""])
def test_a_run_id_that_is_not_a_name_is_refused_before_it_becomes_a_path(store: FlakyStore, run_id: str) -> None:
    """``a/b`` would put run a/b's checkpoints and step objects inside run a's folder."""
    with pytest.raises(InvalidNameError, match="run_id"):
        CheckpointStore(store, run_id)
    with pytest.raises(InvalidNameError, match="run_id"):
        StepLog(store, run_id)
    with pytest.raises(InvalidNameError, match="run_id"):
        checkpoint_prefix(run_id)
