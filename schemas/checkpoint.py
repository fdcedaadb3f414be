"""The learner checkpoint's data contract: its state, its folder names and its manifest.

Learner (``consumers.checkpoint``, which writes the tensors) -> store -> learner
on restart, ``rlpipe report`` and ``rlpipe runs`` (which read only this contract).
One folder per attempt, so a crashed half-written attempt never blocks the next
one from writing create-only::

    runs/<run>/checkpoints/step-000120-<attempt>/adapter.safetensors
                                                /optimizer.safetensors
                                                /state.json      {"state": LearnerState, "scalars", "rng"}
                                                /manifest.json   <- written last, create-only: the commit point

A checkpoint is complete exactly when its manifest exists; the manifest names
every file with its sha256.  Folder names are parsed here and nowhere else: a
name of another shape is not a checkpoint.  ``<attempt>`` begins with the write
time (``consumers.checkpoint.attempt_name``), so of two checkpoints of one step the
later sorts first (an attempt named the older way, by 8 random characters, counts as
written before any named by its time).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from schemas.names import validate_name
from schemas.versions import check_readable

CHECKPOINT_SCHEMA_VERSION = "1.0"
MANIFEST_FILE = "manifest.json"
STATE_FILE = "state.json"


def checkpoint_prefix(run_id: str) -> str:
    """Where a run's checkpoint folders lie in the store (``InvalidNameError`` for a run id that is no name)."""
    return f"runs/{validate_name(run_id, 'run_id')}/checkpoints"


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
    # sha256 of the step object of ``step`` as this learner wrote it (``pipeline.io.steplog``: the step log's hash
    # chain); None in checkpoints written before it was recorded, and before the first step
    step_log_head: str | None = None
    # read from a checkpoint of the old layout (``trained`` and the step log inline); never written
    legacy_layout: bool = field(default=False, repr=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step, "version": self.version, "positions": self.positions,
            "dropped_stale_rows": self.dropped_stale_rows, "log_identity": self.log_identity,
            "step_log_head": self.step_log_head,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LearnerState:
        return cls(
            step=int(data["step"]), version=int(data["version"]), positions=dict(data["positions"]),
            trained=dict(data.get("trained", {})), dropped_stale_rows=int(data.get("dropped_stale_rows", 0)),
            legacy_step_log=list(data.get("step_log", [])), log_identity=dict(data.get("log_identity", {})),
            legacy_layout="step_log" in data,
            step_log_head=None if data.get("step_log_head") is None else str(data["step_log_head"]),
        )


@dataclass(frozen=True)
class CheckpointFolder:
    """One checkpoint attempt's folder: ``<prefix>/step-000120-<attempt>``."""

    prefix: str
    step: int
    attempt: str

    @property
    def name(self) -> str:
        return f"step-{self.step:06d}-{self.attempt}"

    @property
    def key(self) -> str:
        return f"{self.prefix}/{self.name}"

    @classmethod
    def parse(cls, key: str) -> CheckpointFolder | None:
        """``.../step-000120-<attempt>`` -> its folder (None for a name of another shape)."""
        prefix, _, name = key.rpartition("/")
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != "step" or not (parts[1].isascii() and parts[1].isdigit()):
            return None
        if not (parts[2].isascii() and parts[2].isalnum()):
            return None
        return cls(prefix, int(parts[1]), parts[2])


def complete_folders(
    keys: Iterable[str], on_unexpected: Callable[[str], None] | None = None
) -> list[CheckpointFolder]:
    """The folders among listed object ``keys`` that hold a manifest, newest step first.

    A folder with a manifest but a name of another shape is passed to ``on_unexpected`` and left out.
    """
    found = []
    for key in keys:
        if key.endswith(f"/{MANIFEST_FILE}"):
            folder = key.removesuffix(f"/{MANIFEST_FILE}")
            parsed = CheckpointFolder.parse(folder)
            if parsed is not None:
                found.append(parsed)
            elif on_unexpected is not None:
                on_unexpected(folder)
    # within a step: attempts named by their write time (20 characters) after the older random 8-character names
    return sorted(found, key=lambda f: (f.step, len(f.attempt) > 8, f.key), reverse=True)


@dataclass(frozen=True)
class CheckpointManifest:
    """``manifest.json``: the commit point of one checkpoint; names every file with its sha256."""

    step: int
    version: int
    files: dict[str, str]  # file name in the folder -> sha256
    created_at: str  # ISO 8601, UTC
    schema_version: str = CHECKPOINT_SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step, "version": self.version, "files": self.files,
            "created_at": self.created_at, "schema_version": self.schema_version,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CheckpointManifest:
        """Raises ``KeyError``, ``TypeError`` or ``ValueError`` for a manifest that is not of this shape, and
        ``NewerSchemaError`` (a ``ValueError``) for one of a newer major version, which may mean other things."""
        if not isinstance(data, dict):
            raise TypeError("it is not a JSON object")
        check_readable(str(data.get("schema_version", CHECKPOINT_SCHEMA_VERSION)), CHECKPOINT_SCHEMA_VERSION,
                       "checkpoint manifest")
        files = data["files"]
        if not isinstance(files, dict):
            raise TypeError("its 'files' is not an object")
        return cls(
            step=int(data["step"]), version=int(data["version"]), files={str(k): str(v) for k, v in files.items()},
            created_at=str(data.get("created_at", "")),
            schema_version=str(data.get("schema_version", CHECKPOINT_SCHEMA_VERSION)),
        )
