"""Learner checkpoints in the store: tensors in safetensors, the rest in JSON, manifest last.

The contract (``LearnerState``, the folder names, the manifest) is
``schemas.checkpoint``, which the report and the run listing read too; this
module writes and reads the files.  Layout (one folder per attempt, so a crashed
half-written attempt never blocks the next one from writing create-only)::

    runs/<run>/checkpoints/step-000120-<attempt>/adapter.safetensors
                                                /optimizer.safetensors
                                                /state.json
                                                /manifest.json   <- written last, create-only: the commit point

``state.json`` holds the step, the last published version, the consumed
positions (``topic:partition`` -> next offset) and the RNG states: a fixed size
however long the run.  The per-step metrics, with the ``batch_id``s each step
trained, live in the step log (``pipeline.io.steplog``: one immutable object per
step, written before the checkpoint that covers it); loading a checkpoint
rebuilds the trained ``batch_id``s from the step objects up to its step.  The
newest complete checkpoint is the highest step whose manifest exists, whose
files match their digests, and whose step objects are still the ones its
learner wrote (``state.json`` records the step log's hash-chain head:
``StepLog.history``).  Nothing is unpickled: safetensors and JSON only.

Checkpoints written before the step log existed carry ``trained`` and
``step_log`` inline; they load as they are, and the next ``save`` first writes
their inline log out as step objects, so the new checkpoint needs nothing else.

Retention: with ``keep`` set, a ``save`` that made its manifest durable deletes
all but the ``keep`` newest complete checkpoints (never the one just written)
and the leftovers of crashed attempts below it (each manifest first, so a
half-deleted folder is never complete).  Under the learner lease
(``consumers.lease.FencedStore``) only the lease holder deletes: see ``prune``.
"""

from __future__ import annotations

import json
import logging
import random
import time
import uuid
from contextlib import suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as load_tensors

from pipeline.io.steplog import StepLog, StepLogForkedError, linked, trained_batches
from pipeline.io.store import ChecksumError, ObjectStore
from pipeline.io.tensors import save_tensors
from schemas.checkpoint import (
    MANIFEST_FILE,
    STATE_FILE,
    CheckpointFolder,
    CheckpointManifest,
    LearnerState,
    checkpoint_prefix,
    complete_folders,
)
from schemas.versions import NewerSchemaError

log = logging.getLogger("rlpipe.learner")
CHECKPOINT_FILES = ("adapter.safetensors", "optimizer.safetensors", STATE_FILE)


class CheckpointManifestError(ValueError):
    """A checkpoint's manifest that is not one: damaged, or not written by rlpipe.  Raised, not skipped: its
    checkpoint may be the newest, and resuming from an older one would drop the steps trained since."""


@dataclass
class Checkpoint:
    """A loaded checkpoint."""

    key: str
    state: LearnerState
    adapter: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    scalars: dict[str, Any]
    rng: dict[str, Any]
    rng_tensors: dict[str, torch.Tensor]

    def restore_rng(self) -> None:
        """Put the RNGs back where they were when the checkpoint was written."""
        restore_rng(self.rng_tensors, self.rng)


def capture_rng() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """RNG states: torch's as tensors (the GPU's too where one is in use: dropout there draws from it), python's and
    numpy's as JSON."""
    py_version, py_state, py_gauss = random.getstate()
    np_state = np.random.get_state()
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # in use (asking would start CUDA otherwise)
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    return (
        tensors,
        {
            "python": [py_version, list(py_state), py_gauss],
            "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        },
    )


def restore_rng(tensors: dict[str, torch.Tensor], states: dict[str, Any]) -> None:
    """Inverse of ``capture_rng``."""
    if "rng.torch" in tensors:
        torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and torch.cuda.is_available():  # resumed without a GPU: nothing draws from one
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    if "python" in states:
        version, state, gauss = states["python"]
        random.setstate((version, tuple(state), gauss))
    if "numpy" in states:
        kind, keys, pos, has_gauss, cached = states["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


@dataclass(frozen=True)
class PreparedCheckpoint:
    """A checkpoint's content taken at one moment (``CheckpointStore.prepare``), not yet written."""

    step: int
    version: int
    adapter: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]  # with the torch RNG states
    state_json: bytes


def attempt_name() -> str:
    """A checkpoint attempt's folder suffix: the write time in nanoseconds (16 hex digits), then 4 random ones.

    Folders sort by step, then by this name: of two checkpoints of one step (a replay ending between two
    publish steps checkpoints its last step again, with the version it just published), the later one is
    the newest.
    """
    return f"{time.time_ns():016x}{uuid.uuid4().hex[:4]}"


class CheckpointStore:
    """Writes and finds learner checkpoints for one run."""

    def __init__(self, store: ObjectStore, run_id: str, keep: int | None = None) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be at least 1 (the newest checkpoint is never deleted), got {keep}")
        self.store, self.run_id, self.keep = store, run_id, keep
        self.prefix = checkpoint_prefix(run_id)
        self.steps = StepLog(store, run_id)

    def link_step(self, state: LearnerState, entry: dict[str, Any]) -> dict[str, Any]:
        """Step ``state.step``'s entry as the step log stores it: naming the step object before it in this
        learner's history, whose digest becomes ``state.step_log_head`` (memory only; before the step's
        checkpoint is prepared, so that the checkpoint records it)."""
        entry, state.step_log_head = linked(entry, state.step_log_head)
        return entry

    def record_step(self, entry: dict[str, Any]) -> None:
        """Append one step's linked entry (``link_step``: its metrics, with the ``batch_ids`` it trained) to the
        step log, before any checkpoint."""
        self.steps.write(entry)

    def save(
        self,
        state: LearnerState,
        adapter: dict[str, torch.Tensor],
        optimizer: dict[str, torch.Tensor],
        scalars: dict[str, Any],
    ) -> str:
        """Write files, then the manifest (create-only), then prune; return the checkpoint's folder key."""
        return self.write(self.prepare(state, adapter, optimizer, scalars))

    def prepare(
        self,
        state: LearnerState,
        adapter: dict[str, torch.Tensor],
        optimizer: dict[str, torch.Tensor],
        scalars: dict[str, Any],
    ) -> PreparedCheckpoint:
        """A snapshot training may move on from: copies of the tensors, the state and the RNG states of now.

        Cheap (memory copies); ``write`` serialises and uploads, in whichever thread calls it.
        """
        self._write_legacy_step_log(state)
        rng_tensors, rng_states = capture_rng()
        state_json = json.dumps({"state": state.to_json(), "scalars": scalars, "rng": rng_states}, sort_keys=True)
        return PreparedCheckpoint(
            state.step, state.version, {name: t.detach().clone() for name, t in adapter.items()},
            {**{name: t.detach().clone() for name, t in optimizer.items()}, **rng_tensors}, state_json.encode(),
        )

    def write(self, prepared: PreparedCheckpoint) -> str:
        """Serialise and write a prepared checkpoint's files, then its manifest (create-only), then prune."""
        key = CheckpointFolder(self.prefix, prepared.step, attempt_name()).key
        files = {"adapter.safetensors": save_tensors(prepared.adapter),
                 "optimizer.safetensors": save_tensors(prepared.optimizer), STATE_FILE: prepared.state_json}
        # create-once: a retried create of our own object (gs://) is not a conflict; on local disk the
        # folder is made durable once for the three files, before the manifest that names them
        stored = self.store.put_create_many({f"{key}/{name}": data for name, data in files.items()})
        digests = {name: stored[f"{key}/{name}"] for name in files}
        manifest = CheckpointManifest(
            step=prepared.step, version=prepared.version, files=digests, created_at=datetime.now(UTC).isoformat()
        )
        self.store.put_create_once(f"{key}/{MANIFEST_FILE}", json.dumps(manifest.to_json(), sort_keys=True).encode())
        if self.keep is not None:
            self.prune(key)
        return key

    def _write_legacy_step_log(self, state: LearnerState) -> None:
        """Move an old-layout checkpoint's inline log (and its trained ids) into step objects."""
        if not state.legacy_step_log:
            return
        by_step: dict[int, list[str]] = {}
        for batch_id, step in state.trained.items():
            by_step.setdefault(step, []).append(batch_id)
        for entry in state.legacy_step_log:
            listed = list(entry.get("batch_ids", []))
            extra = sorted(set(by_step.get(int(entry["step"]), [])) - set(listed))  # e.g. batches of zero rows
            self.steps.write({**entry, "batch_ids": listed + extra})
        log.info("wrote %d steps of an old-layout checkpoint as step objects", len(state.legacy_step_log))
        state.legacy_step_log = []

    def prune(self, newest: str) -> None:
        """Delete all but the ``keep`` newest complete checkpoints (never ``newest``) and dead attempts of steps below
        it.

        Through a ``FencedStore`` each delete first checks that this learner still holds the lease, after the
        listing: a learner fenced out before its ``newest`` landed raises ``LeaseLostError`` and deletes nothing.
        Its ``newest`` is then skipped by later resumes once the newer learner rewrote its steps, and the older
        checkpoint it would have pruned is the one they fall back to.  A check that passes means no newer learner
        had started when ``newest`` was already durable, so any learner that starts later resumes from
        ``newest`` or something newer, never from a checkpoint deleted here.
        """
        keys = self.store.list(self.prefix, recursive=True)  # one listing for both questions below
        folders: dict[str, bool] = {}  # folder -> has a manifest
        for path in keys:
            folder, _, name = path.rpartition("/")
            folders[folder] = folders.get(folder, False) or name == MANIFEST_FILE
        kept = {key for _, key in self._complete(keys)[: self.keep]} | {newest}
        newest_folder = CheckpointFolder.parse(newest)
        newest_step = newest_folder.step if newest_folder else 0
        for folder, complete in folders.items():
            parsed = CheckpointFolder.parse(folder)
            if folder in kept or parsed is None or (not complete and parsed.step >= newest_step):
                continue  # an incomplete folder of the newest step or above may still be being written (by a
                # learner that took the run over while this one was fenced out)
            with suppress(OSError):
                if complete:
                    self.store.delete(f"{folder}/{MANIFEST_FILE}", missing_ok=True)  # uncommit first
                self.store.delete(folder, recursive=True, missing_ok=True)
                log.info("deleted checkpoint folder %s", folder)

    def complete(self) -> list[tuple[int, str]]:
        """(step, folder key) of every checkpoint with a manifest, newest first."""
        return self._complete(self.store.list(self.prefix, recursive=True))

    @staticmethod
    def _complete(keys: list[str]) -> list[tuple[int, str]]:
        """``complete`` of a listing of the checkpoints' keys."""
        def unexpected(folder: str) -> None:
            log.warning("ignoring unexpected checkpoint folder %s", folder)

        return [(folder.step, folder.key) for folder in complete_folders(keys, on_unexpected=unexpected)]

    def load(self, key: str) -> Checkpoint:
        """Load and verify one checkpoint (digests must match)."""
        manifest = self._manifest(key)
        blobs = {name: self.store.get(f"{key}/{name}", sha256=digest) for name, digest in manifest.files.items()}
        meta = json.loads(blobs[STATE_FILE])
        optimizer = load_tensors(blobs["optimizer.safetensors"])
        rng_tensors = {k: optimizer.pop(k) for k in [k for k in optimizer if k.startswith("rng.")]}
        state = LearnerState.from_json(meta["state"])
        if not state.legacy_layout:  # the current layout: trained ids come from the step log
            state.trained = trained_batches(self.steps.history(state.step, state.step_log_head))
        return Checkpoint(
            key=key, state=state, adapter=load_tensors(blobs["adapter.safetensors"]),
            optimizer=optimizer, scalars=meta["scalars"], rng=meta["rng"], rng_tensors=rng_tensors,
        )

    def _manifest(self, key: str) -> CheckpointManifest:
        """The manifest of the checkpoint at ``key``; ``CheckpointManifestError`` (one line naming it and the fix)
        unless it names every file a checkpoint has, ``NewerSchemaError`` for one of a newer rlpipe."""
        where = self.store.url(f"{key}/{MANIFEST_FILE}")
        fix = f"restore it, or delete the folder {key} to resume from the checkpoint before it"
        try:
            manifest = CheckpointManifest.from_json(json.loads(self.store.get(f"{key}/{MANIFEST_FILE}")))
        except NewerSchemaError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            reason = f"lacks {exc}" if isinstance(exc, KeyError) else str(exc).splitlines()[0]
            raise CheckpointManifestError(f"checkpoint manifest {where} is unreadable ({reason}); {fix}") from None
        missing = [name for name in CHECKPOINT_FILES if name not in manifest.files]
        if missing:
            raise CheckpointManifestError(f"checkpoint manifest {where} names no {missing[0]}; {fix}")
        return manifest

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint that loads and verifies.

        Only damage skips a checkpoint: a file whose bytes do not match the
        manifest's digest (``ChecksumError``) or a file the manifest names that is
        gone (``FileNotFoundError``); then the next older one is tried, with a
        warning.  So does a checkpoint whose step objects a newer learner rewrote
        (``StepLogForkedError``): one a learner fenced out a moment late committed
        after the newer one had resumed from an older checkpoint.  Its weights
        trained other batches than the step log now records, so resuming from it
        would skip batches never trained and train others twice.  Every other
        error (a timeout, a refused connection, a permission error) is raised: the
        process exits and is restarted to try again, instead of resuming from an
        older checkpoint (or from scratch) and dropping the steps trained since.
        """
        for _, key in self.complete():
            try:
                return self.load(key)
            except (ChecksumError, FileNotFoundError) as exc:
                log.warning("skipping damaged checkpoint %s: %s", key, exc)
            except StepLogForkedError as exc:
                log.warning("skipping checkpoint %s, committed by a learner fenced out late: %s", key, exc)
        return None

