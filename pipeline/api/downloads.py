"""Signed download URLs for external weights (``get_external_weights_urls``), served by the gateway itself.

A URL names the model, the checkpoint, the file, the export (``v``, its record's
``time``), whether it was handed out through publication (``p``) and when it expires
(``URL_TTL_S`` after it was made), all signed with HMAC-SHA256 under a key kept in the
store (``SIGNING_KEY``, made by the first gateway that signs), so any gateway of a
deployment honours any other's URLs.  Like a bucket's signed URL it needs no API key.
The signature is checked first, and every URL it does not hold for gets the same 403,
so a URL says nothing about other checkpoints.  A URL is for its export only: once the
name is saved again its URLs are refused, and so are URLs handed out through
publication once the owner takes it back.

A file is checked against the sha256 in its record before anything is sent, and the
bytes checked are the bytes sent: on local disk both reads go through one open file
(a save of the same name meanwhile replaces the name, not the file being read), from
a bucket the file is held in memory between the check and the send.  Both reads are
done in the gateway's worker threads, in the places of one tenant of their own
(``DOWNLOADS``).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import IO
from urllib.parse import quote, urlencode

from pipeline.api.checkpoints import NotFound, external_file_key, read_record
from pipeline.api.threads import TenantThreads
from pipeline.api.wire import TinkerPath
from pipeline.io.store import ChecksumError, ObjectStore
from schemas.api import ApiError, model_run_name
from schemas.names import InvalidNameError, echoed, validate_name

URL_TTL_S = 3600  # how long a download URL is honoured (the tinker CLI asks again five minutes before)
SIGNING_KEY = "api/url-signing.key"
DOWNLOAD_PATH = "/api/v1/external_weights_files"
PIECE = 1 << 20  # bytes read and sent at a time
# The tenant whose places in the gateway's worker threads (pipeline.api.threads) downloads take.  A download carries no
# API key, and the tenant owning its model is known only from the store (a read that would itself need a place), so
# every download counts as this one tenant, which no API key can be (not a tenant name): together they hold at most
# one tenant's share of the threads, and neither whoever holds a URL nor a forged URL naming a model takes the owner's.
DOWNLOADS = "(signed-url downloads)"


class UrlRefused(ApiError):
    """A download URL whose signature does not hold or whose time is over: HTTP 403."""


@dataclass
class Download:
    """A file a signed URL names, checked against its record: its size, its sha256, and its checked bytes (an open
    local file, rewound, or the bytes read from a bucket)."""

    key: str
    size: int
    sha256: str
    handle: IO[bytes] | None = None
    data: bytes | None = None


def signing_key(store: ObjectStore) -> bytes:
    """The deployment's URL-signing key (made once, create-only, by the first gateway that signs)."""
    try:
        return store.get(SIGNING_KEY)
    except FileNotFoundError:
        with contextlib.suppress(FileExistsError):  # another gateway made it first
            store.put_create(SIGNING_KEY, secrets.token_bytes(32))
        return store.get(SIGNING_KEY)


def _signature(key: bytes, path: TinkerPath, made: str, published: str, file: str, expires: int) -> str:
    message = f"{path.model_id}\n{path.name}\n{made}\n{published}\n{file}\n{expires}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def download_urls(store: ObjectStore, path: TinkerPath, base_url: str, published: bool = False,
                  now: float | None = None) -> tuple[dict[str, str], int]:
    """One signed URL per file of an external-weights checkpoint, and when they expire (unix seconds);
    ``published``: handed to another tenant through publication (refused once it is taken back)."""
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
    made, flag = repr(record["time"]), "1" if published else "0"
    base = base_url.rstrip("/")
    urls = {}
    for file in sorted(record["files"]):
        query = urlencode({"expires": expires, "v": made, "p": flag,
                           "signature": _signature(key, path, made, flag, file, expires)})
        urls[file] = f"{base}{DOWNLOAD_PATH}/{quote(path.model_id)}/{quote(path.name)}/{quote(file)}?{query}"
    return urls, expires


def check_download(store: ObjectStore, model_id: str, name: str, file: str, expires: int, signature: str, made: str,
                   published: str, now: float | None = None) -> Download:
    """The file a signed URL names, its bytes checked against its record; ``UrlRefused`` for a URL that is not one
    of ours, is too old or no longer holds, ``NotFound`` for a file no longer there, ``ChecksumError`` for one whose
    bytes changed."""
    try:
        model_run_name(model_id)  # a model id that is not one is refused as any URL of no signature
        path = TinkerPath(model_id, "external", validate_name(name, "checkpoint name"))
        # as bytes: compare_digest refuses a str with a character beyond ASCII, which a forged URL may hold
        signed = hmac.compare_digest(_signature(signing_key(store), path, made, published, file, expires).encode(),
                                     signature.encode())
    except (InvalidNameError, ApiError):
        signed = False
    if not signed:
        raise UrlRefused("this download URL's signature does not hold; use a URL whole, as "
                         "get_external_weights_urls gave it, or ask for new URLs")
    if expires <= (time.time() if now is None else now):
        raise UrlRefused("this download URL has expired; ask for new URLs (get_external_weights_urls)")
    record = read_record(store, path, now)
    if record is None:
        raise NotFound(f"no external weights at {path} any more: deleted or expired; save them again "
                       "(save_weights_external)")
    if repr(record["time"]) != made:
        raise UrlRefused(f"{path} was saved again since this URL was made; ask for new URLs")
    if published == "1" and not record.get("public"):
        raise UrlRefused(f"{path} is no longer published; ask its owner to publish it again")
    listed = record["files"].get(file)
    if listed is None:
        raise NotFound(f"no file {echoed(file)} in external weights {path}; ask for new URLs (get_external_weights_urls)")
    download = Download(external_file_key(path, file), int(listed["size"]), str(listed["sha256"]))
    try:
        handle = store.open_input(download.key)
    except FileNotFoundError:
        raise NotFound(_partly_deleted(path, file)) from None
    digest = hashlib.sha256()
    pieces = []
    while piece := handle.read(PIECE):
        digest.update(piece)
        if not store.is_local:
            pieces.append(piece)
    if digest.hexdigest() != download.sha256:
        handle.close()
        raise ChecksumError(f"checksum mismatch for {file} of {path}: expected sha256 {download.sha256}, found "
                            f"{digest.hexdigest()}; the file is corrupt, so it was not sent: save the weights again")
    if store.is_local:
        handle.seek(0)
        download.handle = handle
    else:
        handle.close()
        download.data = b"".join(pieces)
    return download


def send(download: Download) -> Iterator[bytes]:
    """The checked bytes, in pieces."""
    if download.data is not None:
        for start in range(0, len(download.data), PIECE):
            yield download.data[start: start + PIECE]
        return
    assert download.handle is not None
    with download.handle:
        while piece := download.handle.read(PIECE):
            yield piece


async def send_in_places(download: Download, threads: TenantThreads) -> AsyncIterator[bytes]:
    """``send``, each piece read in one of ``DOWNLOADS``' places in the gateway's worker threads."""
    pieces = send(download)
    try:
        while (piece := await threads.run(DOWNLOADS, next, pieces, None)) is not None:
            yield piece
    finally:
        pieces.close()  # (a client gone before the end: the file is closed now)


def _partly_deleted(path: TinkerPath, file: str) -> str:
    return (f"{file} of {path} is missing: the checkpoint was partly deleted; delete it again (delete_checkpoint) "
            "or save it again")
