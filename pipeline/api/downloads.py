"""Signed download URLs for external weights (``get_external_weights_urls``), served by the gateway itself.

A URL names the model, the checkpoint, the file and when it expires (``URL_TTL_S``
after it was made), signed with HMAC-SHA256 under a key kept in the store
(``SIGNING_KEY``, made by the first gateway that signs), so any gateway of a
deployment honours any other's URLs.  The signature also covers the export's
``time``, so a URL is for the export it was made for: once the name is saved
again, the old URLs are refused.  Like a bucket's signed URL it needs no API key.

A file is read twice in pieces: once to check it against the sha256 in its record
(a mismatch is answered as an error before anything is sent), then to send it, its
sha256 checked again on the way (a file replaced between the two reads ends the
response short).  So a large adapter costs a gateway one piece of memory per
download, not the whole file.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import quote, urlencode

from pipeline.api.checkpoints import NotFound, external_file_key, read_record
from pipeline.api.wire import TinkerPath, checkpoint_name
from pipeline.io.store import ChecksumError, ObjectStore
from schemas.api import ApiError

URL_TTL_S = 3600  # how long a download URL is honoured (the tinker CLI asks again five minutes before)
SIGNING_KEY = "api/url-signing.key"
DOWNLOAD_PATH = "/api/v1/external_weights_files"
PIECE = 1 << 20  # bytes read and sent at a time


class UrlRefused(ApiError):
    """A download URL whose signature does not hold or whose time is over: HTTP 403."""


@dataclass(frozen=True)
class Download:
    """A file a signed URL names, checked against its record: where it is, its size and its sha256."""

    key: str
    size: int
    sha256: str


def signing_key(store: ObjectStore) -> bytes:
    """The deployment's URL-signing key (made once, create-only, by the first gateway that signs)."""
    try:
        return store.get(SIGNING_KEY)
    except FileNotFoundError:
        with contextlib.suppress(FileExistsError):  # another gateway made it first
            store.put_create(SIGNING_KEY, secrets.token_bytes(32))
        return store.get(SIGNING_KEY)


def _signature(key: bytes, path: TinkerPath, made: float, file: str, expires: int) -> str:
    message = f"{path.model_id}\n{path.name}\n{made!r}\n{file}\n{expires}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def download_urls(store: ObjectStore, path: TinkerPath, base_url: str,
                  now: float | None = None) -> tuple[dict[str, str], int]:
    """One signed URL per file of an external-weights checkpoint, and when they expire (unix seconds)."""
    if path.kind != "external":
        raise ApiError(f"{path} is not external weights; save them with save_weights_external, or download a "
                       "training state with `tinker checkpoint download`")
    record = read_record(store, path, now)
    if record is None:
        raise NotFound(f"no external weights at {path} (never saved, deleted or expired); see list_checkpoints")
    missing = [file for file in sorted(record["files"]) if not store.exists(external_file_key(path, file))]
    if missing:
        raise NotFound(_partly_deleted(path, missing[0]))
    expires = int((time.time() if now is None else now) + URL_TTL_S)
    key = signing_key(store)
    base = base_url.rstrip("/")
    urls = {}
    for file in sorted(record["files"]):
        query = urlencode({"expires": expires, "signature": _signature(key, path, record["time"], file, expires)})
        urls[file] = f"{base}{DOWNLOAD_PATH}/{quote(path.model_id)}/{quote(path.name)}/{quote(file)}?{query}"
    return urls, expires


def check_download(store: ObjectStore, model_id: str, name: str, file: str, expires: int, signature: str,
                   now: float | None = None) -> Download:
    """The file a signed URL names, its bytes checked against its record; ``UrlRefused`` for a bad or old URL,
    ``NotFound`` for a file no longer there, ``ChecksumError`` for one whose bytes changed."""
    path = TinkerPath(model_id, "external", checkpoint_name(name))
    record = read_record(store, path, now)
    if record is None:
        raise NotFound(f"no external weights at {path}: deleted or expired; save them again "
                       "(save_weights_external)")
    if not hmac.compare_digest(_signature(signing_key(store), path, record["time"], file, expires), signature):
        raise UrlRefused("this download URL's signature does not hold (or the weights were saved again since); "
                         "ask for new URLs (get_external_weights_urls)")
    if expires <= (time.time() if now is None else now):
        raise UrlRefused("this download URL has expired; ask for new URLs (get_external_weights_urls)")
    listed = record["files"].get(file)
    if listed is None:
        raise NotFound(f"no file {file!r} in external weights {path}; ask for new URLs (get_external_weights_urls)")
    download = Download(external_file_key(path, file), int(listed["size"]), str(listed["sha256"]))
    digest = hashlib.sha256()
    for piece in _pieces(store, download.key, path, file):
        digest.update(piece)
    if digest.hexdigest() != download.sha256:
        raise ChecksumError(f"checksum mismatch for {file} of {path}: expected sha256 {download.sha256}, found "
                            f"{digest.hexdigest()}; the file is corrupt, so it was not sent: save the weights again")
    return download


def send(store: ObjectStore, download: Download) -> Iterator[bytes]:
    """The file's bytes in pieces, checked again on the way; a file changed since ``check_download`` ends short."""
    digest = hashlib.sha256()
    for piece in _pieces(store, download.key, None, ""):
        digest.update(piece)
        yield piece
    if digest.hexdigest() != download.sha256:
        raise ChecksumError(f"{download.key} changed while it was sent; the response was cut short")


def _pieces(store: ObjectStore, key: str, path: TinkerPath | None, file: str) -> Iterator[bytes]:
    try:
        handle = store.open_input(key)
    except FileNotFoundError:
        raise NotFound(_partly_deleted(path, file) if path is not None else f"no object at {key}") from None
    with handle:
        while piece := handle.read(PIECE):
            yield piece


def _partly_deleted(path: TinkerPath, file: str) -> str:
    return (f"{file} of {path} is missing: the checkpoint was partly deleted; delete it again (delete_checkpoint) "
            "or save it again")
