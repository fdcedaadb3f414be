"""Learner checkpoints in the store: tensors in safetensors, the rest in JSON, manifest last.

Layout (one folder per attempt, so a crashed half-written attempt never blocks
the next one from writing create-only)::

    runs/<run>/checkpoints/step-000120-<attempt>/adapter.safetensors
                                                /optimizer.safetensors
                                                /state.json
                                                /manifest.json   <- written last, create-only: the commit point

``state.json`` holds the step, the last published version, the consumed
positions (``topic:partition`` -> next offset) and the RNG states: a fixed size
however long the run.  The per-step metrics, with the ``batch_id``s each step
trained, live in the step log (``pipeline.steplog``: one immutable object per
step, written before the checkpoint that covers it); loading a checkpoint
rebuilds the trained ``batch_id``s from the step objects up to its step.  The
newest complete checkpoint is the highest step whose manifest exists and whose
files match their digests.  Nothing is unpickled: safetensors and JSON only.

Checkpoints written before the step log existed carry ``trained`` and
``step_log`` inline; they load as they are, and the next ``save`` first writes
their inline log out as step objects, so the new checkpoint needs nothing else.

Retention: with ``keep`` set, a ``save`` that made its manifest durable deletes
all but the ``keep`` newest complete checkpoints (never the one just written)
and the leftovers of crashed attempts below it (each manifest first, so a
half-deleted folder is never complete).
"""

from __future__ import annotations

import json
import logging
import random
import uuid
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from pipeline.steplog import StepLog, trained_batches
from pipeline.store import ChecksumError, ObjectStore

log = logging.getLogger("rlpipe.learner")


@dataclass
class LearnerState:
    """Everything the learner needs to continue exactly where a checkpoint left it."""

    step: int = 0
    version: int = 0  # last adapter version this learner published (0 = base model)
    positions: dict[str, int] = field(default_factory=dict)  # "topic:partition" -> next offset
    # batch_id -> step that trained it; not stored in state.json: rebuilt from the step log on load
    trained: dict[str, int] = field(default_factory=dict)
    dropped_stale_rows: int = 0
    # the inline per-step metrics of a checkpoint in the old layout, written out as step objects by the next save
    legacy_step_log: list[dict[str, Any]] = field(default_factory=list, repr=False)
    log_identity: dict[str, str] = field(default_factory=dict)  # topic -> id of the log ``positions`` point into

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step, "version": self.version, "positions": self.positions,
            "dropped_stale_rows": self.dropped_stale_rows, "log_identity": self.log_identity,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LearnerState:
        return cls(
            step=int(data["step"]), version=int(data["version"]), positions=dict(data["positions"]),
            trained=dict(data.get("trained", {})), dropped_stale_rows=int(data.get("dropped_stale_rows", 0)),
            legacy_step_log=list(data.get("step_log", [])), log_identity=dict(data.get("log_identity", {})),
        )


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
    """RNG states: torch's as a tensor, python's and numpy's as JSON."""
    py_version, py_state, py_gauss = random.getstate()
    np_state = np.random.get_state()
    return (
        {"rng.torch": torch.get_rng_state()},
        {
            "python": [py_version, list(py_state), py_gauss],
            "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        },
    )


def restore_rng(tensors: dict[str, torch.Tensor], states: dict[str, Any]) -> None:
    """Inverse of ``capture_rng``."""
    if "rng.torch" in tensors:
        torch.set_rng_state(tensors["rng.torch"])
    if "python" in states:
        version, state, gauss = states["python"]
        random.setstate((version, tuple(state), gauss))
    if "numpy" in states:
        kind, keys, pos, has_gauss, cached = states["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


class CheckpointStore:
    """Writes and finds learner checkpoints for one run."""

    def __init__(self, store: ObjectStore, run_id: str, keep: int | None = None) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be at least 1 (the newest checkpoint is never deleted), got {keep}")
        self.store, self.run_id, self.keep = store, run_id, keep
        self.prefix = f"runs/{run_id}/checkpoints"
        self.steps = StepLog(store, run_id)

    def record_step(self, entry: dict[str, Any]) -> None:
        """Append one step's metrics (with the ``batch_ids`` it trained) to the step log, before any checkpoint."""
        self.steps.write(entry)

    def save(
        self,
        state: LearnerState,
        adapter: dict[str, torch.Tensor],
        optimizer: dict[str, torch.Tensor],
        scalars: dict[str, Any],
    ) -> str:
        """Write files, then the manifest (create-only), then prune; return the checkpoint's folder key."""
        self._write_legacy_step_log(state)
        rng_tensors, rng_states = capture_rng()
        key = f"{self.prefix}/step-{state.step:06d}-{uuid.uuid4().hex[:8]}"
        files = {
            "adapter.safetensors": save_tensors(adapter),
            "optimizer.safetensors": save_tensors({**optimizer, **rng_tensors}),
            "state.json": json.dumps(
                {"state": state.to_json(), "scalars": scalars, "rng": rng_states}, sort_keys=True
            ).encode(),
        }
        # put_create_once: a retried create of our own object (gs://) is not a conflict
        digests = {name: self.store.put_create_once(f"{key}/{name}", data) for name, data in files.items()}
        manifest = {
            "step": state.step, "version": state.version, "files": digests,
            "created_at": datetime.now(UTC).isoformat(), "schema_version": "1.0",
        }
        self.store.put_create_once(f"{key}/manifest.json", json.dumps(manifest, sort_keys=True).encode())
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
        """Delete all but the ``keep`` newest complete checkpoints (never ``newest``) and dead attempts below it."""
        folders: dict[str, bool] = {}  # folder -> has a manifest
        for path in self.store.list(self.prefix, recursive=True):
            folder, _, name = path.rpartition("/")
            folders[folder] = folders.get(folder, False) or name == "manifest.json"
        kept = {key for _, key in self.complete()[: self.keep]} | {newest}
        newest_step = _step_of(newest) or 0
        for folder, complete in folders.items():
            step = _step_of(folder)
            if folder in kept or step is None or (not complete and step > newest_step):
                continue  # an incomplete folder above the newest step may still be being written
            with suppress(OSError):
                if complete:
                    self.store.delete(f"{folder}/manifest.json", missing_ok=True)  # uncommit first
                self.store.delete(folder, recursive=True, missing_ok=True)
                log.info("deleted checkpoint folder %s", folder)

    def complete(self) -> list[tuple[int, str]]:
        """(step, folder key) of every checkpoint with a manifest, newest first."""
        found = []
        for path in self.store.list(self.prefix, recursive=True):
            if path.endswith("/manifest.json"):
                folder = path[: -len("/manifest.json")]
                name = folder.rsplit("/", 1)[-1]
                try:
                    found.append((int(name.split("-")[1]), folder))
                except (IndexError, ValueError):
                    log.warning("ignoring unexpected checkpoint folder %s", folder)
        return sorted(found, reverse=True)

    def load(self, key: str) -> Checkpoint:
        """Load and verify one checkpoint (digests must match)."""
        manifest = json.loads(self.store.get(f"{key}/manifest.json"))
        blobs = {name: self.store.get(f"{key}/{name}", sha256=digest) for name, digest in manifest["files"].items()}
        meta = json.loads(blobs["state.json"])
        optimizer = load_tensors(blobs["optimizer.safetensors"])
        rng_tensors = {k: optimizer.pop(k) for k in [k for k in optimizer if k.startswith("rng.")]}
        state = LearnerState.from_json(meta["state"])
        if "step_log" not in meta["state"]:  # the current layout: trained ids come from the step log
            state.trained = trained_batches(self.steps.read(upto=state.step))
        return Checkpoint(
            key=key, state=state, adapter=load_tensors(blobs["adapter.safetensors"]),
            optimizer=optimizer, scalars=meta["scalars"], rng=meta["rng"], rng_tensors=rng_tensors,
        )

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint that loads and verifies.

        Only damage skips a checkpoint: a file whose bytes do not match the
        manifest's digest (``ChecksumError``) or a file the manifest names that is
        gone (``FileNotFoundError``); then the next older one is tried, with a
        warning.  Every other error (a timeout, a refused connection, a permission
        error) is raised: the process exits and is restarted to try again, instead
        of resuming from an older checkpoint (or from scratch) and dropping the
        steps trained since.
        """
        for _, key in self.complete():
            try:
                return self.load(key)
            except (ChecksumError, FileNotFoundError) as exc:
                log.warning("skipping damaged checkpoint %s: %s", key, exc)
        return None


def _step_of(folder: str) -> int | None:
    """``.../step-000120-<attempt>`` -> 120 (None for a name of another shape)."""
    parts = folder.rsplit("/", 1)[-1].split("-")
    return int(parts[1]) if len(parts) == 3 and parts[0] == "step" and parts[1].isdigit() else None
