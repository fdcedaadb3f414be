"""The adapter manifest: the commit point of one adapter version.

Learner -> store (``runs/<run_id>/adapters/vNNNNNN/manifest.json``) -> producers.
A version exists exactly when its manifest exists; the manifest names every file
of the adapter with its sha256, so a reader trusts nothing the manifest does not
name.  The sha256 of the manifest's bytes identifies the whole version (it covers
every file's digest) and is the ``adapter_sha256`` producers report per row.

Every version has a ``kind``: ``lora`` (a PEFT adapter folder for a language
model) or ``value-network`` (a value-based agent's Q-network: tensors in
safetensors plus the JSON that rebuilds its shape).  Both kinds share the
versions of a run and every guarantee (create-once manifests, sha256 per file);
a manifest written before kinds existed has none and reads as ``lora``.

Unknown fields are ignored rather than refused: a newer minor schema version may
add optional fields, and the digest covers the stored bytes whatever a reader
understands of them.  A newer major version is refused.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas.events import Sha256
from schemas.names import validate_name
from schemas.records import record_from_bytes, record_to_bytes
from schemas.versions import MANIFEST_SCHEMA_VERSION, check_readable

_RELATIVE_PATH_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*(/[A-Za-z0-9_][A-Za-z0-9._-]*)*")
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
ArtifactKind = Literal["lora", "value-network"]
# The files each kind must have (the registry refuses a version without them).
REQUIRED_FILES: dict[str, tuple[str, ...]] = {
    "lora": ("adapter_config.json", "adapter_model.safetensors"),
    "value-network": ("value_config.json", "value_network.safetensors"),
}


class ManifestError(ValueError):
    """Bytes that are not a readable adapter manifest."""


def check_relative_path(value: str, what: str = "path") -> str:
    """A '/'-separated relative path without '..', hidden or empty parts (it becomes a file name on disk)."""
    if not isinstance(value, str) or not _RELATIVE_PATH_RE.fullmatch(value) or ".." in value.split("/"):
        raise ValueError(
            f"{what} {value!r} is not allowed: use a relative path of letters, digits, '.', '_' or '-' "
            "parts separated by '/', without '..' or a leading '.'"
        )
    return value


class AdapterFile(BaseModel):
    """One file of an adapter version: where it lies (relative to the version folder) and its digest."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    path: str = Field(description="object key relative to the version folder, e.g. '<attempt>/adapter_config.json'")
    sha256: Sha256
    size: int = Field(ge=0, description="bytes")

    @field_validator("path")
    @classmethod
    def _relative(cls, value: str) -> str:
        return check_relative_path(value, "file path")


class AdapterManifest(BaseModel):
    """Version, lineage, files and metrics of one committed adapter version."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_version: str = Field(MANIFEST_SCHEMA_VERSION, description="MAJOR.MINOR of this record")
    run_id: str = Field(description="the run the version belongs to")
    kind: ArtifactKind = Field("lora", description="lora (PEFT adapter) or value-network (Q-network weights)")
    version: int = Field(ge=1, description="dense per run, starting at 1")
    base_model: str = Field(min_length=1, max_length=4096, description="model the adapter applies to")
    parent_version: int = Field(ge=0, description="version the learner started from; 0 = the base model")
    learner_step: int = Field(ge=0, description="optimizer step that produced this version")
    files: dict[str, AdapterFile] = Field(description="file name in the adapter folder -> where and what")
    metrics: dict[str, FiniteFloat] = Field(default_factory=dict, description="learner metrics at publish time")
    ends_with_session: str | None = Field(
        None, description="a snapshot of the Tinker-compatible API: retired when this session ends; None: kept")
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))

    @model_validator(mode="before")
    @classmethod
    def _readable(cls, data: Any) -> Any:
        if isinstance(data, dict) and "schema_version" in data:
            check_readable(str(data["schema_version"]), MANIFEST_SCHEMA_VERSION, "adapter manifest")
        return data

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, value: str) -> str:
        return validate_name(value, "run_id")

    @field_validator("files")
    @classmethod
    def _file_names(cls, value: dict[str, AdapterFile]) -> dict[str, AdapterFile]:
        if not value:
            raise ValueError("an adapter manifest must name at least one file")
        for name in value:
            check_relative_path(name, "file name")
        return value

    @field_validator("created_at")
    @classmethod
    def _utc(cls, value: datetime) -> datetime:
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)

    @model_validator(mode="after")
    def _lineage(self) -> AdapterManifest:
        if self.parent_version >= self.version:
            raise ValueError(f"parent_version {self.parent_version} must be below version {self.version}")
        return self


def manifest_to_bytes(manifest: AdapterManifest) -> bytes:
    """Canonical JSON (sorted keys, fixed separators): the same manifest always gives the same bytes and digest."""
    return record_to_bytes(manifest)


def manifest_from_bytes(data: bytes, where: str = "manifest") -> AdapterManifest:
    """Bytes -> validated manifest; ``ManifestError`` (``SchemaVersionError`` for a newer major) says what is wrong."""
    return record_from_bytes(data, AdapterManifest, MANIFEST_SCHEMA_VERSION, ManifestError, where, "adapter manifest")
