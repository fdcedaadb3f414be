"""A training client's checkpoints in the store: records, time to live, external weights and their download URLs.

  runs/<run>/weights/<name>.safetensors        ``save_state``: adapter, AdamW and RNG state (one blob)
  runs/<run>/weights/<name>.json               its record
  runs/<run>/sampler_weights/<name>.json       ``save_weights_for_sampler``: the registry version it published
  runs/<run>/external_weights/<name>/<file>    ``save_weights_external``: the PEFT folder (adapter_config.json,
                                               adapter_model.safetensors) that peft and vLLM load
  runs/<run>/external_weights/<name>.json      its record, with each file's sha256 and size

A record is written after its files and deleted after them, so a checkpoint exists
exactly while its record does; a delete cut short is finished by deleting again.

**Time to live.** ``ttl_seconds`` on ``save_state`` and ``save_weights_external``,
or ``set_checkpoint_ttl_from_tinker_path`` later, puts ``expires_at`` (unix
seconds) in the record; the range is the SDK's, one hour to ten years, and
``None`` removes it.  An expired checkpoint is gone for every call: it is not
listed, loaded or downloaded, and the first call that finds it expired (a listing
of its run, a load, a download) deletes its objects.

**Downloads.** ``get_external_weights_urls`` answers one URL per file, on the
gateway that answered, valid for ``URL_TTL_S``.  A URL names the model, the
checkpoint, the file and its expiry, signed with HMAC-SHA256 under a key kept in
the store (``SIGNING_KEY``, made by the first gateway that signs), so any gateway
of a deployment honours any other's URLs.  Like a bucket's signed URL it needs no
API key; the file is served only if its bytes match the sha256 its record holds.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, urlencode

from pipeline.api.wire import PATH_FOLDERS, TinkerPath, checkpoint_name
from pipeline.io.store import ObjectStore, sha256_hex
from schemas.api import ApiError, model_run_name

MIN_TTL_S = 3600  # the SDK's documented range for a checkpoint's ttl_seconds: one hour ...
MAX_TTL_S = 10 * 365 * 86400  # ... to ten years
URL_TTL_S = 3600  # how long a download URL is honoured (the tinker CLI asks again five minutes before)
SIGNING_KEY = "api/url-signing.key"
DOWNLOAD_PATH = "/api/v1/external_weights_files"


class NotFound(ApiError):
    """No such checkpoint (or not this tenant's): HTTP 404."""


class UrlRefused(ApiError):
    """A download URL whose signature does not hold or whose time is over: HTTP 403."""


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
    return f"{checkpoint_prefix(path.run, 'external_weights')}/{path.name}/{file}"


def path_of(model_id: str, checkpoint_id: str) -> TinkerPath:
    """The checkpoint ``<folder>/<name>`` of a model (a RestClient route's ``checkpoint_id``)."""
    folder, _, name = checkpoint_id.partition("/")
    kind = next((kind for kind, its_folder in PATH_FOLDERS.items() if its_folder == folder), None)
    if kind is None:
        raise ApiError(f"checkpoint id {checkpoint_id!r} is not weights/<name>, sampler_weights/<name> or "
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
    record = read_record(store, path)
    if record is None:
        raise NotFound(f"no checkpoint {path}; see list_checkpoints")
    store.put(record_key(path), json.dumps({**record, "expires_at": expires_at}).encode())


def set_public(store: ObjectStore, path: TinkerPath, public: bool) -> None:
    """Publish the checkpoint (every tenant may load, sample from or download it) or take that back; doing
    either twice is harmless (the SDK resends a 409, so "already public" would only make the client wait)."""
    record = read_record(store, path)
    if record is None:
        raise NotFound(f"no checkpoint {path}; see list_checkpoints")
    if bool(record.get("public")) != public:
        store.put(record_key(path), json.dumps({**record, "public": public}).encode())


# ---- records -----------------------------------------------------------------------------------------------


def write_record(store: ObjectStore, path: TinkerPath, size_bytes: int | None, expires_at: float | None = None,
                 **extra: Any) -> None:
    """The checkpoint's record, written after its files (it is what makes the checkpoint exist)."""
    record = {"name": path.name, "tinker_path": str(path), "time": time.time(), "size_bytes": size_bytes,
              "expires_at": expires_at, **extra}
    store.put(record_key(path), json.dumps(record).encode())


def read_record(store: ObjectStore, path: TinkerPath, now: float | None = None) -> dict[str, Any] | None:
    """The checkpoint's record; None when there is none, or when it has expired (its objects are then deleted)."""
    try:
        record = json.loads(store.get(record_key(path)))
    except FileNotFoundError:
        return None
    if not isinstance(record, dict):
        return None
    expires_at = record.get("expires_at")
    if expires_at is not None and float(expires_at) <= (time.time() if now is None else now):
        delete(store, path)
        return None
    return record


def list_checkpoints(store: ObjectStore, model_id: str, now: float | None = None) -> list[dict[str, Any]]:
    """Every live checkpoint of a model, oldest first, as the SDK's ``Checkpoint`` (expired ones are deleted)."""
    run = model_run_name(model_id)
    found = []
    for kind, folder in PATH_FOLDERS.items():
        for key in store.list(checkpoint_prefix(run, folder)):
            if not key.endswith(".json"):
                continue
            record = read_record(store, TinkerPath(model_id, kind, key.rsplit("/", 1)[-1].removesuffix(".json")), now)
            if record is not None:
                found.append({"checkpoint_id": f"{folder}/{record['name']}", "checkpoint_type": kind,
                              "time": record["time"], "tinker_path": record["tinker_path"],
                              "size_bytes": record.get("size_bytes"), "expires_at": record.get("expires_at"),
                              "public": bool(record.get("public"))})
    return sorted(found, key=lambda item: item["time"])


def delete(store: ObjectStore, path: TinkerPath) -> None:
    """Remove the checkpoint's objects, its record last."""
    prefix = checkpoint_prefix(path.run, PATH_FOLDERS[path.kind])
    store.delete(f"{prefix}/{path.name}", recursive=True, missing_ok=True)
    store.delete(f"{prefix}/{path.name}.safetensors", missing_ok=True)
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


def signing_key(store: ObjectStore) -> bytes:
    """The deployment's URL-signing key (made once, create-only, by the first gateway that signs)."""
    try:
        return store.get(SIGNING_KEY)
    except FileNotFoundError:
        with contextlib.suppress(FileExistsError):  # another gateway made it first
            store.put_create(SIGNING_KEY, secrets.token_bytes(32))
        return store.get(SIGNING_KEY)


def _signature(key: bytes, path: TinkerPath, file: str, expires: int) -> str:
    message = f"{path.model_id}\n{path.name}\n{file}\n{expires}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def download_urls(store: ObjectStore, path: TinkerPath, base_url: str,
                  now: float | None = None) -> tuple[dict[str, str], int]:
    """One signed URL per file of an external-weights checkpoint, and when they expire (unix seconds)."""
    if path.kind != "external":
        raise ApiError(f"{path} is not external weights; save them with save_weights_external, or download a "
                       "training state with `tinker checkpoint download`")
    record = read_record(store, path, now)
    if record is None:
        raise NotFound(f"no external weights at {path}; see list_checkpoints")
    expires = int((time.time() if now is None else now) + URL_TTL_S)
    key = signing_key(store)
    base = base_url.rstrip("/")
    urls = {}
    for file in sorted(record["files"]):
        query = urlencode({"expires": expires, "signature": _signature(key, path, file, expires)})
        urls[file] = f"{base}{DOWNLOAD_PATH}/{quote(path.model_id)}/{quote(path.name)}/{quote(file)}?{query}"
    return urls, expires


def download(store: ObjectStore, model_id: str, name: str, file: str, expires: int, signature: str,
             now: float | None = None) -> bytes:
    """The bytes a signed URL names, checked against the record's sha256; ``UrlRefused`` for a bad or old URL."""
    path = TinkerPath(model_id, "external", checkpoint_name(name))
    if not hmac.compare_digest(_signature(signing_key(store), path, file, expires), signature):
        raise UrlRefused("this download URL's signature does not hold; ask for new URLs (get_external_weights_urls)")
    if expires <= (time.time() if now is None else now):
        raise UrlRefused("this download URL has expired; ask for new URLs (get_external_weights_urls)")
    record = read_record(store, path, now)
    if record is None or file not in record["files"]:
        raise NotFound(f"no file {file!r} in external weights {path}; it was deleted or has expired")
    return store.get(external_file_key(path, file), record["files"][file]["sha256"])
