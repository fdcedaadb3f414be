"""A training client's checkpoints in the store: records, time to live, publication and external weights.

  runs/<run>/weights/<name>.safetensors              ``save_state``: adapter, AdamW and RNG state (one blob)
  runs/<run>/weights/<name>.json                     its record (with the blob's sha256, checked on every load)
  runs/<run>/sampler_weights/<name>.json             ``save_weights_for_sampler``: the registry version it made
  runs/<run>/external_weights/<name>.json            ``save_weights_external``: the record, each file's sha256
  runs/<run>/external_weights_files/<name>/<file>    and the PEFT folder (adapter_config.json,
                                                     adapter_model.safetensors) that peft and vLLM load

A record is written after its objects and deleted after them, so a checkpoint exists
exactly while its record does; a delete cut short is finished by deleting again.
Only records end in ``.json`` in their folders and no checkpoint has a folder there, so
any name (``a.json`` too) is a checkpoint like another.

**Time to live.** ``ttl_seconds`` on ``save_state``, ``save_weights_for_sampler`` and
``save_weights_external``, or ``set_checkpoint_ttl_from_tinker_path`` later, puts
``expires_at`` (unix seconds) in the record; the range is the SDK's, one hour to ten
years, and ``None`` removes it.  An expired checkpoint is hidden from every call that
reads one (listings, loads, new sampling clients, downloads, ``weights_info``).  Its
objects are deleted by ``sweep_base_model``, which the trainer of its base model runs
between calls: the trainer is the one writer of checkpoints, so a sweep never races a
save of the same name, as a delete by a gateway that read an old record would.  The
sweep visits the clients in the expiring index (``EXPIRING``), not the whole store.

**Sampler weights** are a registry version named by their record: when the record is
deleted (or swept after its TTL), or a save under the same name replaces it
(``name_sampler_version``), the version it named is noted in ``UNNAMED_VERSIONS``
first, and ``pipeline.api.lifecycle.sweep_unnamed_versions`` retires it once no live
session samples from it.

**Publication.** A published checkpoint (``public`` in its record) is every tenant's
to load, sample from and download; only its owner changes or deletes it.

A TTL or publication change rewrites the record (read, then write): one that meets a
save of the same name with ``overwrite=True`` at the same moment can put the old
save's fields back beside the new weights, until the next save or change of it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from pipeline.api.wire import PATH_FOLDERS, TinkerPath, checkpoint_name
from pipeline.io.store import ObjectStore, sha256_hex
from schemas.api import ApiError, model_id_for, model_run_name
from schemas.names import echoed

MIN_TTL_S = 3600  # the SDK's documented range for a checkpoint's ttl_seconds: one hour ...
MAX_TTL_S = 10 * 365 * 86400  # ... to ten years
EXTERNAL_FILES = "external_weights_files"  # the folder of the exports' files, apart from their records
EXPIRING = "api/expiring"  # one empty object per training client (its run name) with checkpoints that have a TTL
UNNAMED_VERSIONS = "api/unnamed-versions"  # <run>/<version>: registry versions whose sampler_weights name is gone


class NotFound(ApiError):
    """No such checkpoint (or not this tenant's): HTTP 404."""


def checkpoint_prefix(run: str, folder: str) -> str:
    """Store folder of a model's ``weights``, ``sampler_weights`` or ``external_weights``."""
    return f"runs/{run}/{folder}"


def weights_key(path: TinkerPath) -> str:
    """The store key of a ``save_state`` checkpoint's tensors."""
    return f"{checkpoint_prefix(path.run, 'weights')}/{path.name}.safetensors"


def record_key(path: TinkerPath) -> str:
    """The store key of a checkpoint's record (its commit point)."""
    return f"{checkpoint_prefix(path.run, PATH_FOLDERS[path.kind])}/{path.name}.json"


def external_file_key(path: TinkerPath, file: str) -> str:
    """The store key of one file of an external-weights checkpoint."""
    return f"{checkpoint_prefix(path.run, EXTERNAL_FILES)}/{path.name}/{file}"


def path_of(model_id: str, checkpoint_id: str) -> TinkerPath:
    """The checkpoint ``<folder>/<name>`` of a model (a RestClient route's ``checkpoint_id``)."""
    folder, _, name = checkpoint_id.partition("/")
    kind = next((kind for kind, its_folder in PATH_FOLDERS.items() if its_folder == folder), None)
    if kind is None:
        raise ApiError(f"checkpoint id {echoed(checkpoint_id)} is not weights/<name>, sampler_weights/<name> or "
                       "external_weights/<name>")
    return TinkerPath(model_id, kind, checkpoint_name(name))


# ---- time to live ------------------------------------------------------------------------------------------


def expiry(ttl_seconds: int | None, now: float | None = None) -> float | None:
    """``expires_at`` for a TTL (None: never), or a user error naming the range."""
    if ttl_seconds is None:
        return None
    if not MIN_TTL_S <= ttl_seconds <= MAX_TTL_S:
        raise ApiError(f"ttl_seconds={ttl_seconds}: give between {MIN_TTL_S} (one hour) and {MAX_TTL_S} (ten years), "
                       "or None for a checkpoint that does not expire")
    return (time.time() if now is None else now) + ttl_seconds


def set_ttl(store: ObjectStore, path: TinkerPath, ttl_seconds: int | None) -> None:
    """Make the checkpoint expire ``ttl_seconds`` from now (None: never)."""
    expires_at = expiry(ttl_seconds)
    _rewrite(store, path, "expires_at", expires_at)
    if expires_at is not None:
        mark_expiring(store, path.model_id)


def set_public(store: ObjectStore, path: TinkerPath, public: bool) -> None:
    """Publish the checkpoint (every tenant may load, sample from or download it) or take that back; doing
    either twice is harmless (the SDK resends a 409, so "already public" would only make the client wait)."""
    _rewrite(store, path, "public", public)


def _rewrite(store: ObjectStore, path: TinkerPath, field: str, value: Any) -> None:
    """One field of a live checkpoint's record.  A sweep or delete that took the checkpoint between the read and
    the write leaves a record without its objects: it is removed again, and the change is answered as not found."""
    record = read_record(store, path)
    if record is None:
        raise NotFound(f"no checkpoint {path} (never saved, deleted or expired); see list_checkpoints")
    if record.get(field) == value:
        return
    store.put(record_key(path), json.dumps({**record, field: value}).encode())
    if not _objects_there(store, path, record):
        store.delete(record_key(path), missing_ok=True)
        raise NotFound(f"checkpoint {path} was deleted meanwhile; see list_checkpoints")


def _objects_there(store: ObjectStore, path: TinkerPath, record: dict[str, Any]) -> bool:
    if path.kind == "training":
        return store.exists(weights_key(path))
    if path.kind == "external":
        return all(store.exists(external_file_key(path, file)) for file in record.get("files", {}))
    version = record.get("version")  # sampler weights: their version, unless a delete noted it as unnamed since
    return not store.exists(f"{UNNAMED_VERSIONS}/{path.run}/{version}")


# ---- the expiring index: which training clients have checkpoints with a TTL --------------------------------


def _expiring_key(model_id: str) -> str:
    return f"{EXPIRING}/{model_run_name(model_id)}"


def mark_expiring(store: ObjectStore, model_id: str) -> None:
    """Note that the model has a checkpoint with a TTL (after its record is written), so sweeps visit it."""
    store.put(_expiring_key(model_id), b"")


# ---- records -----------------------------------------------------------------------------------------------


def write_record(store: ObjectStore, path: TinkerPath, size_bytes: int | None, expires_at: float | None = None,
                 **extra: Any) -> None:
    """The checkpoint's record, written after its files (it is what makes the checkpoint exist)."""
    record = {"name": path.name, "tinker_path": str(path), "time": time.time(), "size_bytes": size_bytes,
              "expires_at": expires_at, **extra}
    store.put(record_key(path), json.dumps(record).encode())
    if expires_at is not None:
        mark_expiring(store, path.model_id)


def read_record(store: ObjectStore, path: TinkerPath, now: float | None = None,
                expired: bool = False) -> dict[str, Any] | None:
    """The checkpoint's record; None when there is none or it has expired (unless ``expired``)."""
    try:
        record = json.loads(store.get(record_key(path)))
    except FileNotFoundError:
        return None
    if not isinstance(record, dict) or (not expired and has_expired(record, now)):
        return None
    return record


def has_expired(record: dict[str, Any], now: float | None = None) -> bool:
    expires_at = record.get("expires_at")
    return expires_at is not None and float(expires_at) <= (time.time() if now is None else now)


def _records(store: ObjectStore, model_id: str) -> list[tuple[TinkerPath, dict[str, Any]]]:
    """Every checkpoint record of a model, expired ones too."""
    run = model_run_name(model_id)
    found = []
    for kind, folder in PATH_FOLDERS.items():
        for key in store.list(checkpoint_prefix(run, folder)):
            if key.endswith(".json"):
                path = TinkerPath(model_id, kind, key.rsplit("/", 1)[-1].removesuffix(".json"))
                record = read_record(store, path, expired=True)
                if record is not None:
                    found.append((path, record))
    return found


def list_checkpoints(store: ObjectStore, model_id: str, now: float | None = None) -> list[dict[str, Any]]:
    """Every live checkpoint of a model, oldest first, as the SDK's ``Checkpoint``."""
    found = [{"checkpoint_id": f"{PATH_FOLDERS[path.kind]}/{path.name}", "checkpoint_type": path.kind,
              "time": record["time"], "tinker_path": record["tinker_path"], "size_bytes": record.get("size_bytes"),
              "expires_at": record.get("expires_at"), "public": bool(record.get("public"))}
             for path, record in _records(store, model_id) if not has_expired(record, now)]
    return sorted(found, key=lambda item: item["time"])


def sweep_expired(store: ObjectStore, model_id: str, now: float | None = None) -> int:
    """Delete the model's expired checkpoints; how many.  Run it where checkpoints are written (the trainer)."""
    expired = [path for path, record in _records(store, model_id) if has_expired(record, now)]
    for path in expired:
        delete(store, path)
    return len(expired)


def clients_in_index(store: ObjectStore, index: str, base_model: str,
                     base_models: dict[str, str | None]) -> list[tuple[str, str]]:
    """(index key, model id) of the training clients of ``base_model`` in an index of empty objects named after
    their runs (``EXPIRING``, ``pipeline.api.lifecycle.SNAPSHOTS``).  ``base_models`` caches each model record's
    base model (records are create-only)."""
    found = []
    for key in store.list(index):
        model_id = model_of_run(key.rsplit("/", 1)[-1])
        if model_id is not None and base_model_of(store, model_id, base_models) == base_model:
            found.append((key, model_id))
    return found


def model_of_run(run: str) -> str | None:
    """The training client's model id of a run name (``<session>.train.<n>``), None for any other name."""
    session, _, number = run.partition(".train.")
    return model_id_for(session, "train", int(number)) if number.isdigit() and session else None


def base_model_of(store: ObjectStore, model_id: str, base_models: dict[str, str | None]) -> str | None:
    """A training client's base model from its record (None without one), cached in ``base_models`` (records are
    create-only)."""
    session, _, number = model_id.split(":")
    model_key = f"sessions/{session}/models/{number}.json"
    if model_key not in base_models:
        try:
            base_models[model_key] = json.loads(store.get(model_key)).get("base_model")
        except (FileNotFoundError, ValueError, AttributeError):
            base_models[model_key] = None
    return base_models[model_key]


def saved_base_model(store: ObjectStore, path: TinkerPath, record: dict[str, Any]) -> str | None:
    """The base model a checkpoint's weights were trained on: its record's ``base_model`` (written by every save),
    else its training client's record's; None when neither says."""
    return record.get("base_model") or base_model_of(store, path.model_id, {})


def check_base_model(path: str, saved_on: str | None, base_model: str) -> None:
    """Refuse to load weights trained on ``saved_on`` into a training client of another ``base_model`` (LoRA
    weights of the same shapes load without an error, and then mean nothing); None (not known) loads as asked."""
    if saved_on is not None and saved_on != base_model:
        raise ApiError(f"{path} holds LoRA weights trained on {saved_on}, which mean nothing on {base_model}; load it "
                       f"into a training client of {saved_on}, or start one from it "
                       "(create_training_client_from_state without base_model)")


def named_versions(store: ObjectStore, model_id: str) -> set[int]:
    """The registry versions that the model's sampler_weights records name (expired ones too, until swept)."""
    return {record["version"] for path, record in _records(store, model_id)
            if path.kind == "sampler" and isinstance(record.get("version"), int)}


def sweep_base_model(store: ObjectStore, base_model: str, base_models: dict[str, str | None],
                     now: float | None = None) -> int:
    """``sweep_expired`` for the training clients of ``base_model`` that have checkpoints with a TTL (the
    expiring index, not every session in the store); how many checkpoints were deleted.  A client keeps its index
    entry while any of its checkpoints has a TTL: the entry is removed before its records are read, and put back
    if one still has."""
    swept = 0
    for key, model_id in clients_in_index(store, EXPIRING, base_model, base_models):
        store.delete(key, missing_ok=True)
        swept += sweep_expired(store, model_id, now)
        if any(record.get("expires_at") is not None for _, record in _records(store, model_id)):
            mark_expiring(store, model_id)
    return swept


def note_unnamed(store: ObjectStore, run: str, version: Any) -> None:
    """Note that no record names registry ``version`` of ``run`` any more (sweeps retire it when unused)."""
    if isinstance(version, int) and not isinstance(version, bool):
        store.put(f"{UNNAMED_VERSIONS}/{run}/{version}", json.dumps({"time": time.time()}).encode())


def name_sampler_version(store: ObjectStore, path: TinkerPath, version: int, size_bytes: int,
                         expires_at: float | None) -> None:
    """Record sampler weights ``path`` as registry ``version``, whose adapter files hold ``size_bytes``; a version
    the name held before is noted unnamed first (the SDK's named sampler saves replace their name)."""
    before = read_record(store, path, expired=True)
    if before is not None and before.get("version") != version:
        note_unnamed(store, path.run, before.get("version"))
    write_record(store, path, size_bytes, expires_at, version=version)


def delete(store: ObjectStore, path: TinkerPath) -> None:
    """Remove the checkpoint's objects, its record last (sampler weights: their version noted as unnamed first)."""
    if path.kind == "sampler":
        record = read_record(store, path, expired=True)
        note_unnamed(store, path.run, None if record is None else record.get("version"))
    if path.kind == "training":
        store.delete(weights_key(path), missing_ok=True)
    elif path.kind == "external":
        store.delete(f"{checkpoint_prefix(path.run, EXTERNAL_FILES)}/{path.name}", recursive=True, missing_ok=True)
    store.delete(record_key(path), missing_ok=True)


# ---- external weights --------------------------------------------------------------------------------------


def write_external(store: ObjectStore, path: TinkerPath, files: Mapping[str, bytes], expires_at: float | None,
                   **extra: Any) -> int:
    """The files of an external-weights checkpoint, then its record (each file's sha256 and size); the total size."""
    for file, data in files.items():
        store.put(external_file_key(path, file), data)
    listed = {file: {"sha256": sha256_hex(data), "size": len(data)} for file, data in files.items()}
    size = sum(len(data) for data in files.values())
    write_record(store, path, size, expires_at, files=listed, **extra)
    return size
