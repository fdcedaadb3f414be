"""Learner checkpoints in the store: tensors in safetensors, the rest in JSON, manifest last.

Layout (one folder per attempt, so a crashed half-written attempt never blocks
the next one from writing create-only)::

    runs/<run>/checkpoints/step-000120-<attempt>/adapter.safetensors
                                                /optimizer.safetensors
                                                /state.json
                                                /manifest.json   <- written last, create-only: the commit point

``state.json`` holds the step, the last published version, the consumed
positions (``topic:partition`` -> next offset), every trained ``batch_id`` with
the step that trained it, the per-step metrics, and the RNG states.  The newest
complete checkpoint is the highest step whose manifest exists and whose files
match their digests.  Nothing is unpickled: safetensors and JSON only.
"""

from __future__ import annotations

import json
import logging
import random
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from pipeline.store import ObjectStore

log = logging.getLogger("rlpipe.learner")


@dataclass
class LearnerState:
    """Everything the learner needs to continue exactly where a checkpoint left it."""

    step: int = 0
    version: int = 0  # last adapter version this learner published (0 = base model)
    positions: dict[str, int] = field(default_factory=dict)  # "topic:partition" -> next offset
    trained: dict[str, int] = field(default_factory=dict)  # batch_id -> step that trained it
    step_log: list[dict[str, Any]] = field(default_factory=list)  # per-step metrics, in order
    dropped_stale_rows: int = 0
    log_identity: dict[str, str] = field(default_factory=dict)  # topic -> id of the log ``positions`` point into

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step, "version": self.version, "positions": self.positions, "trained": self.trained,
            "step_log": self.step_log, "dropped_stale_rows": self.dropped_stale_rows,
            "log_identity": self.log_identity,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LearnerState:
        return cls(
            step=int(data["step"]), version=int(data["version"]), positions=dict(data["positions"]),
            trained=dict(data["trained"]), step_log=list(data["step_log"]),
            dropped_stale_rows=int(data.get("dropped_stale_rows", 0)),
            log_identity=dict(data.get("log_identity", {})),
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

    def __init__(self, store: ObjectStore, run_id: str) -> None:
        self.store, self.run_id = store, run_id
        self.prefix = f"runs/{run_id}/checkpoints"

    def save(
        self,
        state: LearnerState,
        adapter: dict[str, torch.Tensor],
        optimizer: dict[str, torch.Tensor],
        scalars: dict[str, Any],
    ) -> str:
        """Write files, then the manifest (create-only); return the checkpoint's folder key."""
        rng_tensors, rng_states = capture_rng()
        key = f"{self.prefix}/step-{state.step:06d}-{uuid.uuid4().hex[:8]}"
        files = {
            "adapter.safetensors": save_tensors(adapter),
            "optimizer.safetensors": save_tensors({**optimizer, **rng_tensors}),
            "state.json": json.dumps(
                {"state": state.to_json(), "scalars": scalars, "rng": rng_states}, sort_keys=True
            ).encode(),
        }
        digests = {name: self.store.put_create(f"{key}/{name}", data) for name, data in files.items()}
        manifest = {
            "step": state.step, "version": state.version, "files": digests,
            "created_at": datetime.now(UTC).isoformat(), "schema_version": "1.0",
        }
        self.store.put_create(f"{key}/manifest.json", json.dumps(manifest, sort_keys=True).encode())
        return key

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
        return Checkpoint(
            key=key, state=LearnerState.from_json(meta["state"]), adapter=load_tensors(blobs["adapter.safetensors"]),
            optimizer=optimizer, scalars=meta["scalars"], rng=meta["rng"], rng_tensors=rng_tensors,
        )

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint that loads and verifies (a damaged one is skipped with a warning)."""
        for _, key in self.complete():
            try:
                return self.load(key)
            except Exception as exc:
                log.warning("skipping checkpoint %s: %s", key, exc)
        return None
