"""The object store: one root URL, any fsspec filesystem, immutable objects written create-only.

Producers, the learner and the registry keep everything durable here (``file://``
by default, ``memory://`` in unit tests, ``gs://bucket/prefix`` in production).
Keys are ``/``-separated paths relative to the root; a key that could escape the
root (``..``, an absolute path, a backslash) is refused before any I/O.

``put_create`` is the commit primitive: it never replaces an existing object, and
readers never see half an object.

- local disk: the bytes go to a temporary file in the destination folder (fsynced),
  which is then hard-linked to the final name; ``os.link`` fails with
  ``FileExistsError`` if the name exists, atomically, also across processes.  The
  folder is fsynced after the link, and so is the parent of every folder the write
  created (a new folder's name lives in its parent), so the name survives a crash
  of the machine; ``put_create_many`` fsyncs each folder once after all of its files.
- ``gs://``: a single-request upload with ``ifGenerationMatch=0`` (gcsfs
  ``mode="create"``); a clash answers 412, which gcsfs raises as ``FileExistsError``.
  The single request matters: fake-gcs-server ignores the precondition on resumable
  uploads.  Caveat: if a network error hides a successful create and gcsfs retries,
  the retry reports ``FileExistsError`` for our own object; ``put_create_once``
  reads the object back and accepts it when the bytes are ours.
- ``memory://``: check-then-write under a process-wide lock.  That is atomic between
  threads of one process only, which is all unit tests need (a memory store lives in one
  process anyway).

Other filesystems (ftp://, http(s)://, webhdfs://, ...) are refused when the store is made,
before any connection: they offer no atomic create-only write, and a check-then-write
there lets two processes both commit the same manifest, the second silently replacing the
first.

Digests are hex sha256 of the exact bytes; ``get(key, sha256)`` refuses a mismatch
with ``ChecksumError``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import threading
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

if TYPE_CHECKING:
    from schemas.config import StoreConfig

# Recent gcsfs probes a storage-layout API that the emulator lacks (and waits); it reads this at import.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_TEMP_PREFIX = ".rlpipe-tmp-"
_GCS_SIMPLE_UPLOAD_MIN = 50 * 2**20  # gcsfs's default chunk size: below it, uploads are one request anyway
_CHECK_THEN_WRITE_LOCK = threading.Lock()


def remote_failures() -> tuple[type[Exception], ...]:
    """What a ``gs://`` store raises besides ``OSError`` when its endpoint refuses or fails (gcsfs's HttpError, an
    auth error, aiohttp's client errors); imported only once something failed, gcsfs being slow to import."""
    from aiohttp import ClientError
    from gcsfs.retry import HttpError
    from google.auth.exceptions import GoogleAuthError

    return HttpError, GoogleAuthError, ClientError


# The code a store's own failure passes through: this module, and the fsspec filesystem it reads and writes with
# (a file object from ``open_input``, or ``filesystem`` handed to pyarrow, fails in those without passing here).
_STORE_MODULES = (__name__, "fsspec", "gcsfs")


def raised_by_store(exc: BaseException) -> bool:
    """True if ``exc``, or an exception it was raised ``from``, came out of the store's code: its disk, or its
    endpoint after gcsfs's retries.  The same ``OSError`` from elsewhere (transformers for a model id the hub
    does not know, requests, another disk) is not the store's."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        tb = current.__traceback__
        while tb is not None:
            module = str(tb.tb_frame.f_globals.get("__name__", ""))
            if any(module == name or module.startswith(f"{name}.") for name in _STORE_MODULES):
                return True
            tb = tb.tb_next
        current = current.__cause__
    return False


class StoreURLError(ValueError):
    """The store root URL (or its options) cannot be used."""


class InvalidKeyError(ValueError):
    """An object key that is not a plain relative path under the store root."""


class ChecksumError(ValueError):
    """An object's bytes do not match the sha256 that names them."""


def sha256_hex(data: bytes) -> str:
    """Hex sha256 of ``data``: the digest every manifest and event uses."""
    return hashlib.sha256(data).hexdigest()


def check_sha256(value: str) -> str:
    """Return ``value`` if it is a lowercase hex sha256, else raise naming the problem."""
    if not isinstance(value, str) or not _SHA256_RE.fullmatch(value):
        raise ValueError(f"{value!r} is not a sha256 digest (64 lowercase hex characters)")
    return value


def validate_key(key: str, *, allow_root: bool = False) -> str:
    """Return ``key`` normalised (no trailing '/') if it stays under the root, else ``InvalidKeyError``."""
    if not isinstance(key, str):
        raise InvalidKeyError(f"object key must be a string, got {type(key).__name__}")
    stripped = key[:-1] if allow_root and key.endswith("/") else key
    if stripped == "":
        if allow_root:
            return ""
        raise InvalidKeyError("object key is empty; name an object under the store root, e.g. 'runs/demo/run.json'")
    parts = stripped.split("/")
    if (
        "\\" in stripped
        or "\x00" in stripped
        or stripped.startswith("/")
        or "://" in stripped
        or re.match(r"[A-Za-z]:", stripped)
        or any(part in ("", ".", "..") for part in parts)
    ):
        raise InvalidKeyError(
            f"object key {key!r} is not allowed: use a relative path under the store root, parts separated by '/', "
            "without '..', '.', empty parts, backslashes or a leading '/'"
        )
    return stripped


class ObjectStore:
    """Byte-level access to everything under one root URL; see the module docstring for the guarantees."""

    def __init__(self, root: str, gcs_endpoint: str | None = None, gcs_project: str | None = None) -> None:
        if not isinstance(root, str) or not root.strip():
            raise StoreURLError("store root is empty; pass a URL such as file:///data/rlpipe or gs://bucket/prefix")
        self.protocol = _protocol(root)
        if gcs_endpoint and self.protocol != "gs":
            raise StoreURLError(f"gcs_endpoint is set but the store root {root!r} is not gs://; drop one of them")
        self.gcs_endpoint = gcs_endpoint or None
        if self.protocol == "gs":
            self._fs: Any = _gcs_filesystem(gcs_endpoint, gcs_project)
            self._root_path = _gcs_root_path(root)
        else:
            _check_create_only(root, self.protocol)
            self._fs, path = _fsspec_filesystem(root)
            self._root_path = path.rstrip("/")
        self.root = self._fs.unstrip_protocol(self._root_path or "/").rstrip("/")
        if self.protocol == "gs":
            self.root = f"gs://{self._root_path}"
        self._is_local = isinstance(self._fs, LocalFileSystem)

    @classmethod
    def from_config(cls, config: StoreConfig) -> ObjectStore:
        """The store a run's ``store`` section points at (an empty root is resolved by the caller)."""
        return cls(config.root, gcs_endpoint=config.gcs_endpoint, gcs_project=config.gcs_project)

    def __repr__(self) -> str:
        endpoint = f", gcs_endpoint={self.gcs_endpoint!r}" if self.gcs_endpoint else ""
        return f"ObjectStore({self.root!r}{endpoint})"

    # -- accessors --------------------------------------------------------------------------

    @property
    def filesystem(self) -> Any:
        """The fsspec filesystem (hand it with ``path(key)`` to ``pyarrow.dataset``)."""
        return self._fs

    @property
    def is_local(self) -> bool:
        """True for a local-disk root (create-only writes are atomic across processes)."""
        return self._is_local

    def path(self, key: str = "") -> str:
        """The filesystem path of ``key`` (no protocol), as ``filesystem`` expects it."""
        key = validate_key(key, allow_root=True)
        return f"{self._root_path}/{key}" if key else self._root_path or "/"

    def url(self, key: str = "") -> str:
        """The full URL of ``key`` (for messages and for people)."""
        key = validate_key(key, allow_root=True)
        return f"{self.root}/{key}" if key else self.root

    def key_of(self, path: str) -> str:
        """Inverse of ``path``: the key of a filesystem path under the root."""
        stripped = self._fs._strip_protocol(path).rstrip("/")
        prefix = f"{self._root_path}/"
        if not stripped.startswith(prefix):
            raise InvalidKeyError(f"{path!r} is not under the store root {self.root}")
        return stripped[len(prefix) :]

    # -- writes ------------------------------------------------------------------------------

    def put_create(self, key: str, data: bytes) -> str:
        """Write ``data`` at ``key`` only if nothing is there (``FileExistsError`` otherwise); return its sha256."""
        data = bytes(data)
        path = self.path(validate_key(key))
        if self._is_local:
            self._local_write(path, data, replace=False)
        elif self.protocol == "gs":
            chunksize = max(_GCS_SIMPLE_UPLOAD_MIN, len(data) + 1)  # one request, so the precondition holds
            try:
                self._fs.pipe_file(path, data, mode="create", chunksize=chunksize)
            except FileExistsError:
                raise FileExistsError(f"{self.url(key)} already exists") from None
        else:
            with _CHECK_THEN_WRITE_LOCK:
                if self._fs.exists(path):
                    raise FileExistsError(f"{self.url(key)} already exists")
                self._fs.pipe_file(path, data)
        return sha256_hex(data)

    def put_create_once(self, key: str, data: bytes) -> str:
        """``put_create`` that survives a retried create: if ``key`` already holds exactly ``data``, that is
        this write having landed (a gs:// retry reports ``FileExistsError`` for our own object), so it
        returns the digest; an object with other bytes still raises ``FileExistsError``."""
        data = bytes(data)
        try:
            return self.put_create(key, data)
        except FileExistsError:
            if self.get(key) != data:
                raise
            if self._is_local:  # the attempt that linked it may have died before syncing its folder
                _fsync_dir(Path(self.path(key)).parent)
            return sha256_hex(data)

    def put_create_many(self, files: Mapping[str, bytes]) -> dict[str, str]:
        """``put_create_once`` for each of ``files`` (key -> bytes), in order; their digests by key.

        Every key is checked before anything is written.  On local disk each file's bytes are
        fsynced before it is linked, as always, and each folder's new names are made durable by one
        fsync of that folder after the last file, instead of one per file (and the parent of each
        folder made for them once): a checkpoint's three files cost five fsyncs instead of eight.
        Nothing is durable until this returns, so a caller commits (writes the manifest that names
        these files) only after it.
        """
        items = [(validate_key(key), bytes(data)) for key, data in files.items()]
        if not self._is_local:
            return {key: self.put_create_once(key, data) for key, data in items}
        digests: dict[str, str] = {}
        folders: dict[Path, None] = {}
        for key, data in items:
            path = self.path(key)
            try:
                folders.update(dict.fromkeys(self._local_write(path, data, replace=False, sync_folder=False)))
            except FileExistsError:
                if self.get(key) != data:
                    raise
                folders[Path(path).parent] = None  # an attempt that died before syncing it may have linked it
            digests[key] = sha256_hex(data)
        for folder in folders:
            _fsync_dir(folder)
        return digests

    def put(self, key: str, data: bytes) -> str:
        """Write ``data`` at ``key``, replacing what is there (mutable objects only); return its sha256."""
        data = bytes(data)
        path = self.path(validate_key(key))
        if self._is_local:
            self._local_write(path, data, replace=True)
        else:
            self._fs.pipe_file(path, data)
        return sha256_hex(data)

    def delete(self, key: str, recursive: bool = False, missing_ok: bool = False) -> None:
        """Remove the object (or, with ``recursive``, everything under the folder) at ``key``."""
        path = self.path(validate_key(key))
        try:
            self._fs.rm(path, recursive=recursive)
        except FileNotFoundError:
            if not missing_ok:
                raise FileNotFoundError(f"nothing to delete at {self.url(key)}") from None

    def remove_empty_folder(self, key: str) -> None:
        """Remove the folder at ``key`` if it holds nothing (a local store's; object stores have no folders)."""
        if self._is_local:
            with contextlib.suppress(OSError):  # not empty (written meanwhile), or already gone
                os.rmdir(self.path(validate_key(key)))

    # -- reads -------------------------------------------------------------------------------

    def get(self, key: str, sha256: str | None = None) -> bytes:
        """The bytes at ``key``; with ``sha256``, refuse them (``ChecksumError``) unless they match."""
        if sha256 is not None:
            check_sha256(sha256)
        try:
            data = bytes(self._fs.cat_file(self.path(validate_key(key))))
        except FileNotFoundError:
            raise FileNotFoundError(f"no object at {self.url(key)}") from None
        if sha256 is not None:
            actual = sha256_hex(data)
            if actual != sha256:
                raise ChecksumError(
                    f"checksum mismatch for {self.url(key)}: expected sha256 {sha256}, found {actual}; "
                    "the object is corrupt or was replaced, so it was not used"
                )
        return data

    def exists(self, key: str) -> bool:
        """True if an object (or a folder holding objects) is at ``key``."""
        return bool(self._fs.exists(self.path(validate_key(key))))

    def open_input(self, key: str) -> IO[bytes]:
        """A binary file object for reading ``key`` in pieces (close it, or use ``with``)."""
        try:
            return self._fs.open(self.path(validate_key(key)), "rb")  # type: ignore[no-any-return]
        except FileNotFoundError:
            raise FileNotFoundError(f"no object at {self.url(key)}") from None

    def list(self, prefix: str = "", recursive: bool = False) -> list[str]:
        """Keys under ``prefix``, sorted: its direct children (objects and folders), or with
        ``recursive`` every object below it.  A missing prefix lists as empty."""
        path = self.path(validate_key(prefix, allow_root=True))
        try:
            names = self._fs.find(path) if recursive else self._fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        keys = (self.key_of(name) for name in names if self._fs._strip_protocol(name).rstrip("/") != path)
        return sorted(key for key in keys if not key.rsplit("/", 1)[-1].startswith(_TEMP_PREFIX))

    # -- local atomic writes -----------------------------------------------------------------

    def _local_write(self, path: str, data: bytes, replace: bool, sync_folder: bool = True) -> list[Path]:
        """The bytes to a fsynced temporary file, linked (or renamed, ``replace``) to ``path``; the folders
        whose names changed (``path``'s, then the parent of each folder made for it), fsynced here with
        ``sync_folder``, so the new name survives a crash of the machine."""
        final = Path(path)
        changed = [final.parent, *_make_folders(final.parent)]
        temp = final.parent / f"{_TEMP_PREFIX}{uuid.uuid4().hex}-{final.name}"
        try:
            with open(temp, "xb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            if replace:
                os.replace(temp, final)
            else:
                os.link(temp, final)  # atomic; raises FileExistsError if the name is taken
        except FileExistsError:
            raise FileExistsError(f"{self._fs.unstrip_protocol(path)} already exists") from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                temp.unlink()
        if sync_folder:
            for folder in changed:
                _fsync_dir(folder)
        return changed


Record = TypeVar("Record")


def read_json_records(store: ObjectStore, prefix: str, parse: Callable[[bytes, str], Record]
                      ) -> tuple[list[Record], list[ValueError | FileNotFoundError]]:
    """Every ``*.json`` under ``prefix`` that ``parse(data, key)`` reads, and why each other one could not be read:
    its ``ValueError`` naming the key, or the ``FileNotFoundError`` of one deleted while listed.  The errors are
    kept, not only their lines, so a caller can tell a record written by a newer rlpipe
    (``schemas.versions.NewerSchemaError``: upgrade to read it) from a damaged one."""
    records, unreadable = [], []
    for key in store.list(prefix, recursive=True):
        if not key.endswith(".json"):
            continue
        try:
            records.append(parse(store.get(key), key))
        except (ValueError, FileNotFoundError) as exc:
            unreadable.append(exc)
    return records, unreadable


def _make_folders(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing ancestors; the parent of each one created, innermost first."""
    missing = []
    while not folder.exists() and folder.parent != folder:
        missing.append(folder)
        folder = folder.parent
    for new in reversed(missing):
        new.mkdir(exist_ok=True)  # another writer may make it meanwhile
    return [new.parent for new in missing]


def _fsync_dir(folder: Path) -> None:
    """Make the new directory entry durable (best effort; not every platform allows it)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _protocol(root: str) -> str:
    protocol = fsspec.utils.get_protocol(root)
    return "gs" if protocol in ("gs", "gcs") else protocol


def _gcs_root_path(root: str) -> str:
    path = root.split("://", 1)[1].strip("/")
    if not path:
        raise StoreURLError(f"store root {root!r} names no bucket; use gs://BUCKET or gs://BUCKET/PREFIX")
    bucket = path.split("/", 1)[0]
    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]{1,221}[a-z0-9]", bucket):
        raise StoreURLError(f"{bucket!r} in {root!r} is not a valid GCS bucket name (lowercase letters, digits, -_.)")
    return path


def _check_create_only(root: str, protocol: str) -> None:
    """Refuse a root whose filesystem has no atomic create-only write (module docstring), before it is made."""
    try:
        filesystem = fsspec.get_filesystem_class(protocol)
    except (ValueError, ImportError) as exc:
        raise StoreURLError(
            f"cannot open store root {root!r}: {exc}; use file:///path, memory://name or gs://bucket/prefix"
        ) from None
    if not issubclass(filesystem, LocalFileSystem | MemoryFileSystem):
        raise StoreURLError(
            f"store root {root!r}: {protocol}:// has no atomic create-only write, so two processes could both "
            "commit the same manifest or batch; use file:///path (a local or mounted disk), gs://bucket/prefix, "
            "or memory://name in tests"
        )


def _fsspec_filesystem(root: str) -> tuple[Any, str]:
    try:
        return fsspec.core.url_to_fs(root)
    except (ValueError, ImportError) as exc:
        raise StoreURLError(
            f"cannot open store root {root!r}: {exc}; use file:///path, memory://name or gs://bucket/prefix"
        ) from None


def _gcs_filesystem(endpoint: str | None, project: str | None) -> Any:
    """gcsfs against ``endpoint`` (an emulator: anonymous) or Google (Application Default Credentials).

    Listings are not cached: other processes publish versions and batches, and a
    stale listing would hide them.
    """
    if endpoint:
        if not re.match(r"https?://", endpoint):
            raise StoreURLError(f"gcs_endpoint {endpoint!r} must start with http:// or https://")
        from gcsfs.core import GCSFileSystem  # the plain class: the emulator lacks the HNS layout API

        return GCSFileSystem(
            endpoint_url=endpoint.rstrip("/"), token="anon", project=project or "rlpipe", use_listings_cache=False
        )
    import gcsfs
    from google.auth.exceptions import GoogleAuthError

    kwargs: dict[str, Any] = {"token": "google_default", "use_listings_cache": False}
    if project:
        kwargs["project"] = project
    try:
        return gcsfs.GCSFileSystem(**kwargs)
    except (GoogleAuthError, ValueError) as exc:  # no default credentials, or another default project
        raise StoreURLError(
            f"no Google credentials for gs:// ({exc.__class__.__name__}); run `gcloud auth application-default "
            "login`, set GOOGLE_APPLICATION_CREDENTIALS, or pass a gcs endpoint for the emulator"
        ) from None
